"""The generic workload CSV: submit time, GPUs (requested, min, max), duration or GPU-seconds, optional speedups."""

from __future__ import annotations

from pathlib import Path

from slurm_elastic.errors import TraceError
from slurm_elastic.sim.jobs import SimJob, SpeedModel, packed_placement
from slurm_elastic.sim.speed import AmdahlSpeed, TableSpeed
from slurm_elastic.sim.tables import integer, number, read_rows

REQUIRED = ("submit_s", "gpus")
DEFAULT_SPEED = AmdahlSpeed(serial_fraction=0.05, node_penalty=0.05)


def load_generic(path: Path, *, gpus_per_node: int = 4, default_speed: SpeedModel = DEFAULT_SPEED) -> list[SimJob]:
    """Columns: `submit_s`, `gpus` (requested), and exactly one of `duration_s` (run time at the requested
    GPUs) or `gpu_seconds` (GPU-seconds used at the requested size); optional `name`, `min_gpus`,
    `max_gpus` (default: the requested count, i.e. rigid), `speedup` (`1:1;2:1.9;4:3.5`: speed relative
    to one GPU; default Amdahl with 5 % serial work and 5 % slowdown per extra node), `cpus_per_gpu`,
    `mem_per_gpu_mb`, `weight`, `restart_overhead_s`.
    """
    path = Path(path)
    jobs: list[SimJob] = []
    seen: set[str] = set()
    has_duration = has_gpu_s = False
    for line, row in read_rows(path, REQUIRED):
        has_duration = has_duration or "duration_s" in row
        has_gpu_s = has_gpu_s or "gpu_seconds" in row
        if not (has_duration or has_gpu_s):
            raise TraceError(f"{path}: missing column duration_s or gpu_seconds (one is required)")
        name = row.get("name") or f"job-{line - 1}"
        if name in seen:
            raise TraceError(f"{path}:{line}: duplicate job name {name!r}")
        seen.add(name)
        gpus = integer(path, line, "gpus", row["gpus"])
        lo = integer(path, line, "min_gpus", row["min_gpus"]) if row.get("min_gpus") else gpus
        hi = integer(path, line, "max_gpus", row["max_gpus"]) if row.get("max_gpus") else gpus
        if not lo <= gpus <= hi:
            raise TraceError(f"{path}:{line}: gpus {gpus} must lie in [min_gpus {lo}, max_gpus {hi}]")
        if row.get("duration_s") and row.get("gpu_seconds"):
            raise TraceError(f"{path}:{line}: give duration_s or gpu_seconds, not both")
        if row.get("duration_s"):
            duration = number(path, line, "duration_s", row["duration_s"])
        elif row.get("gpu_seconds"):
            duration = number(path, line, "gpu_seconds", row["gpu_seconds"]) / gpus
        else:
            raise TraceError(f"{path}:{line}: empty duration_s and gpu_seconds (one is required)")
        if duration <= 0:
            raise TraceError(f"{path}:{line}: the job's run time must be > 0 seconds")
        speed: SpeedModel = TableSpeed.parse(row["speedup"]) if row.get("speedup") else default_speed
        try:
            jobs.append(SimJob(
                key=name, submit_s=number(path, line, "submit_s", row["submit_s"]),
                requested_gpus=gpus, min_gpus=lo, max_gpus=hi,
                work=duration * speed(packed_placement(gpus, gpus_per_node)), speed=speed,
                cpus_per_gpu=integer(path, line, "cpus_per_gpu", row["cpus_per_gpu"], minimum=0)
                if row.get("cpus_per_gpu") else 1,
                mem_per_gpu_mb=integer(path, line, "mem_per_gpu_mb", row["mem_per_gpu_mb"], minimum=0)
                if row.get("mem_per_gpu_mb") else 1024,
                weight=number(path, line, "weight", row["weight"]) if row.get("weight") else 1.0,
                restart_overhead_s=number(path, line, "restart_overhead_s", row["restart_overhead_s"])
                if row.get("restart_overhead_s") else None,
                application=row.get("application", ""),
            ))
        except TraceError as exc:
            raise TraceError(f"{path}:{line}: {exc}") from None
    if not jobs:
        raise TraceError(f"{path}: no jobs")
    return sorted(jobs, key=lambda j: (j.submit_s, j.key))
