"""Importing a site's history from `sacct --parsable2 --allocations` output into simulator jobs."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from slurm_elastic.errors import SpecError, TraceError
from slurm_elastic.sim.generic import DEFAULT_SPEED
from slurm_elastic.sim.jobs import SimJob, SpeedModel, packed_placement
from slurm_elastic.sim.tables import read_rows
from slurm_elastic.spec import ElasticSpec

log = logging.getLogger(__name__)

SACCT_FORMAT = "JobID,JobName,User,Partition,Submit,Start,End,Elapsed,AllocTRES,ReqTRES,NNodes,State,Comment"
REQUIRED = ("JobID", "Submit", "Start", "End", "AllocTRES", "ReqTRES", "NNodes", "State")
SACCT_COMMAND = f"sacct --parsable2 --allocations --allusers --starttime=<from> --endtime=<to> --format={SACCT_FORMAT}"
# States of jobs that ran and ended: their run is replayed as work. Others (PENDING, RUNNING, REQUEUED,
# or cancelled before starting) are skipped and counted.
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "DEADLINE",
         "BOOT_FAIL"}


@dataclass(frozen=True, slots=True)
class SacctImport:
    jobs: tuple[SimJob, ...]
    skipped: dict[str, int]          # reason -> count
    origin: datetime                 # the earliest Submit: time 0 of the simulation


def load_sacct(path: Path, *, gpus_per_node: int = 4, elastic: str = "comment",
               speed: SpeedModel = DEFAULT_SPEED, max_gpus_cap: int | None = None) -> SacctImport:
    """Jobs from sacct output (the mapping is documented in docs/simulator.md).

    `elastic`: "comment" (only jobs whose Comment holds an elastic spec are
    elastic, with its range), "all" (every GPU job may run at 1 .. 2x its
    request), or "none" (replay everything rigid).
    """
    if elastic not in ("comment", "all", "none"):
        raise TraceError(f"unknown sacct elastic mode {elastic!r} (choose comment, all or none)")
    path = Path(path)
    rows = list(read_rows(path, REQUIRED, delimiter="|"))
    skipped: dict[str, int] = {}
    parsed = []
    for line, row in rows:
        state = row["State"].split()[0] if row["State"] else ""
        jobid = row["JobID"]
        if not jobid:
            raise TraceError(f"{path}:{line}: empty JobID")
        if "." in jobid:
            _count(skipped, "job step line (run sacct with --allocations)")
            continue
        if state not in ENDED:
            _count(skipped, f"state {state or 'empty'}")
            continue
        submit = _time(path, line, "Submit", row["Submit"])
        start = _time(path, line, "Start", row["Start"], allow_unknown=True)
        end = _time(path, line, "End", row["End"], allow_unknown=True)
        if start is None or end is None or end <= start:
            _count(skipped, "never ran")
            continue
        if start < submit:
            raise TraceError(f"{path}:{line}: job {jobid} starts before it was submitted")
        alloc = _tres(path, line, "AllocTRES", row["AllocTRES"])
        req = _tres(path, line, "ReqTRES", row["ReqTRES"])
        gpus = int(alloc.get("gres/gpu", req.get("gres/gpu", 0)))
        if gpus <= 0:
            _count(skipped, "no GPUs (CPU-only jobs do not compete for GPUs here)")
            continue
        parsed.append((line, row, jobid, submit, start, end, alloc, gpus))
    if not parsed:
        raise TraceError(f"{path}: no ended GPU jobs to replay (skipped: {skipped or 'none'})")
    origin = min(p[3] for p in parsed)
    jobs = []
    for line, row, jobid, submit, start, end, alloc, gpus in parsed:
        lo = hi = gpus
        weight = 1.0
        cpus = max(0, int(alloc.get("cpu", gpus)) // gpus)
        mem = max(0, int(alloc.get("mem", 1024 * gpus)) // gpus)
        comment = row.get("Comment", "")
        if elastic == "comment" and ElasticSpec.is_elastic_comment(comment):
            try:
                spec = ElasticSpec.from_comment(comment)
            except SpecError as exc:
                raise TraceError(f"{path}:{line}: job {jobid}: {exc}") from None
            lo, hi, weight = min(spec.min_gpus, gpus), max(spec.max_gpus, gpus), spec.weight
            cpus, mem = spec.cpus_per_gpu, spec.mem_per_gpu_mb
        elif elastic == "all":
            lo, hi = 1, 2 * gpus
        if max_gpus_cap:
            hi = max(gpus, min(hi, max_gpus_cap))
        nodes = max(1, int(row["NNodes"])) if row["NNodes"].isdigit() else None
        duration = (end - start).total_seconds()
        jobs.append(SimJob(
            key=jobid, submit_s=(submit - origin).total_seconds(), requested_gpus=gpus, min_gpus=lo,
            max_gpus=hi, work=duration * speed(packed_placement(gpus, gpus_per_node, nodes)), speed=speed,
            cpus_per_gpu=cpus, mem_per_gpu_mb=mem, weight=weight, application=row.get("JobName", ""),
        ))
    log.info("imported %d jobs from %s (skipped %s)", len(jobs), path, skipped)
    return SacctImport(tuple(sorted(jobs, key=lambda j: (j.submit_s, j.key))), skipped, origin)


def _count(skipped: dict[str, int], reason: str) -> None:
    skipped[reason] = skipped.get(reason, 0) + 1


def _time(path: Path, line: int, column: str, text: str, *, allow_unknown: bool = False) -> datetime | None:
    if text in ("Unknown", "None", ""):
        if allow_unknown:
            return None
        raise TraceError(f"{path}:{line}: column {column} has no time ({text!r})")
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        raise TraceError(f"{path}:{line}: column {column} is not a sacct time (YYYY-MM-DDTHH:MM:SS): {text!r}") from None


_UNITS = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def _tres(path: Path, line: int, column: str, text: str) -> dict[str, float]:
    """`cpu=8,mem=32G,node=1,gres/gpu=2` -> {cpu: 8, mem: 32768 (MB), node: 1, gres/gpu: 2}."""
    out: dict[str, float] = {}
    typed = 0.0
    if not text:
        return out
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise TraceError(f"{path}:{line}: column {column}: bad TRES entry {part!r}")
        if key.startswith("gres/gpu:"):
            # Typed GPUs (gres/gpu:a100=2): Slurm lists them beside the plain gres/gpu total, so they
            # count only when the total is absent.
            typed += _tres_value(path, line, column, value)
            continue
        out[key] = _tres_value(path, line, column, value)
    if "gres/gpu" not in out and typed:
        out["gres/gpu"] = typed
    return out


def _tres_value(path: Path, line: int, column: str, value: str) -> float:
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([KMGT]?)", value)
    if not m:
        raise TraceError(f"{path}:{line}: column {column}: bad TRES value {value!r}")
    return float(m.group(1)) * _UNITS.get(m.group(2) or "M", 1) if m.group(2) else float(m.group(1))
