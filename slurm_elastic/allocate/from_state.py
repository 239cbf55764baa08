"""Building an AllocationProblem from a Slurm snapshot (ClusterState)."""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Union

from slurm_elastic.allocate.problem import AllocationProblem, JobRequest, NodeCapacity, Policy
from slurm_elastic.cluster.model import ClusterState, Job, Resources

log = logging.getLogger(__name__)

DEFAULT_RESTART_COST_S = 30.0

ThroughputSource = Union[Mapping[str, Callable[..., float]], Callable[[Job], Callable[..., float] | None], None]
RestartSource = Union[Mapping[str, float], Callable[[Job], float], float, None]


def problem_from_state(state: ClusterState, policy: Policy | None = None, *,
                       throughput: ThroughputSource = None,
                       restart_cost: RestartSource = None) -> AllocationProblem:
    """Per-node capacity for elastic work and every elastic job's request.

    Capacity = configured minus what active non-elastic jobs use there;
    unavailable nodes (down, drained, failed, not responding, ...) give
    nothing but stay in the problem so the jobs on them show as losing GPUs.
    Elastic jobs' own use is not subtracted: the solver redistributes it.
    `throughput` and `restart_cost` may be mappings by job key (the job id as
    text) or callables of the Job; missing entries take the defaults.
    """
    policy = policy or Policy()
    jobs = tuple(job_request(job, restart_cost_s=_restart(restart_cost, job, str(job.job_id)),
                             throughput=_throughput(throughput, job, str(job.job_id)))
                 for job in state.elastic_jobs)
    return AllocationProblem(jobs, capacity_from_state(state), policy)


def capacity_from_state(state: ClusterState) -> tuple[NodeCapacity, ...]:
    """What every node gives to elastic work: configured minus active non-elastic use; 0 when unavailable.

    Unavailable nodes stay in the problem so the jobs on them show as losing GPUs.
    """
    used: dict[str, Resources] = {}
    for job in state.jobs:
        if job.elastic or not job.state.active:
            continue
        for name in job.nodes:
            used[name] = used.get(name, Resources()) + job.uses_per_node
    nodes = []
    for node in state.nodes:
        if not node.available:
            nodes.append(NodeCapacity(node.name, 0, 0, 0))
            continue
        free = (node.total - used.get(node.name, Resources())).clamp()
        nodes.append(NodeCapacity(node.name, free.gpus, free.cpus, free.mem_mb))
    return tuple(nodes)


def job_request(job: Job, *, restart_cost_s: float = DEFAULT_RESTART_COST_S,
                throughput: Callable[..., float] | None = None, weight: float = 1.0,
                allowed_gpus: tuple[int, ...] | None = None, must_run: bool = False) -> JobRequest:
    """The one translation of an elastic Slurm job into a JobRequest.

    The range, step, CPUs and memory per GPU come from the job's spec; what
    it holds now from Slurm; `weight` multiplies the user's own weight; the
    rest is what a request source learned about the job.
    """
    spec = job.spec
    if spec is None:
        raise ValueError(f"job {job.job_id} is not elastic")
    current = {n: job.gpus_per_node for n in job.nodes} if job.state.active and job.gpus_per_node > 0 else {}
    return JobRequest(key=str(job.job_id), min_gpus=spec.min_gpus, max_gpus=spec.max_gpus, gpu_step=spec.gpu_step,
                      cpus_per_gpu=spec.cpus_per_gpu, mem_per_gpu_mb=spec.mem_per_gpu_mb,
                      weight=spec.weight * weight, current=current, restart_cost_s=restart_cost_s,
                      throughput=throughput, allowed_gpus=allowed_gpus, must_run=must_run)


def _restart(source: RestartSource, job: Job, key: str) -> float:
    if source is None:
        return DEFAULT_RESTART_COST_S
    if isinstance(source, (int, float)):
        return float(source)
    if isinstance(source, Mapping):
        return float(source.get(key, DEFAULT_RESTART_COST_S))
    return float(source(job))


def _throughput(source: ThroughputSource, job: Job, key: str) -> Callable[..., float] | None:
    if source is None:
        return None
    if isinstance(source, Mapping):
        return source.get(key)
    return source(job)
