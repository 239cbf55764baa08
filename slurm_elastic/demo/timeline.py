"""The demo's timeline: what happened when (demo actions, Slurm's view, training progress) as JSON-able events."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Iterable, Union

from slurm_elastic.errors import ElasticError

# Kinds of demo actions the summary and the plot treat as node events.
NODE_LOST = "node_lost"
NODE_GAINED = "node_gained"
NODE_ACTIONS = (NODE_LOST, NODE_GAINED)


@dataclass(frozen=True, slots=True)
class DemoAction:
    """Something the demo itself did (submit, kill a node, start a spare, stop)."""

    kind: ClassVar[str] = "action"
    t: float                 # seconds since the demo started
    action: str              # submit | daemon | node_lost | node_gained | stop | note
    subject: str = ""        # node name or job id
    text: str = ""


@dataclass(frozen=True, slots=True)
class NodeSeen:
    """Slurm's state of a node changed (first observation included)."""

    kind: ClassVar[str] = "node"
    t: float
    node: str
    state: str               # e.g. "idle", "mixed+not_responding", "down"
    available: bool          # gives capacity to elastic work
    gpus: int = 0


@dataclass(frozen=True, slots=True)
class JobSeen:
    """Slurm's view of a job changed: state, size, nodes, restart count or start time."""

    kind: ClassVar[str] = "job"
    t: float
    job: str
    state: str               # JobState value, e.g. "RUNNING"
    gpus: int                # held while running, asked for while pending
    nodes: tuple[str, ...] = ()
    restarts: int = 0
    start: float | None = None  # Slurm's start time of this run, in demo seconds (running jobs only)
    held: bool = False
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Progress:
    """One row of the shim's metrics.jsonl: the job reached `step` at `t` with `gpus` ranks."""

    kind: ClassVar[str] = "progress"
    t: float
    job: str
    step: int
    gpus: int
    steps_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Acked:
    """The shim acknowledged a signalled checkpoint (ACK-<job>-<restart> appeared) at `step`."""

    kind: ClassVar[str] = "ack"
    t: float
    job: str
    restart: int             # the Slurm restart count of the run that wrote it
    step: int | None


@dataclass(frozen=True, slots=True)
class ControllerNote:
    """A line the controller daemon logged about a decision (a plan, a node lost or gained)."""

    kind: ClassVar[str] = "controller"
    t: float
    text: str


Event = Union[DemoAction, NodeSeen, JobSeen, Progress, Acked, ControllerNote]
_KINDS: dict[str, type] = {cls.kind: cls for cls in (DemoAction, NodeSeen, JobSeen, Progress, Acked, ControllerNote)}


@dataclass(frozen=True, slots=True)
class JobInfo:
    """One of the demo's jobs: Slurm id, a readable name and its GPU range."""

    job: str
    name: str
    min_gpus: int
    max_gpus: int


@dataclass(frozen=True, slots=True)
class Timeline:
    """Everything the demo observed, in time order; `started_at` is the epoch time of t=0."""

    started_at: float
    jobs: tuple[JobInfo, ...]
    events: tuple[Event, ...]
    ended_at: float | None = None   # demo seconds at which recording stopped

    @property
    def duration(self) -> float:
        if self.ended_at is not None:
            return self.ended_at
        return max((e.t for e in self.events), default=0.0)

    def of(self, cls: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, cls)]

    def name_of(self, job: str) -> str:
        for info in self.jobs:
            if info.job == job:
                return info.name
        return job

    # -- one JSON object per line: a header, then the events -----------------------------------
    def to_jsonl(self) -> str:
        header = {"kind": "header", "started_at": self.started_at, "ended_at": self.ended_at,
                  "jobs": [asdict(j) for j in self.jobs]}
        lines = [json.dumps(header, sort_keys=True)]
        lines += [json.dumps(event_to_json(e), sort_keys=True) for e in self.events]
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> None:
        path.write_text(self.to_jsonl(), encoding="utf-8")

    @classmethod
    def from_jsonl(cls, text: str) -> Timeline:
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            raise ElasticError("empty timeline: expected a header line and events")
        try:
            header = json.loads(lines[0])
            if header.get("kind") != "header":
                raise ValueError("the first line is not the header")
            jobs = tuple(JobInfo(**j) for j in header["jobs"])
            events = tuple(event_from_json(json.loads(line)) for line in lines[1:])
        except (ValueError, KeyError, TypeError) as exc:
            raise ElasticError(f"malformed timeline: {exc}") from None
        return cls(started_at=float(header["started_at"]), jobs=jobs, events=in_time_order(events),
                   ended_at=header.get("ended_at"))

    @classmethod
    def read(cls, path: Path) -> Timeline:
        return cls.from_jsonl(path.read_text(encoding="utf-8"))


def event_to_json(event: Event) -> dict[str, Any]:
    body = {f.name: getattr(event, f.name) for f in fields(event)}
    if isinstance(event, JobSeen):
        body["nodes"] = list(event.nodes)
    body["kind"] = event.kind
    return body


def event_from_json(body: dict[str, Any]) -> Event:
    body = dict(body)
    cls = _KINDS.get(body.pop("kind", None))
    if cls is None:
        raise ValueError(f"unknown event kind in {body!r}")
    if cls is JobSeen:
        body["nodes"] = tuple(body.get("nodes", ()))
    return cls(**body)  # type: ignore[no-any-return]


def in_time_order(events: Iterable[Event]) -> tuple[Event, ...]:
    # Stable: events observed in the same poll keep their order.
    return tuple(sorted(events, key=lambda e: e.t))
