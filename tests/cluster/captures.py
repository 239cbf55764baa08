"""Where the real Slurm captures live and what they contain.

Two sets: the shared ones (../shared/slurm-json beside the repo: one cluster state per version)
and the project's own (tests/cluster/slurm-json: the cases the shared ones lack, see its README).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CAPTURES = Path(__file__).resolve().parents[3] / "shared" / "slurm-json"
VERSIONS = ("22.05", "24.11", "26.05")
PROJECT_CAPTURES = Path(__file__).resolve().parent / "slurm-json"


def capture_dir(version: str) -> Path:
    path = CAPTURES / version
    if not path.is_dir():
        pytest.skip(f"real Slurm captures not found at {path} (the CI clone has shared/ beside the repo)")
    return path


def load(version: str, name: str) -> dict:
    return json.loads((capture_dir(version) / name).read_text())


def text(version: str, name: str) -> str:
    return (capture_dir(version) / name).read_text()


def project_load(version: str, name: str) -> dict:
    return json.loads((PROJECT_CAPTURES / version / name).read_text())


def project_text(version: str, name: str) -> str:
    return (PROJECT_CAPTURES / version / name).read_text()


# The cluster state every capture shows (shared/slurm-json/README.md).
EXPECTED_JOBS = {
    1: dict(name="jobA", state="RUNNING", reason="", nodes=("n1",), num_nodes=1, gpus_per_node=3, cpus_per_node=2,
            mem_per_node_mb=1024, restarts=1, requeue=True, held=False, user="root", partition="gpu"),
    2: dict(name="jobB", state="PENDING", reason="BeginTime", nodes=(), num_nodes=1, gpus_per_node=1,
            cpus_per_node=1, mem_per_node_mb=1024, restarts=1, requeue=True, held=False, user="root",
            partition="gpu"),
    3: dict(name="jobC", state="PENDING", reason="JobHeldUser", nodes=(), num_nodes=1, gpus_per_node=1,
            cpus_per_node=1, mem_per_node_mb=1024, restarts=0, requeue=True, held=True, user="root",
            partition="gpu"),
}
EXPECTED_NODES = {
    "n1": dict(state="mixed", flags=set(), cpus=8, cpus_alloc=2, mem_mb=16000, mem_alloc_mb=1024, gpus=4,
               gpus_alloc=3, reason="", available=True),
    "n2": dict(state="down", flags={"not_responding"}, cpus=8, cpus_alloc=0, mem_mb=16000, mem_alloc_mb=0, gpus=4,
               gpus_alloc=0, reason="Not responding", available=False),
    "n3": dict(state="idle", flags=set(), cpus=8, cpus_alloc=0, mem_mb=16000, mem_alloc_mb=0, gpus=4, gpus_alloc=0,
               reason="", available=True),
    "n4": dict(state="idle", flags=set(), cpus=8, cpus_alloc=0, mem_mb=16000, mem_alloc_mb=0, gpus=4, gpus_alloc=0,
               reason="", available=True),
}

# The project captures (tests/cluster/slurm-json/README.md): job 1 asked for 2 nodes x 2 GPUs with
# --cpus-per-gpu=1 --mem-per-gpu=500M (Slurm allocated 1000 MB per node); job 2 was held, then cancelled.
MEM_PER_GPU_JOB = dict(num_nodes=2, gpus_per_node=2, cpus_per_node=2, cpus_per_gpu=1, mem_per_gpu_mb=500,
                       mem_per_node_mb=1000)
