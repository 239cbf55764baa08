"""Shared pieces of the simulator tests: the Pollux traces beside the repository, and tiny job builders."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.sim.jobs import SimJob
from slurm_elastic.sim.speed import AmdahlSpeed

REPO = Path(__file__).resolve().parents[2]
POLLUX = REPO.parent / "shared" / "traces" / "pollux"
DATA = Path(__file__).resolve().parent / "data"
LINEAR = AmdahlSpeed(0.0, 0.0)


@pytest.fixture
def pollux() -> Path:
    if not (POLLUX / "workloads").is_dir():
        pytest.skip(f"Pollux traces not found at {POLLUX} (the shared/ folder beside the repository)")
    return POLLUX


def job(key: str, submit: float, gpus: int, seconds: float, *, lo: int | None = None, hi: int | None = None,
        overhead: float | None = 0.0) -> SimJob:
    """A linearly scaling job that needs `seconds` at `gpus` GPUs (work in GPU-seconds)."""
    return SimJob(key=key, submit_s=submit, requested_gpus=gpus, min_gpus=lo or gpus, max_gpus=hi or gpus,
                  work=seconds * gpus, speed=LINEAR, restart_overhead_s=overhead)
