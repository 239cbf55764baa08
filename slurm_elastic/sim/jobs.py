"""What the simulator knows about one job: its arrival, size bounds, work and speed model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from slurm_elastic.errors import TraceError


@runtime_checkable
class SpeedModel(Protocol):
    """Work units per second at a placement (GPUs per node, zeros dropped)."""

    def __call__(self, placement: tuple[int, ...]) -> float: ...


@dataclass(frozen=True, slots=True)
class Segment:
    """How a job runs on a placement until its speed next changes (an epoch boundary, for Pollux jobs).

    `batch`, `steps_per_s` and `noise` are what its shim would measure and
    write (0 / None when the model does not know them).
    """

    rate: float           # work units per second
    until: float          # work left before the rate changes (inf: never)
    batch: int = 0
    steps_per_s: float = 0.0
    noise: object = None  # goodput.GradientNoise, per sample


@runtime_checkable
class SegmentedSpeed(Protocol):
    """A speed that changes with the job's own progress (statistical progress, a batch chosen per epoch).

    The engine asks at every start and whenever the last segment's work is
    done; `__call__` (SpeedModel) stays the stateless estimate for policies.
    """

    def __call__(self, placement: tuple[int, ...]) -> float: ...

    def segment(self, placement: tuple[int, ...], done: float) -> Segment: ...


@dataclass(frozen=True, slots=True)
class SimJob:
    """One job of a workload.

    `work` is in the units of `speed` (iterations for Pollux profiles,
    seconds at one GPU for generic traces), so a job at a fixed placement
    needs `work / speed(placement)` seconds of uninterrupted running.
    `restart_overhead_s` and `checkpoint_interval_s` left as None take the
    run's defaults (`RestartModel`).
    """

    key: str
    submit_s: float
    requested_gpus: int
    min_gpus: int
    max_gpus: int
    work: float
    speed: SpeedModel
    cpus_per_gpu: int = 1
    mem_per_gpu_mb: int = 1024
    application: str = ""
    weight: float = 1.0
    restart_overhead_s: float | None = None
    checkpoint_interval_s: float | None = None

    def __post_init__(self) -> None:
        where = f"job {self.key!r}"
        if not self.key:
            raise TraceError("a job needs a non-empty name")
        if not math.isfinite(self.submit_s) or self.submit_s < 0:
            raise TraceError(f"{where}: submit time must be >= 0 seconds, got {self.submit_s!r}")
        for name in ("requested_gpus", "min_gpus", "max_gpus"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise TraceError(f"{where}: {name} must be a positive integer, got {v!r}")
        if not self.min_gpus <= self.requested_gpus <= self.max_gpus:
            raise TraceError(f"{where}: requested GPUs {self.requested_gpus} outside "
                             f"[min {self.min_gpus}, max {self.max_gpus}]")
        if not math.isfinite(self.work) or self.work <= 0:
            raise TraceError(f"{where}: work must be a positive number, got {self.work!r}")
        if not math.isfinite(self.weight) or self.weight <= 0:
            raise TraceError(f"{where}: weight must be positive, got {self.weight!r}")
        for name in ("restart_overhead_s", "checkpoint_interval_s"):
            v = getattr(self, name)
            if v is not None and (not math.isfinite(v) or v < 0):
                raise TraceError(f"{where}: {name} must be >= 0, got {v!r}")

    @property
    def elastic(self) -> bool:
        return self.min_gpus < self.max_gpus

    def runtime_at(self, placement: tuple[int, ...]) -> float:
        """Seconds of uninterrupted running at `placement` to do all the work."""
        return self.work / self.speed(placement)


def packed_placement(gpus: int, gpus_per_node: int, nodes: int | None = None) -> tuple[int, ...]:
    """`gpus` spread over the fewest nodes (or exactly `nodes` nodes, as evenly as possible)."""
    if gpus <= 0:
        return ()
    if nodes is None or nodes < 1:
        nodes = -(-gpus // gpus_per_node)
    nodes = min(nodes, gpus)
    base, extra = divmod(gpus, nodes)
    return tuple(base + 1 if i < extra else base for i in range(nodes))
