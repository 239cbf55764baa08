"""The Backend over pyslurm's 25.11 object API (Nodes.load, Jobs.load, Job.modify/requeue/release).

pyslurm links against one Slurm release, so it is only chosen when its major.minor equals
the running Slurm's (see select.py). Two calls per snapshot (Nodes.load and Jobs.load, each
one RPC). `Job.modify()` ignores a node count, so set_resources changes NumNodes through
`scontrol update` and the rest through `Job.modify(JobSubmitDescription(...))`.
Property names follow pyslurm/core/node.pyx and pyslurm/core/job/job.pyx of v25.11.
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from dataclasses import replace
from types import ModuleType
from typing import Any, Iterable

from slurm_elastic.cluster.backend import SubmitDescription
from slurm_elastic.cluster.cli_backend import CliBackend, classify
from slurm_elastic.cluster.model import ClusterState, Job, JobState, Node
from slurm_elastic.cluster.slurm_values import (SlurmVersion, expand_hostlist, gres_gpus, job_state,
                                                node_state, size_mb, spec_from_comment)
from slurm_elastic.errors import SlurmError

log = logging.getLogger(__name__)


def import_pyslurm() -> ModuleType:
    """`import pyslurm` (it reads slurm.conf at import, so this may fail on a machine without one)."""
    return importlib.import_module("pyslurm")


def pyslurm_version(module: ModuleType) -> SlurmVersion:
    """pyslurm's version is SLURM_MAJOR.SLURM_MINOR.PATCH, e.g. 25.11.2 for Slurm 25.11."""
    return SlurmVersion.parse(str(getattr(module, "__version__", "")))


class PyslurmBackend:
    """Slurm through pyslurm; `module` is pyslurm itself (or, in unit tests, a stand-in)."""

    name = "pyslurm"

    def __init__(self, module: ModuleType | None = None, *, cli: CliBackend | None = None) -> None:
        self._ps = module if module is not None else import_pyslurm()
        self._cli = cli if cli is not None else CliBackend()
        self.calls = 0

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # pyslurm raises RPCError/PyslurmError/ValueError with Slurm's text
            if isinstance(exc, SlurmError):
                raise
            raise classify(str(exc) or type(exc).__name__, ("pyslurm", what), getattr(exc, "errno", None)) from exc

    def snapshot(self) -> ClusterState:
        taken_at = time.time()
        nodes = self._call("Nodes.load", self._ps.Nodes.load)
        jobs = self._call("Jobs.load", self._ps.Jobs.load)
        return state_from_pyslurm(_values(nodes), _values(jobs), taken_at=taken_at,
                                  slurm_version=str(pyslurm_version(self._ps)))

    def submit(self, description: SubmitDescription) -> int:
        # sbatch reads #SBATCH lines and the script's environment exactly as a user would get.
        return self._cli.submit(description)

    def hold(self, job_id: int) -> None:
        self._call("Job.hold", self._ps.Job(int(job_id)).hold)

    def requeue_hold(self, job_id: int) -> None:
        self._call("Job.requeue", self._ps.Job(int(job_id)).requeue, hold=True)

    def set_resources(self, job_id: int, *, nodes: int, gpus_per_node: int, cpus_per_gpu: int,
                      mem_per_gpu_mb: int, start_now: bool = True) -> None:
        if min(nodes, gpus_per_node, cpus_per_gpu, mem_per_gpu_mb) < 1:
            raise SlurmError(f"set_resources: every size must be >= 1 (nodes={nodes}, gpus_per_node="
                             f"{gpus_per_node}, cpus_per_gpu={cpus_per_gpu}, mem_per_gpu_mb={mem_per_gpu_mb})")
        # Job.modify() silently ignores the node count (pyslurm 25.11), so scontrol does that part.
        self._cli._run(["scontrol", "update", f"JobId={int(job_id)}", f"NumNodes={int(nodes)}-{int(nodes)}"])
        changes: dict[str, Any] = {"gres_per_node": f"gpu:{int(gpus_per_node)}",
                                   "cpus_per_gpu": int(cpus_per_gpu), "memory_per_gpu": int(mem_per_gpu_mb)}
        if start_now:
            changes["begin_time"] = "now"
        desc = self._ps.JobSubmitDescription(**changes)
        self._call("Job.modify", self._ps.Job(int(job_id)).modify, desc)

    def release(self, job_id: int) -> None:
        self._call("Job.release", self._ps.Job(int(job_id)).release)

    def signal(self, job_id: int, signal: str) -> None:
        # steps="all" sets KILL_FULL_JOB: the batch shell and every step, like scancel --full.
        name = str(signal).upper()
        name = name if name.isdigit() or name.startswith("SIG") else f"SIG{name}"
        self._call("Job.send_signal", self._ps.Job(int(job_id)).send_signal,
                   int(name) if name.isdigit() else name, steps="all")

    def cancel(self, job_id: int) -> None:
        self._call("Job.cancel", self._ps.Job(int(job_id)).cancel)


def _values(collection: Any) -> Iterable[Any]:
    """pyslurm's Nodes/Jobs are MultiClusterMaps: values() runs over every cluster's entries."""
    values = getattr(collection, "values", None)
    return list(values()) if callable(values) else list(collection)


def _gpu_count(gres: Any) -> int | None:
    """pyslurm GRES dicts: {'gpu': 4}, {'gpu:a100': 2}, {'gres/gpu': 3} or {'gpu': {'count': 3, ...}}."""
    if not gres:
        return None
    if isinstance(gres, str):
        return gres_gpus(gres)
    total = None
    for key, val in dict(gres).items():
        name = str(key)
        for prefix in ("gres/", "gres:"):
            name = name.removeprefix(prefix)
        if name.split(":")[0] != "gpu":
            continue
        if isinstance(val, dict):
            val = val.get("count", 0)
        total = (total or 0) + int(val)
    return total


def node_from_pyslurm(n: Any) -> Node:
    state, flags = node_state(str(n.state or "UNKNOWN"))
    used = _gpu_count(getattr(n, "allocated_gres", None))
    return Node(
        name=str(n.name), state=state, flags=flags,
        cpus=int(n.effective_cpus or n.total_cpus or 0), cpus_alloc=int(n.allocated_cpus or 0),
        mem_mb=int(n.real_memory or 0), mem_alloc_mb=int(n.allocated_memory or 0),
        gpus=_gpu_count(n.configured_gres) or 0, gpus_alloc=used if used is not None else -1,
        partitions=tuple(n.partitions or ()), reason=str(n.reason or ""),
    )


def job_from_pyslurm(j: Any) -> Job:
    state = job_state(str(j.state))
    reason = str(j.state_reason or "")
    reason = "" if reason == "None" else reason
    nodes = expand_hostlist(j.allocated_nodes or "")
    num_nodes = len(nodes) if (nodes and state.active) else int(j.num_nodes or 1)
    gpn = _gpu_count(j.gres_per_node)
    if gpn is None:
        total = _gpu_count(getattr(j, "gpus", None))
        gpn = math.ceil(total / max(num_nodes, 1)) if total else 0
    cpus = int(j.cpus or 0)
    cpus_per_node = math.ceil(cpus / max(num_nodes, 1)) if cpus else 0
    mem_per_gpu = _mem(j.memory_per_gpu)
    if j.memory_per_node:
        mem_node = _mem(j.memory_per_node) or 0
    elif j.memory_per_cpu:
        mem_node = (_mem(j.memory_per_cpu) or 0) * cpus_per_node
    else:
        mem_node = (mem_per_gpu or 0) * gpn
    comment = str(j.comment or "")
    spec, spec_error = spec_from_comment(comment)
    ran = state.active or state.finished
    return Job(
        job_id=int(j.id), user=str(j.user_name or j.user_id), name=str(j.name or ""), state=state, reason=reason,
        nodes=nodes, num_nodes=num_nodes, gpus_per_node=gpn, cpus_per_node=cpus_per_node, mem_per_node_mb=mem_node,
        cpus_per_gpu=int(j.cpus_per_gpu) if j.cpus_per_gpu else None, mem_per_gpu_mb=mem_per_gpu,
        restarts=int(j.requeue_count or 0), requeue=bool(j.is_requeueable),
        held=state is JobState.PENDING and j.priority == 0,
        partition=str(j.partition or ""), comment=comment, user_id=j.user_id,
        submit_time=float(j.submit_time) if j.submit_time else None,
        start_time=float(j.start_time) if (j.start_time and ran) else None,
        spec=spec, spec_error=spec_error,
    )


def _mem(value: Any) -> int | None:
    if value is None or value == 0:
        return None
    if isinstance(value, (int, float)):
        return int(value)
    return size_mb(str(value))


def state_from_pyslurm(nodes: Iterable[Any], jobs: Iterable[Any], *, taken_at: float,
                       slurm_version: str = "") -> ClusterState:
    """Translate pyslurm objects; a node whose GPU use pyslurm does not report gets it from its jobs.

    pyslurm exposes a node's used GRES only through its allocated TRES, which lack gres/gpu
    unless the site accounts GPUs (AccountingStorageTRES); the running jobs say the same thing.
    """
    job_list = tuple(job_from_pyslurm(j) for j in jobs)
    held: dict[str, int] = {}
    for job in job_list:
        if job.state.active:
            for name in job.nodes:
                held[name] = held.get(name, 0) + job.gpus_per_node
    node_list = []
    for raw in nodes:
        node = node_from_pyslurm(raw)
        if node.gpus_alloc < 0:
            node = replace(node, gpus_alloc=held.get(node.name, 0))
        node_list.append(node)
    return ClusterState(nodes=tuple(node_list), jobs=job_list, taken_at=taken_at, slurm_version=slurm_version)

