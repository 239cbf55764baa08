"""The small records a job writes into its directory: geometry, batch range, ACK, launcher-stopped, heartbeat.

Each has one writer (`to_bytes`) used by whoever writes it, and one
validating reader (`parse`, through reading.read_record) used by whoever
reads it; `parse` raises JobFileRefused (a ValueError) for anything else.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from slurm_elastic.errors import JobFileRefused
from slurm_elastic.jobfiles.names import END_CAUSES, RANKS_KEPT, RELAUNCHES_IN_PLACE, end_cause_file_name
from slurm_elastic.jobfiles.reading import field_float, field_int, field_object, read_user_file

MAX_WORLD = 10**5
MAX_BATCH = 10**8
MAX_STEP = 10**12
MAX_TIME = 1e11                 # unix seconds (year 5138): later is not a clock
MAX_VALID_SIZES = 4096

GEOMETRY_MAX_BYTES = 1 << 14    # geometry.json is a few hundred bytes; more is not the shim's
BATCH_MAX_BYTES = 1 << 12       # batch.json is three numbers
ACK_MAX_BYTES = 1 << 10
LAUNCHER_STOPPED_MAX_BYTES = 64
HEARTBEAT_MAX_BYTES = 1 << 10


def _dump(body: dict) -> bytes:
    return json.dumps(body, allow_nan=False, sort_keys=True).encode()


@dataclass(frozen=True, slots=True)
class Geometry:
    """`geometry.json`, written by rank 0 at attach: the world sizes the global batch can be split over."""

    world_size: int
    valid_world_sizes: tuple[int, ...]
    global_batch: int | None = None
    micro_batch: int | None = None
    nearest_valid_world_size: int | None = None

    @property
    def stuck(self) -> bool:
        """The ranks ran at a size the global batch cannot be split over: they exited 87."""
        return self.world_size not in self.valid_world_sizes

    def to_bytes(self) -> bytes:
        body: dict = {"world_size": self.world_size, "valid_world_sizes": list(self.valid_world_sizes)}
        for name in ("global_batch", "micro_batch", "nearest_valid_world_size"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        return _dump(body)

    @classmethod
    def parse(cls, value: object) -> Geometry:
        body = field_object(value)
        world = field_int(body, "world_size", 1, MAX_WORLD)
        valid = body.get("valid_world_sizes")
        if not isinstance(valid, list) or not valid or len(valid) > MAX_VALID_SIZES or not all(
                isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_WORLD for v in valid):
            raise JobFileRefused("has no valid world_size and valid_world_sizes")
        return cls(world, tuple(sorted(set(valid))),  # type: ignore[arg-type]
                   global_batch=field_int(body, "global_batch", 1, MAX_BATCH, optional=True),
                   micro_batch=field_int(body, "micro_batch", 1, MAX_BATCH, optional=True),
                   nearest_valid_world_size=field_int(body, "nearest_valid_world_size", 1, MAX_WORLD, optional=True))


@dataclass(frozen=True, slots=True)
class BatchRange:
    """`batch.json` of an adaptive-batch job: the global batches the shim may choose from, and the batch its
    learning rate was tuned for."""

    min: int
    max: int
    base: int

    def to_bytes(self) -> bytes:
        return _dump({"min": self.min, "max": self.max, "base": self.base})

    @classmethod
    def parse(cls, value: object) -> BatchRange:
        body = field_object(value)
        values = [body.get(k) for k in ("min", "max", "base")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_BATCH for v in values):
            raise JobFileRefused(f"has no valid min, max and base (integers 1-{MAX_BATCH})")
        lo, hi, base = values
        if lo > hi:  # type: ignore[operator]
            raise JobFileRefused(f"has min {lo} above max {hi}")
        return cls(lo, hi, base)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Ack:
    """`ACK-<job>-<restart>`: rank 0's word that the signalled checkpoint is settled before it exits 85."""

    step: int | None          # the last committed step (None: none yet)
    time: float               # unix time it was written
    committed: bool           # the step armed by the signal is the one committed
    world_size: int

    def to_bytes(self) -> bytes:
        return _dump({"step": self.step, "time": self.time, "committed": self.committed,
                      "world_size": self.world_size})

    @classmethod
    def parse(cls, value: object) -> Ack:
        body = field_object(value)
        committed = body.get("committed")
        if not isinstance(committed, bool):
            raise JobFileRefused("has no valid committed (true or false)")
        return cls(step=field_int(body, "step", 0, MAX_STEP, optional=True),
                   time=field_float(body, "time", 0.0, MAX_TIME),  # type: ignore[arg-type]
                   committed=committed, world_size=field_int(body, "world_size", 1, MAX_WORLD))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class LauncherStopped:
    """`launcher-stopped-<job>-<restart>-<step>`, written by the batch script after a peer loss: it stopped
    that step's srun ("stopped"), and relaunches the ranks if the running job is shrunk instead of requeued
    ("in-place"); or the survivors went on in their processes and the srun still runs ("kept": the script
    goes on in place too).

    Plain text, not JSON (a shell writes it): any other content means stopped only.
    """

    in_place: bool
    srun_running: bool = False

    def to_bytes(self) -> bytes:
        word = RANKS_KEPT if self.srun_running else RELAUNCHES_IN_PLACE if self.in_place else "stopped"
        return (word + "\n").encode()

    @classmethod
    def parse_bytes(cls, data: bytes) -> LauncherStopped:
        word = data.strip()
        if word == RANKS_KEPT.encode():
            return cls(in_place=True, srun_running=True)
        return cls(in_place=word == RELAUNCHES_IN_PLACE.encode())


END_CAUSE_MAX_BYTES = 64


def parse_end_cause(data: bytes) -> str | None:
    """`ENDED-<job>-<restart>` (plain text, a shell writes it): one of END_CAUSES, else None."""
    text = data.decode("ascii", errors="replace").strip()
    return text if text in END_CAUSES else None


def read_end_cause(job_dir: str, slurm_job_id: str | int, restart_count: int, *, owner_uid: int | None) -> str | None:
    """What the job template wrote of incarnation `restart_count`'s end, read as every job file (owner,
    size, no link or FIFO); None when there is none or it is not one of END_CAUSES."""
    try:
        data = read_user_file(os.path.join(job_dir, end_cause_file_name(slurm_job_id, restart_count)),
                              owner_uid=owner_uid, max_bytes=END_CAUSE_MAX_BYTES, what="an end cause")
    except (JobFileRefused, OSError):
        return None
    return None if data is None else parse_end_cause(data)


HEARTBEAT_STATES = ("running", "done", "failed")


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """`run-.../hb-<rank>`: a rank's liveness counter, rewritten every interval; read by its peers."""

    seq: int
    rank: int
    node: str
    pid: int
    state: str                # one of HEARTBEAT_STATES

    def to_bytes(self) -> bytes:
        return _dump({"seq": self.seq, "rank": self.rank, "node": self.node, "pid": self.pid, "state": self.state})

    @classmethod
    def parse(cls, value: object) -> Heartbeat:
        body = field_object(value)
        node, state = body.get("node"), body.get("state")
        if not isinstance(node, str) or len(node) > 255:
            raise JobFileRefused("has no valid node (a host name)")
        if state not in HEARTBEAT_STATES:
            raise JobFileRefused(f"has no valid state (one of {', '.join(HEARTBEAT_STATES)})")
        return cls(seq=field_int(body, "seq", 0, 2**62), rank=field_int(body, "rank", 0, MAX_WORLD),  # type: ignore[arg-type]
                   node=node, pid=field_int(body, "pid", 1, 2**31), state=state)  # type: ignore[arg-type]
