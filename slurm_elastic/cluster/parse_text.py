"""`scontrol show job|node` text (one-line `-o` or multi-line) turned into the cluster model.

The fallback where JSON is unavailable or lacks a field: `scontrol show` text exists with the
same keys on every Slurm from 22.05 on. Values may contain spaces (OS=, Command=, Comment=,
SubmitLine=), so a token starts a new key only if it looks like one of scontrol's keys:
an upper-case first letter, then letters, digits, '_', '/', ':' up to '='.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Iterable

from slurm_elastic.cluster.model import Job, JobState, Node, NodeFlag, NodeState
from slurm_elastic.cluster.slurm_values import (SlurmParseError, expand_hostlist, gres_gpus, job_cpus_per_node,
                                                job_held, job_mem_per_node, job_state, node_state, per_gpu_value,
                                                reason_code, size_mb, spec_from_comment, tres_gpus, tres_map)

_KEY = re.compile(r"[A-Z][A-Za-z0-9_/:]*=")
_NULL = ("", "(null)", "N/A", "None", "Unknown")


def records(text: str, first_key: str) -> list[dict[str, str]]:
    """Split scontrol output into key/value records; each record starts at `first_key=`."""
    out: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    last_key: str | None = None
    for token in text.split():
        m = _KEY.match(token)
        if m:
            key, value = token[:m.end() - 1], token[m.end():]
            if key == first_key:
                current = {}
                out.append(current)
            if current is None:
                raise SlurmParseError(f"scontrol text does not start with {first_key}=: {text[:80]!r}")
            current[key] = value
            last_key = key
        elif current is not None and last_key is not None:
            current[last_key] = f"{current[last_key]} {token}"
    return out


def _int(rec: dict[str, str], key: str, rid: object, default: int | None = None) -> int:
    raw = rec.get(key)
    if raw is None:
        if default is None:
            raise SlurmParseError(f"scontrol text for {rid}: {key}= is missing")
        return default
    m = re.match(r"\d+", raw)
    if m is None:
        if default is None:
            raise SlurmParseError(f"scontrol text for {rid}: {key}={raw!r} is not a number")
        return default
    return int(m[0])


def _time(raw: str | None) -> float | None:
    if raw in _NULL or raw is None:
        return None
    try:
        return time.mktime(time.strptime(raw, "%Y-%m-%dT%H:%M:%S"))  # scontrol prints local time
    except ValueError:
        return None


def _mem_field(rec: dict[str, str], key: str) -> int | None:
    raw = rec.get(key)
    if raw in _NULL or raw is None:
        return None
    return size_mb(raw)


def jobs_from_text(text: str) -> tuple[Job, ...]:
    return tuple(job_from_text(rec) for rec in records(text, "JobId"))


def job_from_text(rec: dict[str, str]) -> Job:
    jid = _int(rec, "JobId", "job")
    if "JobState" not in rec:
        raise SlurmParseError(f"scontrol text for job {jid}: JobState= is missing")
    state = job_state(rec["JobState"])
    reason = reason_code(rec.get("Reason", ""))
    user_field = rec.get("UserId", "")
    m = re.fullmatch(r"(.*)\((\d+)\)", user_field)
    user, uid = (m[1], int(m[2])) if m else (user_field, None)
    if not user:
        raise SlurmParseError(f"scontrol text for job {jid}: UserId= is missing")

    nodes = expand_hostlist(rec.get("NodeList", ""))
    num_nodes = len(nodes) if (nodes and state.active) else _int(rec, "NumNodes", jid)
    if not state.active:  # NumNodes= stays stale after an update on 22.05; the requested TRES follow
        requested = tres_map(rec.get("ReqTRES") or rec.get("TRES")).get("node", "")
        if requested.isdigit() and int(requested) > 0:
            num_nodes = int(requested)
    gpn = _text_gpus_per_node(rec, num_nodes, running=state.active)
    cpg = per_gpu_value(rec.get("CpusPerTres"))
    cpus_per_gpu = int(cpg) if cpg and cpg.isdigit() else None
    cpus_per_node = job_cpus_per_node(_int(rec, "NumCPUs", jid), num_nodes, gpus_per_node=gpn,
                                      cpus_per_gpu=cpus_per_gpu, running=state.active)
    mpg_raw = per_gpu_value(rec.get("MemPerTres"))
    mem_per_gpu = size_mb(mpg_raw) if mpg_raw else None
    tres_mem = next((m for m in (tres_map(rec.get(k)).get("mem") for k in ("AllocTRES", "TRES", "ReqTRES")) if m),
                    None)
    mem_node = job_mem_per_node(
        # `scontrol -d show job` of a running job: "Nodes=n[1-2] CPU_IDs=0-1 Mem=1000 GRES=..." per node group
        allocated=_mem_field(rec, "Mem") if state.active else None, per_gpu=mem_per_gpu, gpus_per_node=gpn,
        per_node=_mem_field(rec, "MinMemoryNode"), per_cpu=_mem_field(rec, "MinMemoryCPU"),
        cpus_per_node=cpus_per_node, tres_total=size_mb(tres_mem) if tres_mem else None, num_nodes=num_nodes)
    priority = _int(rec, "Priority", jid)
    comment = rec.get("Comment", "")
    comment = "" if comment == "(null)" else comment
    spec, spec_error = spec_from_comment(comment)
    ran = state.active or state.finished or state is JobState.REQUEUE_HOLD
    return Job(
        job_id=jid, user=user, name=rec.get("JobName", ""), state=state, reason=reason, nodes=nodes,
        batch_host="" if not state.active or rec.get("BatchHost", "") in _NULL else rec["BatchHost"],
        num_nodes=num_nodes, gpus_per_node=gpn, cpus_per_node=cpus_per_node, mem_per_node_mb=mem_node,
        cpus_per_gpu=cpus_per_gpu, mem_per_gpu_mb=mem_per_gpu,
        restarts=_int(rec, "Restarts", jid), requeue=rec.get("Requeue") == "1",
        held=job_held(state, hold_flag=False, priority=priority),
        partition=rec.get("Partition", ""), comment=comment, user_id=uid,
        reservation="" if rec.get("Reservation", "") in _NULL else rec["Reservation"],
        required_nodes=() if rec.get("ReqNodeList", "") in _NULL else expand_hostlist(rec["ReqNodeList"]),
        excluded_nodes=() if rec.get("ExcNodeList", "") in _NULL else expand_hostlist(rec["ExcNodeList"]),
        constraint="" if rec.get("Features", "") in _NULL else rec["Features"],
        submit_time=_time(rec.get("SubmitTime")),
        start_time=_time(rec.get("StartTime")) if ran else None,
        end_time=_time(rec.get("EndTime")) if state.finished else None,
        exit_signal=_exit_signal(rec.get("ExitCode", "")) if state.finished else None,
        spec=spec, spec_error=spec_error, priority=priority,
    )


def _exit_signal(text: str) -> int | None:
    """`ExitCode=0:15` is exit status 0, signal 15; a signal of 0 is none."""
    _, _, sig = text.partition(":")
    return int(sig) if sig.isdigit() and int(sig) else None


def _text_gpus_per_node(rec: dict[str, str], num_nodes: int, *, running: bool) -> int:
    if running and rec.get("GRES"):  # `scontrol show job -d`: per-node allocation
        got = gres_gpus(rec["GRES"])
        if got is not None:
            return got
    for key in ("TresPerNode", "Gres"):
        got = gres_gpus(rec.get(key))
        if got is not None:
            return got
    per_job = gres_gpus(rec.get("TresPerJob"))
    if per_job is not None:
        return math.ceil(per_job / max(num_nodes, 1))
    for key in ("AllocTRES", "TRES", "ReqTRES"):
        total = tres_gpus(rec.get(key))
        if total is not None:
            return math.ceil(total / max(num_nodes, 1))
    return 0


def nodes_from_text(text: str, jobs: Iterable[Job] = ()) -> tuple[Node, ...]:
    """Nodes of `scontrol show node [-d] [-o]`.

    Used GPUs come from GresUsed= (only with -d) or a gres/gpu entry in AllocTRES= (only if
    the site accounts GPUs); failing both, from the running `jobs` on the node, which is what
    Slurm itself counts.
    """
    held: dict[str, int] = {}
    for j in jobs:
        if j.state.active:
            for n in j.nodes:
                held[n] = held.get(n, 0) + j.gpus_per_node
    out = []
    for rec in records(text, "NodeName"):
        name = rec["NodeName"]
        if "State" not in rec:
            raise SlurmParseError(f"scontrol text for node {name}: State= is missing")
        state, flags = node_state(rec["State"])
        used = gres_gpus(rec.get("GresUsed"))
        if used is None:
            used = tres_gpus(rec.get("AllocTRES"))
        if used is None:
            used = held.get(name, 0)
        reason = re.sub(r"\s*\[[^\]]*@[^\]]*\]\s*$", "", rec.get("Reason", ""))
        cpus = _int(rec, "CPUEfctv", name, default=-1)
        out.append(Node(
            name=name, state=state, flags=flags,
            cpus=cpus if cpus >= 0 else _int(rec, "CPUTot", name),
            cpus_alloc=_int(rec, "CPUAlloc", name), mem_mb=_int(rec, "RealMemory", name),
            mem_alloc_mb=_int(rec, "AllocMem", name, default=0),
            gpus=gres_gpus(rec.get("Gres")) or 0, gpus_alloc=used,
            partitions=tuple(p for p in rec.get("Partitions", "").split(",") if p and p not in _NULL),
            reason="" if reason in _NULL else reason,
            slurmd_started_at=_time(rec.get("SlurmdStartTime")),
        ))
    return tuple(out)


# --- the default `squeue` / `sinfo` tables -------------------------------------------------------------
# They lack GPUs, CPUs and memory, so the backend never builds its model from them; they are
# parsed for what they do say (states, users, node lists, reasons) to cross-check the model,
# e.g. against what an operator pastes from a terminal.

_SQUEUE_CODES = {"PD": JobState.PENDING, "R": JobState.RUNNING, "S": JobState.SUSPENDED,
                 "CG": JobState.COMPLETING, "CD": JobState.COMPLETED, "CA": JobState.CANCELLED,
                 "F": JobState.FAILED, "TO": JobState.TIMEOUT, "NF": JobState.NODE_FAIL,
                 "PR": JobState.PREEMPTED, "BF": JobState.BOOT_FAIL, "DL": JobState.DEADLINE,
                 "OOM": JobState.OUT_OF_MEMORY, "RQ": JobState.REQUEUED, "RH": JobState.REQUEUE_HOLD,
                 "RF": JobState.PENDING, "RS": JobState.RESIZING, "CF": JobState.RUNNING,
                 "SE": JobState.FAILED, "SO": JobState.COMPLETING, "ST": JobState.SUSPENDED,
                 "RD": JobState.PENDING, "RV": JobState.CANCELLED, "SI": JobState.RUNNING}


@dataclass(frozen=True, slots=True)
class SqueueRow:
    """One line of plain `squeue` (JOBID PARTITION NAME USER ST TIME NODES NODELIST(REASON))."""

    job_id: int
    partition: str
    name: str
    user: str
    state: JobState
    num_nodes: int
    nodes: tuple[str, ...]
    reason: str


def squeue_table(text: str) -> tuple[SqueueRow, ...]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines or lines[0].split()[:2] != ["JOBID", "PARTITION"]:
        raise SlurmParseError("not the default squeue table (expected a JOBID PARTITION ... header)")
    rows = []
    for ln in lines[1:]:
        cols = ln.split(None, 7)
        if len(cols) < 8 or cols[4] not in _SQUEUE_CODES:
            raise SlurmParseError(f"unexpected squeue line: {ln!r}")
        last = cols[7].strip()
        reason = last[1:-1] if last.startswith("(") and last.endswith(")") else ""
        rows.append(SqueueRow(job_id=int(cols[0]), partition=cols[1], name=cols[2], user=cols[3],
                              state=_SQUEUE_CODES[cols[4]], num_nodes=int(cols[6]),
                              nodes=() if reason or not last else expand_hostlist(last),
                              reason=reason_code(reason)))
    return tuple(rows)


def sinfo_table(text: str) -> dict[str, tuple[NodeState, frozenset[NodeFlag]]]:
    """Plain `sinfo` (PARTITION AVAIL TIMELIMIT NODES STATE NODELIST) -> {node: (state, flags)}."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines or lines[0].split()[:2] != ["PARTITION", "AVAIL"]:
        raise SlurmParseError("not the default sinfo table (expected a PARTITION AVAIL ... header)")
    out: dict[str, tuple[NodeState, frozenset[NodeFlag]]] = {}
    for ln in lines[1:]:
        cols = ln.split()
        if len(cols) != 6:
            raise SlurmParseError(f"unexpected sinfo line: {ln!r}")
        state = node_state(cols[4])
        names = expand_hostlist(cols[5])
        if len(names) != int(cols[3]):
            raise SlurmParseError(f"sinfo line lists {len(names)} nodes but says {cols[3]}: {ln!r}")
        for name in names:
            out[name] = state
    return out
