"""Slurm's --json outputs (22.05 openapi v0.0.38 to data_parser v0.0.45) turned into the cluster model.

One parser for every version: the differences (string vs list states, plain ints vs
{set, infinite, number} objects, `Slurm` vs `slurm` meta, node lists vs grouped sinfo) are
absorbed by the value functions in slurm_values. A field the model needs that is absent is a
MissingField error naming it, never a silent default.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Iterable, Mapping

from slurm_elastic.cluster.model import ClusterState, Job, JobState, Node
from slurm_elastic.cluster.slurm_values import (SlurmParseError, SlurmVersion, expand_hostlist, gres_gpus,
                                                job_cpus_per_node, job_held, job_mem_per_node, job_state,
                                                node_state, number, per_gpu_value,
                                                reason_code, size_mb, spec_from_comment, tres_gpus, tres_map)

log = logging.getLogger(__name__)

try:  # orjson parses Slurm's multi-megabyte job lists ~3x faster; the stdlib is the fallback
    import orjson as _orjson

    JSON_ERRORS: tuple[type[Exception], ...] = (_orjson.JSONDecodeError, ValueError)

    def loads(text: str | bytes) -> Any:
        """Parse a --json document (orjson when installed)."""
        return _orjson.loads(text)
except ImportError:  # pragma: no cover - depends on the environment
    JSON_ERRORS = (json.JSONDecodeError,)

    def loads(text: str | bytes) -> Any:
        """Parse a --json document (orjson when installed)."""
        return json.loads(text)

# Keys through which a job may state its GPUs; if a record has none of them we cannot tell
# "asked for no GPU" from "this Slurm moved the field", so that is an error, not zero.
_JOB_GPU_KEYS = ("tres_per_node", "tres_per_job", "tres_per_task", "gres_detail", "tres_alloc_str",
                 "tres_req_str")


class MissingField(SlurmParseError):
    """A record lacks a field the model needs; the caller may fall back to `scontrol show -o` text."""

    def __init__(self, what: str, field: str, record_id: object) -> None:
        super().__init__(f"Slurm {what} {record_id}: field {field!r} is missing from the JSON")
        self.field = field
        self.record_id = record_id


def version_of(doc: Mapping[str, Any]) -> SlurmVersion:
    """The Slurm version in any --json document's meta."""
    meta = doc.get("meta")
    if not isinstance(meta, dict):
        raise SlurmParseError("JSON output without a 'meta' block")
    return SlurmVersion.from_meta(meta)


def check_errors(doc: Mapping[str, Any], command: tuple[str, ...] = ()) -> None:
    """Slurm reports RPC failures inside the JSON's `errors` list (rc may still be 0)."""
    errors = doc.get("errors") or []
    if errors:
        msgs = "; ".join(str(e.get("description") or e.get("error") or e) if isinstance(e, dict) else str(e)
                         for e in errors)
        raise SlurmParseError(f"Slurm reported: {msgs}")


def _get(rec: Mapping[str, Any], key: str, what: str, rid: object) -> Any:
    if key not in rec:
        raise MissingField(what, key, rid)
    return rec[key]


# --- jobs -------------------------------------------------------------------------------------------

def parse_jobs(doc: Mapping[str, Any]) -> tuple[Job, ...]:
    """All jobs of a `squeue --json` or `scontrol show job(s) --json` document."""
    if "jobs" not in doc:
        raise SlurmParseError("JSON output has no 'jobs' list")
    return tuple(job_from_record(rec) for rec in doc["jobs"])


def job_from_record(rec: Mapping[str, Any]) -> Job:
    """One job record of any supported version."""
    jid = _get(rec, "job_id", "job", "?")
    jid = number(jid)
    if jid is None:
        raise MissingField("job", "job_id", "?")
    state = job_state(_get(rec, "job_state", "job", jid))
    reason = reason_code(str(rec.get("state_reason") or ""))

    user = str(rec.get("user_name") or "")
    uid = number(rec.get("user_id"))
    if not user:
        if uid is None:
            raise MissingField("job", "user_name", jid)
        user = str(uid)

    num_nodes = number(_get(rec, "node_count", "job", jid)) or 1
    nodes = expand_hostlist(str(rec.get("nodes") or ""))
    if nodes and state.active:
        num_nodes = len(nodes)
    elif not state.active:
        # `scontrol update NumNodes=` on a pending job leaves node_count stale on 22.05 (seen
        # live: 2 after NumNodes=1, and the job then ran on 1 node); the requested TRES follow.
        requested = tres_map(rec.get("tres_req_str")).get("node", "")
        if requested.isdigit() and int(requested) > 0:
            num_nodes = int(requested)

    gpn = job_gpus_per_node(rec, jid, num_nodes, running=state.active)

    cpus_total = number(_get(rec, "cpus", "job", jid))
    if cpus_total is None:  # 22.05: null for a job cancelled while pending; the request still says
        cpus_total = number(tres_map(rec.get("tres_req_str")).get("cpu")) or 0
    cpus_per_gpu = _int_or_none(per_gpu_value(rec.get("cpus_per_tres")))
    cpus_per_node = job_cpus_per_node(cpus_total, num_nodes, gpus_per_node=gpn, cpus_per_gpu=cpus_per_gpu,
                                      running=state.active)
    mem_per_gpu = _mem_or_none(per_gpu_value(rec.get("memory_per_tres")))
    mem_per_node = _job_mem_per_node(rec, jid, cpus_per_node, gpn, mem_per_gpu, num_nodes, running=state.active)

    if "hold" not in rec and "priority" not in rec:
        raise MissingField("job", "hold/priority", jid)
    # 22.05 has no `hold` key (priority 0 says it); from 23.02 both are there.
    priority = number(rec.get("priority"))
    held = job_held(state, hold_flag=bool(rec.get("hold")), priority=priority)
    limit_min = number(rec.get("time_limit"))   # minutes; unset or infinite: None

    comment = str(rec.get("comment") or "")
    spec, spec_error = spec_from_comment(comment)
    submit = number(rec.get("submit_time"))
    start = number(rec.get("start_time"))
    end = number(rec.get("end_time"))
    ran = state.active or state.finished or state is JobState.REQUEUE_HOLD
    return Job(
        job_id=jid, user=user, name=str(rec.get("name") or ""), state=state, reason=reason,
        nodes=nodes, num_nodes=num_nodes, gpus_per_node=gpn, cpus_per_node=cpus_per_node,
        batch_host=str(rec.get("batch_host") or "") if state.active else "", mem_per_node_mb=mem_per_node, cpus_per_gpu=cpus_per_gpu, mem_per_gpu_mb=mem_per_gpu,
        restarts=number(_get(rec, "restart_cnt", "job", jid)) or 0,
        requeue=bool(_get(rec, "requeue", "job", jid)), held=held,
        partition=str(rec.get("partition") or ""), comment=comment, user_id=uid,
        reservation=str(rec.get("resv_name") or ""),
        required_nodes=expand_hostlist(str(rec.get("required_nodes") or "")),
        excluded_nodes=expand_hostlist(str(rec.get("excluded_nodes") or "")),
        constraint=str(rec.get("features") or ""),
        submit_time=float(submit) if submit else None,
        start_time=float(start) if (start and ran) else None,
        end_time=float(end) if (end and state.finished) else None,
        exit_signal=exit_signal(rec.get("exit_code")) if state.finished else None,
        spec=spec, spec_error=spec_error, priority=priority,
        time_limit_s=60.0 * limit_min if limit_min is not None else None,
    )


def exit_signal(value: object) -> int | None:
    """The signal in a job's `exit_code`: 22.05 gives the raw wait status (an int), 23.02 on an object
    {status, return_code, signal: {id, name}}."""
    if isinstance(value, dict):
        sig = number((value.get("signal") or {}).get("id"))
        return sig or None
    raw = number(value)
    if raw is None:
        return None
    sig = raw & 0x7F
    return sig if sig not in (0, 0x7F) else None   # 0x7f: stopped, not ended


def job_gpus_per_node(rec: Mapping[str, Any], jid: object, num_nodes: int, *, running: bool) -> int:
    """GPUs per node: what a running job holds (gres_detail), else what it asks for per node.

    Order: gres_detail (allocated, one entry per node) while running; tres_per_node
    ('gres:gpu:3' on 22.05, 'gres/gpu:3' later); tres_per_job or tres_per_task spread over
    the nodes; the allocated/requested TRES string ('gres/gpu=6') spread over the nodes.
    """
    if not any(k in rec for k in _JOB_GPU_KEYS):
        raise MissingField("job", "tres_per_node", jid)
    if running:
        detail = rec.get("gres_detail") or []
        counts = [c for c in (gres_gpus(d) for d in detail) if c is not None]
        if counts:
            return max(counts)  # Slurm gives every node of a job the same per-node GRES count
    per_node = gres_gpus(rec.get("tres_per_node"))
    if per_node is not None:
        return per_node
    per_job = gres_gpus(rec.get("tres_per_job"))
    if per_job is not None:
        return math.ceil(per_job / max(num_nodes, 1))
    per_task = gres_gpus(rec.get("tres_per_task"))
    if per_task is not None:
        tasks = number(rec.get("tasks")) or 1
        return math.ceil(per_task * tasks / max(num_nodes, 1))
    for key in ("tres_alloc_str", "tres_req_str"):
        total = tres_gpus(rec.get(key))
        if total is not None:
            return math.ceil(total / max(num_nodes, 1))
    return 0


def _job_mem_per_node(rec: Mapping[str, Any], jid: object, cpus_per_node: int, gpn: int,
                      mem_per_gpu: int | None, num_nodes: int, *, running: bool) -> int:
    if not any(k in rec for k in ("memory_per_node", "memory_per_cpu", "memory_per_tres", "tres_req_str")):
        raise MissingField("job", "memory_per_node", jid)
    allocated = allocated_mem_per_node(rec.get("job_resources")) if running else []
    tres_mem = next((m for m in (tres_map(rec.get(k)).get("mem") for k in ("tres_alloc_str", "tres_req_str")) if m),
                    None)
    return job_mem_per_node(
        # one number per job: the largest allocation, so capacity left to others is never overstated
        allocated=max(allocated) if allocated else None, per_gpu=mem_per_gpu, gpus_per_node=gpn,
        per_node=number(rec.get("memory_per_node")), per_cpu=number(rec.get("memory_per_cpu")),
        cpus_per_node=cpus_per_node, tres_total=size_mb(tres_mem) if tres_mem else None, num_nodes=num_nodes)


def allocated_mem_per_node(resources: Any) -> list[int]:
    """MB allocated on each node from `job_resources`: 22.05 `allocated_nodes[].memory_allocated`,
    23.02+ `nodes.allocation[].memory.allocated`; [] for a job without an allocation."""
    if not isinstance(resources, dict):
        return []
    nodes = resources.get("nodes")
    if isinstance(nodes, dict):
        entries = [a.get("memory", {}).get("allocated") for a in nodes.get("allocation") or ()
                   if isinstance(a.get("memory"), dict)]
    else:
        entries = [a.get("memory_allocated") for a in resources.get("allocated_nodes") or ()]
    return [m for m in (number(e) for e in entries) if m]


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def _mem_or_none(text: str | None) -> int | None:
    return size_mb(text) if text else None


# --- nodes ------------------------------------------------------------------------------------------

def parse_nodes(doc: Mapping[str, Any]) -> tuple[Node, ...]:
    """Nodes of `sinfo --json` (22.05: one record per node; 23.11+: grouped) or `scontrol show nodes --json`."""
    if "nodes" in doc and isinstance(doc["nodes"], list):
        return tuple(node_from_record(rec) for rec in doc["nodes"])
    if "sinfo" in doc:
        return nodes_from_sinfo_groups(doc["sinfo"])
    raise SlurmParseError("JSON output has neither 'nodes' nor 'sinfo'")


def node_from_record(rec: Mapping[str, Any]) -> Node:
    name = str(_get(rec, "name", "node", "?"))
    raw_state = _get(rec, "state", "node", name)
    state, flags = node_state(raw_state, rec.get("state_flags") or ())
    # effective_cpus (23.02+) leaves out specialised cores, which jobs cannot use
    cpus = number(_get(rec, "cpus", "node", name)) or 0
    cpus = number(rec.get("effective_cpus")) or cpus
    gpus = gres_gpus(str(_get(rec, "gres", "node", name) or "")) or 0
    used = gres_gpus(rec.get("gres_used"))
    if used is None:
        used = tres_gpus(rec.get("tres_used")) or 0
    return Node(
        name=name, state=state, flags=flags,
        cpus=cpus, cpus_alloc=number(_get(rec, "alloc_cpus", "node", name)) or 0,
        mem_mb=number(_get(rec, "real_memory", "node", name)) or 0,
        mem_alloc_mb=number(_get(rec, "alloc_memory", "node", name)) or 0,
        gpus=gpus, gpus_alloc=used,
        partitions=tuple(rec.get("partitions") or ()), reason=str(rec.get("reason") or ""),
        slurmd_started_at=_started(rec.get("slurmd_start_time")),
    )


def _started(value: object) -> float | None:
    """slurmd_start_time: epoch seconds (22.05) or a {set, number} object; 0 and unset mean not said."""
    seconds = number(value)
    return float(seconds) if seconds else None


def nodes_from_sinfo_groups(groups: Iterable[Mapping[str, Any]]) -> tuple[Node, ...]:
    """Grouped `sinfo --json` (23.11+): one entry per (partition, state) group.

    Per-node totals are exact (every node of a group is configured alike only if Slurm grouped
    them so; sinfo groups by state and partition, and reports min/max, so totals use the max).
    Per-node *allocations* are exact only for single-node groups or groups with nothing
    allocated; that is why the CLI backend reads `scontrol show nodes --json` on these
    versions and this function exists for completeness and tests.
    """
    by_name: dict[str, Node] = {}
    for g in groups:
        names = list(g.get("nodes", {}).get("nodes") or ())
        if not names:
            continue
        state, flags = node_state(g.get("node", {}).get("state") or ())
        n = len(names)
        cpus = g.get("cpus", {})
        mem = g.get("memory", {})
        gres = g.get("gres", {})
        gpus_used_total = gres_gpus(gres.get("used")) or 0
        reason = g.get("reason", {})
        reason_text = reason.get("description", "") if isinstance(reason, dict) else str(reason or "")
        partition = g.get("partition", {}).get("name", "")
        for name in names:
            prev = by_name.get(name)
            parts = (prev.partitions if prev else ()) + ((partition,) if partition else ())
            by_name[name] = Node(
                name=name, state=state, flags=flags,
                cpus=number(cpus.get("maximum")) or 0,
                cpus_alloc=(number(cpus.get("allocated")) or 0) // n,
                mem_mb=number(mem.get("maximum")) or 0,
                mem_alloc_mb=(number(mem.get("allocated")) or 0) // n,
                gpus=gres_gpus(gres.get("total")) or 0,
                gpus_alloc=gpus_used_total // n if n > 1 else gpus_used_total,
                partitions=parts, reason=reason_text,
            )
    return tuple(by_name.values())


# --- a whole snapshot ---------------------------------------------------------------------------------

def cluster_state(jobs_doc: Mapping[str, Any], nodes_doc: Mapping[str, Any], taken_at: float) -> ClusterState:
    """A ClusterState from one jobs document and one nodes document of the same Slurm."""
    check_errors(jobs_doc)
    check_errors(nodes_doc)
    return ClusterState(nodes=parse_nodes(nodes_doc), jobs=parse_jobs(jobs_doc), taken_at=taken_at,
                        slurm_version=str(version_of(jobs_doc)))
