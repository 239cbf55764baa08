"""The peer-lost report: which peers one srun step of a job lost, and what its survivors committed.

`<job dir>/peer-lost-<job id>-<restart count>-<step id>.json`, one per srun step that lost a
peer, written (temp name, rename) by the survivor that commits the just-in-time checkpoint:
first with "commit": "pending" as soon as the survivors agree, then replaced once with
"done" or "failed". The controller may act on the first version (the lost nodes are known);
the resume step is `committed_step` once "commit" is "done", else the last committed
checkpoint. A job's word: the controller uses it for this job only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from slurm_elastic.errors import JobFileRefused
from slurm_elastic.jobfiles.names import valid_node_name
from slurm_elastic.jobfiles.reading import field_float, field_object, load_json
from slurm_elastic.jobfiles.records import MAX_TIME

PEER_LOST_FORMAT = "slurm-elastic-peer-lost/1"
COMMIT_STATES = ("pending", "done", "failed", "none")   # none: nothing to commit (no full replica survived)
DETECTORS = ("heartbeat", "collective-error")
_MAX_LIST = 1 << 16


@dataclass(frozen=True, slots=True)
class LostRank:
    rank: int
    node: str


@dataclass(frozen=True, slots=True)
class PeerLostReport:
    """Which peers one srun step of a job lost, and what the survivors committed."""

    job_id: str
    restart_count: int
    step_id: int
    world_size: int
    detected_by: str                  # one of DETECTORS
    detected_at: float                # unix time the first survivor saw it (finite, never trusted to decide)
    lost: tuple[LostRank, ...]        # every rank that did not take part in the agreement
    lost_nodes: tuple[str, ...]       # nodes none of whose ranks survived: the ones to avoid
    surviving_nodes: tuple[str, ...]
    agreed_step: int | None           # the last step every survivor completed (None: no full replica)
    commit: str                       # one of COMMIT_STATES
    committed_step: int | None        # the step the job resumes from when commit == "done"
    reason: str                       # one line for people

    def to_json(self) -> dict[str, Any]:
        body = {f: getattr(self, f) for f in self.__slots__}
        body["lost"] = [{"rank": r.rank, "node": r.node} for r in self.lost]
        body["lost_nodes"] = list(self.lost_nodes)
        body["surviving_nodes"] = list(self.surviving_nodes)
        body["format"] = PEER_LOST_FORMAT
        return body

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), allow_nan=False).encode()

    @classmethod
    def parse(cls, data: bytes | str, where: str = "peer-lost report") -> PeerLostReport:
        """Validate a report's bytes (its user's data: checked, never trusted further); JobFileRefused if bad."""
        try:
            return cls.from_value(load_json(data))
        except JobFileRefused as exc:
            raise JobFileRefused(f"{where}: {exc}") from None

    @classmethod
    def from_value(cls, value: object) -> PeerLostReport:
        """Validate a report's JSON value (reading.read_record's `parse`)."""
        body = field_object(value)
        if body.get("format") != PEER_LOST_FORMAT:
            raise JobFileRefused(f"is not a {PEER_LOST_FORMAT} document")
        try:
            lost_list, lost_nodes, alive = body["lost"], body["lost_nodes"], body["surviving_nodes"]
            for seq in (lost_list, lost_nodes, alive):
                if not isinstance(seq, list) or len(seq) > _MAX_LIST:
                    raise ValueError(f"{type(seq).__name__} is not a list of at most {_MAX_LIST}")
            lost = tuple(LostRank(_nonneg(field_object(r)["rank"]), _name(r["node"])) for r in lost_list)
            reason = body["reason"]
            if not isinstance(reason, str):
                raise ValueError("reason is not a string")
            report = cls(job_id=_name(body["job_id"]), restart_count=_nonneg(body["restart_count"]),
                         step_id=_nonneg(body["step_id"]), world_size=_nonneg(body["world_size"]),
                         detected_by=_choice(body["detected_by"], DETECTORS),
                         detected_at=field_float(body, "detected_at", 0.0, MAX_TIME),  # type: ignore[arg-type]
                         lost=lost, lost_nodes=tuple(_name(n) for n in lost_nodes),
                         surviving_nodes=tuple(_name(n) for n in alive),
                         agreed_step=_opt_nonneg(body["agreed_step"]), commit=_choice(body["commit"], COMMIT_STATES),
                         committed_step=_opt_nonneg(body["committed_step"]), reason=reason[:1000])
        except JobFileRefused:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise JobFileRefused(f"malformed ({type(exc).__name__}: {str(exc)[:200]})") from None
        if any(r.rank >= report.world_size for r in report.lost):
            raise JobFileRefused(f"a lost rank is outside the world size {report.world_size}")
        return report


def _name(value: Any) -> str:
    if not valid_node_name(value):
        raise ValueError(f"{str(value)[:80]!r} is not a node name or job id")
    return value


def _nonneg(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**62:
        raise ValueError(f"{str(value)[:80]!r} is not a non-negative integer")
    return value


def _opt_nonneg(value: Any) -> int | None:
    return None if value is None else _nonneg(value)


def _choice(value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{str(value)[:80]!r} is not one of {', '.join(allowed)}")
    return value
