"""Loading any supported workload file: Pollux CSV, generic CSV or sacct export (sniffed from the header)."""

from __future__ import annotations

from pathlib import Path

from slurm_elastic.errors import TraceError
from slurm_elastic.sim.generic import load_generic
from slurm_elastic.sim.jobs import SimJob
from slurm_elastic.sim.pollux import WORKLOAD_COLUMNS, load_workload
from slurm_elastic.sim.sacct import load_sacct

FORMATS = ("auto", "pollux", "generic", "sacct")


def sniff(path: Path) -> str:
    try:
        with Path(path).open(encoding="utf-8") as handle:
            header = handle.readline().strip()
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not header:
        raise TraceError(f"{path}: empty file")
    if "|" in header and "JobID" in header.split("|"):
        return "sacct"
    columns = {c.strip() for c in header.split(",")}
    if {"application", "num_replicas"} <= columns:
        return "pollux"
    if {"submit_s", "gpus"} <= columns:
        return "generic"
    if "application" in columns or "num_replicas" in columns:
        return "pollux"  # a Pollux file with columns missing: its loader names them
    raise TraceError(f"{path}: unknown workload format (header {header[:80]!r}); expected a Pollux workload "
                     f"({', '.join(WORKLOAD_COLUMNS)}), a generic CSV (submit_s, gpus, duration_s or gpu_seconds) "
                     f"or sacct --parsable2 output")


def load_any(path: Path, *, fmt: str = "auto", applications: Path | None = None, gpus_per_node: int = 4,
             sacct_elastic: str = "comment", adaptive: str = "none") -> list[SimJob]:
    """The jobs of one workload file; `adaptive` (Pollux workloads only): none, all or half (sim/pollux.py)."""
    path = Path(path)
    if fmt not in FORMATS:
        raise TraceError(f"unknown workload format {fmt!r} (choose {', '.join(FORMATS)})")
    kind = sniff(path) if fmt == "auto" else fmt
    if kind == "pollux":
        return load_workload(path, applications, adaptive=adaptive)
    if kind == "generic":
        return load_generic(path, gpus_per_node=gpus_per_node)
    return list(load_sacct(path, gpus_per_node=gpus_per_node, elastic=sacct_elastic).jobs)
