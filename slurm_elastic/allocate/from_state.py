"""Building an AllocationProblem from a Slurm snapshot (ClusterState)."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Union

from slurm_elastic.allocate.problem import AllocationProblem, JobRequest, NodeCapacity, Policy
from slurm_elastic.cluster.backfill import free_now, reserve
from slurm_elastic.cluster.model import ClusterState, Job, JobState, NodeFlag, Resources, queue_order
from slurm_elastic.cluster.reservations import AdvanceReservation, blocking, open_nodes

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
    return AllocationProblem(with_partitions(jobs, state), capacity_from_state(state), policy)


def partition_nodes(state: ClusterState, partition: str) -> frozenset[str] | None:
    """The nodes of `partition`; None where that is not known (no partition given, or the snapshot lists
    no node's partitions). A pending job's comma list: the one with the most GPUs, where any size that
    fits a partition of the list fits (Slurm starts the job in one of them, never across them)."""
    names = sorted({p for p in partition.split(",") if p})
    if not names or not any(n.partitions for n in state.nodes):
        return None
    members = {p: frozenset(n.name for n in state.nodes if p in n.partitions) for p in names}
    gpus = {n.name: n.gpus for n in state.nodes}
    return max(members.values(), key=lambda nodes: sum(gpus[n] for n in nodes))


def with_reservations(requests: tuple[JobRequest, ...], state: ClusterState,
                      windows: Mapping[str, AdvanceReservation] | None, now: float) -> tuple[JobRequest, ...]:
    """A job in an advance reservation limited to its nodes while Slurm has it active, and to none
    otherwise (Slurm starts such a job nowhere else, and not before or after the window); `windows`
    None: the reservations could not be read, so no such job is given GPUs it might not get. Every job
    is kept off the nodes of the other reservations that would not let it start now
    (`reservations.blocking`: Slurm would leave it pending until they end)."""
    jobs = {str(j.job_id): j for j in state.elastic_jobs}
    every = frozenset(n.name for n in state.nodes)
    out = []
    for r in requests:
        job = jobs.get(r.key)
        if job is not None:
            allowed = r.allowed_nodes
            if job.reservation:
                inside = open_nodes(windows, job.reservation)
                allowed = inside if allowed is None else allowed & inside
            blocked = blocking(windows, job.reservation, now, job.time_limit_s)
            if blocked:
                allowed = (every if allowed is None else allowed) - frozenset(blocked)
            r = dataclasses.replace(r, allowed_nodes=allowed)
        out.append(r)
    return tuple(out)


def with_partitions(requests: tuple[JobRequest, ...], state: ClusterState) -> tuple[JobRequest, ...]:
    """Each elastic job's request limited to its partition's nodes: Slurm starts a resized job only there."""
    partitions = {str(j.job_id): j.partition for j in state.elastic_jobs}
    return tuple(dataclasses.replace(r, allowed_nodes=partition_nodes(state, partitions.get(r.key, "")))
                 for r in requests)


def away_from_lost_nodes(requests: tuple[JobRequest, ...], state: ClusterState,
                         lost: Mapping[int, frozenset[str]],
                         back: Mapping[int, frozenset[str]] | None = None) -> tuple[JobRequest, ...]:
    """Each job kept off the nodes its own ranks reported lost and those Slurm keeps it off (its
    ExcNodeList: its user's --exclude, lost nodes excluded by an earlier plan), but for those it runs on now.

    Slurm counts a lost node up until SlurmdTimeout (300 s at many sites), so the solve would place the
    job there again: shrunk in place off it, the job would be grown back onto it at the next cycle. Only
    the reporting job is kept off: its word does not change where others may run. An excluded node
    placed would be a plan Slurm cannot start (a plan names its nodes, control/plan.py `placed_on`). A
    node it runs on now (Slurm started it there) is left to it: moving it off would be a restart. `back`:
    nodes a job reported lost that have come back; its next resize takes them out of its ExcNodeList
    (control/protocol.py `_exclude_earlier_losses`), so the solve may place it there again.
    """
    back = back or {}
    every = frozenset(n.name for n in state.nodes)
    excluded = {str(j.job_id): frozenset(j.excluded_nodes) for j in state.jobs if j.excluded_nodes}
    out = []
    for r in requests:
        off = lost.get(int(r.key), frozenset()) if r.key.isdigit() else frozenset()
        readmitted = back.get(int(r.key), frozenset()) if r.key.isdigit() else frozenset()
        off = (off | (excluded.get(r.key, frozenset()) - readmitted)) - frozenset(r.current)
        if off:
            r = dataclasses.replace(r, allowed_nodes=(every if r.allowed_nodes is None else r.allowed_nodes) - off)
        out.append(r)
    return tuple(out)


def capacity_from_state(state: ClusterState) -> tuple[NodeCapacity, ...]:
    """What every node gives to elastic work: configured minus active non-elastic use; 0 when unavailable.

    Unavailable nodes stay in the problem so the jobs on them show as losing GPUs.
    """
    used: dict[str, Resources] = {}
    held: dict[str, int] = {}
    for job in state.jobs:
        if not job.state.active:
            continue
        for name in job.nodes:
            if job.elastic:
                held[name] = held.get(name, 0) + job.gpus_per_node
            else:
                used[name] = used.get(name, Resources()) + job.uses_per_node
    nodes = []
    for node in state.nodes:
        if not node.available:
            nodes.append(NodeCapacity(node.name, 0, 0, 0))
            continue
        free = (node.total - used.get(node.name, Resources())).clamp()
        gpus = free.gpus
        if NodeFlag.COMPLETING in node.flags:
            # Slurm starts nothing there until the completion ends, and one was seen stuck IDLE+COMPLETING
            # with no job left after a slurmctld restart: a job placed there anew waited for good. The
            # elastic jobs on it keep theirs; none is placed there anew until the flag is gone.
            gpus = min(gpus, held.get(node.name, 0))
        nodes.append(NodeCapacity(node.name, gpus, free.cpus, free.mem_mb))
    return tuple(nodes)


# Pending reasons that mean "waiting for resources only" (not a dependency, a hold, a BeginTime, a limit).
WAITING_FOR_RESOURCES = frozenset({"Resources", "Priority", "None", ""})


@dataclass(frozen=True, slots=True)
class RigidPolicy:
    """The site's rules for giving borrowed GPUs back to pending rigid (non-elastic) jobs.

    GPUs an elastic job holds above its guarantee (its minimum; with
    `guarantee` "submitted", the GPUs it was submitted at, where larger) are
    borrowed and go back to any pending rigid job waiting for resources. Its
    guarantee above its minimum goes back only to a rigid job of higher
    Slurm priority than its own, as a rigid job of that size would keep it;
    its minimum likewise, and never when `protect_minimum`. `partitions`: the
    partitions whose rigid jobs elastic jobs yield to (empty: every
    partition); `yield_after_s`: how long a rigid job waits before they do;
    `lookahead`: how many pending rigid jobs, in Slurm's priority order, are
    looked at.
    """

    partitions: tuple[str, ...] = ()
    yield_after_s: float = 0.0
    protect_minimum: bool = True
    guarantee: str = "minimum"      # or "submitted"
    lookahead: int = 8

    def __post_init__(self) -> None:
        if self.guarantee not in GUARANTEES:
            raise ValueError(f"guarantee must be one of {', '.join(GUARANTEES)}, got {self.guarantee!r}")

    def kept_from(self, elastic: Job, rigid: Job, submitted: int | None) -> int:
        """The GPUs running elastic job `elastic` keeps from pending rigid job `rigid`."""
        assert elastic.spec is not None
        ahead = (elastic.priority or 0) >= (rigid.priority or 0)
        kept = elastic.spec.min_gpus if self.protect_minimum or ahead else 0
        if ahead and self.guarantee == "submitted" and submitted is not None:
            kept = max(kept, min(submitted, elastic.gpus))
        return kept


GUARANTEES = ("minimum", "submitted")


@dataclass(frozen=True, slots=True)
class RigidReservation:
    """Whole nodes kept from elastic work for one pending rigid job, and the elastic GPUs that must leave them."""

    job_id: int
    priority: int | None
    nodes: tuple[str, ...]
    gpus_reclaimed: int

    def describe(self) -> str:
        prio = "" if self.priority is None else f", priority {self.priority}"
        return f"gave {self.gpus_reclaimed} GPUs back to job {self.job_id} (rigid{prio}) on {','.join(self.nodes)}"


@dataclass(frozen=True, slots=True)
class RigidDemand:
    """What pending rigid jobs take from elastic capacity this cycle, and the one that still waits (and why)."""

    capacity: tuple[NodeCapacity, ...]
    reserved: tuple[RigidReservation, ...] = ()
    waiting: tuple[tuple[int, str], ...] = ()   # (job id, why elastic jobs do not yield to it)


def rigid_queue(state: ClusterState, rules: RigidPolicy, elastic: frozenset[int] = frozenset()) -> tuple[Job, ...]:
    """Pending rigid jobs waiting only for resources, in Slurm's priority order, that the rules let borrow back
    (`elastic`: jobs seen here without their spec that are elastic all the same: a plan of theirs is open)."""
    def waited(job: Job) -> float:
        return state.taken_at - job.submit_time if job.submit_time is not None else math.inf

    queue = [j for j in state.jobs if not j.elastic and j.job_id not in elastic
             and j.state is JobState.PENDING and not j.held and j.gpus > 0
             and j.reason in WAITING_FOR_RESOURCES and waited(j) >= rules.yield_after_s
             and (not rules.partitions or j.partition in rules.partitions)]
    return tuple(sorted(queue, key=queue_order)[:rules.lookahead])


def reserve_for_rigid(state: ClusterState, capacity: tuple[NodeCapacity, ...], rules: RigidPolicy,
                      windows: Mapping[str, AdvanceReservation] | None = None,
                      keeps_ranks: Callable[[Job], bool] | None = None,
                      planned: frozenset[int] = frozenset(),
                      submitted: Callable[[Job], int | None] | None = None) -> RigidDemand:
    """Capacity for elastic work less whole nodes kept for the pending rigid jobs Slurm would start next.

    For each such job in priority order: the nodes of its partition that
    could hold its shape once elastic work left them, the ones that need the
    fewest elastic GPUs to leave first, then those the most running elastic
    jobs can give up in place (`keeps_ranks`, not their batch host). It stops at the first job that does
    not fit (Slurm starts nothing below it ahead of it either) or whose
    nodes would cut into elastic minimums protected from it, or into the
    minimums of pending elastic jobs Slurm would start before it; the nodes
    Slurm's backfill then holds for that job give elastic jobs no more than
    they hold there. `planned`: elastic jobs whose plan is open, seen without their spec (never taken for
    rigid ones); `submitted`: the GPUs a job was submitted at, for a "submitted" guarantee (RigidPolicy).
    A job in an advance reservation is looked at only while `windows` has it active, on its nodes; no job
    on the nodes of another reservation that would not let it start now (`reservations.blocking`).
    """
    left = {c.name: c for c in capacity}
    held: dict[str, int] = {}
    for job in state.elastic_jobs:
        if job.state.active:
            for name in job.nodes:
                held[name] = held.get(name, 0) + job.gpus_per_node
    partitions = {n.name: n.partitions for n in state.nodes}
    running = [j for j in state.elastic_jobs if j.state.active and j.spec is not None]
    sizes: dict[int, int | None] | None = None     # read once, and only when a rigid job is looked at
    # Slurm takes whole nodes from a running job but never its batch host: a job whose ranks go on in
    # their processes gives up any other node in place (docs/controller.md, "Shrinking on healthy nodes
    # in place"), its batch host only by a requeue, like a job without that word wherever it shrinks.
    # Where the GPUs to take back tie, the nodes more jobs can give up in place come first. Only toward
    # them: a false word draws the rigid job onto nodes the liar itself gives up, never elsewhere.
    in_place: dict[str, int] | None = None
    queued = [j for j in state.elastic_jobs if j.state is JobState.PENDING and not j.held and j.spec is not None
              and j.reason in WAITING_FOR_RESOURCES]
    reserved: list[RigidReservation] = []
    waiting: list[tuple[int, str]] = []
    for job in rigid_queue(state, rules, planned):
        inside = open_nodes(windows, job.reservation) if job.reservation else None
        if inside is not None and not inside:
            continue      # Slurm starts it only inside its window: nothing elastic work leaves helps now
        blocked = blocking(windows, job.reservation, state.taken_at, job.time_limit_s)
        need = Resources(job.gpus_per_node, job.cpus_per_node, job.mem_per_node_mb)
        fits = [c for c in left.values() if c.gpus >= need.gpus and c.cpus >= need.cpus and c.mem_mb >= need.mem_mb
                and (not job.partition or job.partition in partitions.get(c.name, (job.partition,)))
                and (inside is None or c.name in inside) and c.name not in blocked]
        if len(fits) < job.num_nodes:
            waiting.append((job.job_id, "does not fit even without elastic jobs"))
            left = _keep_off_slurms_reservation(state, job, left, held)
            break

        def cost(c: NodeCapacity) -> int:
            return max(0, need.gpus - (c.gpus - held.get(c.name, 0)))

        if in_place is None:
            in_place = _given_up_in_place([j for j in running if keeps_ranks is not None and keeps_ranks(j)])
        chosen = sorted(fits, key=lambda c: (cost(c), -in_place.get(c.name, 0) if cost(c) else 0,  # type: ignore[union-attr]
                                             c.name))[:job.num_nodes]
        if sizes is None:
            sizes = ({j.job_id: submitted(j) for j in running} if submitted and rules.guarantee == "submitted"
                     else {})
        protected = sum(rules.kept_from(e, job, sizes.get(e.job_id)) for e in running)
        # Slurm would start a pending elastic job of higher priority first: its minimum comes before this job
        ahead = sum(e.spec.min_gpus for e in queued  # type: ignore[union-attr]
                    if queue_order(e) < queue_order(job)
                    and (not e.partition or not job.partition or e.partition == job.partition))
        after = sum(c.gpus for c in left.values()) - need.gpus * job.num_nodes
        if after < protected + ahead:
            kept = "minimums" if rules.guarantee == "minimum" else "guarantees"
            why = (f"elastic jobs' {kept} ({protected} GPUs) are protected from it" if after < protected else
                   f"pending elastic jobs of higher priority start first ({ahead} GPUs at their minimums)")
            waiting.append((job.job_id, why))
            left = _keep_off_slurms_reservation(state, job, left, held)
            break
        gpus_reclaimed = sum(cost(c) for c in chosen)
        for c in chosen:
            left[c.name] = NodeCapacity(c.name, c.gpus - need.gpus, c.cpus - need.cpus, c.mem_mb - need.mem_mb)
            held[c.name] = max(0, held.get(c.name, 0) - cost(c))
        reserved.append(RigidReservation(job.job_id, job.priority, tuple(c.name for c in chosen), gpus_reclaimed))
    # Logged by the reconciler when it changes (its waits), not here every cycle.
    return RigidDemand(tuple(left[c.name] for c in capacity), tuple(reserved), tuple(waiting))


def _given_up_in_place(jobs: list[Job]) -> dict[str, int]:
    """How many of `jobs` (whose ranks go on in their processes) could give up each node in place: every
    node of theirs but the batch host."""
    count: dict[str, int] = {}
    for job in jobs:
        for name in job.nodes:
            if name != job.first_node:
                count[name] = count.get(name, 0) + 1
    return count


def _keep_off_slurms_reservation(state: ClusterState, job: Job, left: dict[str, NodeCapacity],
                                 held: Mapping[str, int]) -> dict[str, NodeCapacity]:
    """No elastic growth on the nodes Slurm's backfill keeps for `job`: an elastic job has no time limit
    that ends before the reservation, so one (re)started there would stay pending; those there keep theirs."""
    ending = [(j.expected_end, j) for j in state.jobs if j.state.active]
    nodes = reserve(job, free_now(state.nodes), ending).nodes
    return {name: NodeCapacity(name, min(c.gpus, held.get(name, 0)), c.cpus, c.mem_mb) if name in nodes else c
            for name, c in left.items()}


def job_request(job: Job, *, restart_cost_s: float = DEFAULT_RESTART_COST_S, in_place_cost_s: float | None = None,
                throughput: Callable[..., float] | None = None, weight: float = 1.0,
                own_weight: float | None = None, allowed_gpus: tuple[int, ...] | None = None,
                must_run: bool = False, charge_weight: float = 1.0) -> JobRequest:
    """The one translation of an elastic Slurm job into a JobRequest.

    The range, step, CPUs and memory per GPU come from the job's spec; what
    it holds now from Slurm; `weight` multiplies `own_weight`, the job's weight
    among its user's jobs (None: its `--weight` as written); the rest is what a
    request source learned about the job.
    """
    spec = job.spec
    if spec is None:
        raise ValueError(f"job {job.job_id} is not elastic")
    current = {n: job.gpus_per_node for n in job.nodes} if job.state.active and job.gpus_per_node > 0 else {}
    own = spec.weight if own_weight is None else own_weight
    return JobRequest(key=str(job.job_id), min_gpus=spec.min_gpus, max_gpus=spec.max_gpus, gpu_step=spec.gpu_step,
                      cpus_per_gpu=spec.cpus_per_gpu, mem_per_gpu_mb=spec.mem_per_gpu_mb, weight=own * weight,
                      current=current, user=job.user, own_weight=own, restart_cost_s=restart_cost_s,
                      in_place_cost_s=in_place_cost_s, batch_node=job.first_node if current else None,
                      throughput=throughput, allowed_gpus=allowed_gpus, must_run=must_run,
                      charge_weight=charge_weight)


def with_in_place(requests: Sequence[JobRequest], state: ClusterState,
                  keeps_ranks: Callable[[Job], bool]) -> tuple[JobRequest, ...]:
    """The requests, where a job's ranks do not go on in their processes this incarnation (`keeps_ranks`)
    without an in-place cost: every resize of that job is a relaunch."""
    running = {str(j.job_id): j for j in state.elastic_jobs if j.state is JobState.RUNNING}
    return tuple(r if r.in_place_cost_s is None or (r.key in running and keeps_ranks(running[r.key]))
                 else dataclasses.replace(r, in_place_cost_s=None) for r in requests)


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
