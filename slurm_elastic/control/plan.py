"""Plans: the diff between the allocation the solver chose and what each elastic job has now."""

from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass
from typing import Callable, Mapping

from slurm_elastic.allocate.from_state import WAITING_FOR_RESOURCES
from slurm_elastic.allocate.problem import Allocation
from slurm_elastic.cluster.model import ClusterState, Job, JobState, NodeFlag, NodeState
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.spec import ElasticSpec


class PlanEntry(enum.Enum):
    """Where a plan enters the requeue protocol."""

    RUNNING = "running"    # signal, wait for the ACK, requeuehold, resize, release
    PENDING = "pending"    # hold, resize, release (queued, or requeued by Slurm after a node failure)


@dataclass(frozen=True, slots=True)
class Plan:
    """Change one job to `shape` (to_gpus 0: back to the queue at its minimum)."""

    job_id: int
    from_gpus: int
    to_gpus: int
    shape: RequestShape
    entry: PlanEntry
    reason: str
    forced: bool = False   # a node it used was lost: hysteresis and the restart budget do not apply
    user: str = ""         # the job's owner when planned ('' in plans journaled before owners were kept)
    exclude: tuple[str, ...] = ()   # nodes its ranks reported lost: given up now, never used again by this job
    keep: tuple[str, ...] = ()      # a shrink to whole nodes the job holds: they may be kept in place (protocol.py)
    place: tuple[str, ...] = ()     # the nodes the solve placed it on: it starts there (ReqNodeList; (): anywhere)

    @property
    def peer_lost(self) -> bool:
        """The job said it lost these nodes: its ranks have ended (no signal, no ACK to wait for)."""
        return bool(self.exclude)

    @property
    def leaves_queued(self) -> bool:
        """It leaves its job queued, on no named nodes (back to the queue, an earlier plan's nodes cleared, or
        kept queued while the cycle's other jobs start)."""
        return self.to_gpus == 0 or self.reason.startswith((CLEARED_REASON, KEPT_QUEUED_REASON))

    @property
    def keeps_queued(self) -> bool:
        """It only holds its queued job while the cycle's other plans start theirs: no resize, no StartTime."""
        return self.reason.startswith(KEPT_QUEUED_REASON)

    @property
    def log_level(self) -> int:
        """How loud its steps are: a hold that only keeps a queued job back is said in one line a cycle."""
        return logging.DEBUG if self.keeps_queued else logging.INFO

    @property
    def shrinks(self) -> bool:
        return self.shape.gpus < self.from_gpus

    def describe(self) -> str:
        return (f"job {self.job_id}: {self.from_gpus}->{self.to_gpus} GPUs "
                f"({self.shape.describe()}, {self.entry.value}; {self.reason})")

    def to_json(self) -> dict[str, object]:
        """The plan in status and rebalance --json output (the shape as nodes and GPUs per node)."""
        return {"job_id": self.job_id, "from_gpus": self.from_gpus, "to_gpus": self.to_gpus,
                "nodes": self.shape.nodes, "gpus_per_node": self.shape.gpus_per_node, "entry": self.entry.value,
                "reason": self.reason, "forced": self.forced, "place": list(self.place)}


ShapeFn = Callable[[ElasticSpec, int, Mapping[str, int]], RequestShape]   # spec, GPUs, placement


def requeued_by_slurm(job: Job) -> bool:
    """Slurm requeued it (node failure with --requeue): it would wait ~120 s for BeginTime."""
    return job.state is JobState.PENDING and job.restarts > 0 and job.reason == "BeginTime" and not job.held


def lost_node(job: Job, state: ClusterState) -> bool:
    """A node the job runs on is no longer available."""
    if job.state is not JobState.RUNNING:
        return False
    for name in job.nodes:
        try:
            if not state.node(name).available:
                return True
        except KeyError:
            return True
    return False


def dead_nodes(job: Job, state: ClusterState) -> frozenset[str]:
    """The job's nodes that are down, not responding or unknown to Slurm: Slurm itself will requeue the job."""
    out = set()
    for name in job.nodes:
        try:
            node = state.node(name)
        except KeyError:
            out.add(name)
            continue
        if node.state is NodeState.DOWN or NodeFlag.NOT_RESPONDING in node.flags:
            out.add(name)
    return frozenset(out)


def make_plans(state: ClusterState, allocation: Allocation, shape: ShapeFn,
               *, job_ids: frozenset[int] | None = None,
               handled: Mapping[int, int] | None = None,
               peer_lost: Mapping[int, tuple[str, ...]] | None = None,
               given_to_rigid: frozenset[str] = frozenset()) -> tuple[Plan, ...]:
    """The changes that take each in-scope elastic job from now to the allocation.

    `handled` maps job id -> restart count after the controller's own last plan: a pending job
    at that count was requeued by us (already resized, StartTime=now), not by a node failure.
    `peer_lost` maps job id -> the nodes its ranks reported lost (control/peer_loss.py): such a
    running job restarts now without them, at whatever size the allocation gives it.
    `given_to_rigid`: nodes kept for pending rigid jobs this cycle (named in a move's reason). A running
    job the allocation keeps at its size but places elsewhere moves.
    Shrinks come first so that grows find the GPUs they free. Each plan names the nodes it starts its job
    on (`placed_on`), but in a cycle that keeps nodes for a pending rigid job: Slurm starts that job on
    nodes of its own choosing, which need not be the ones kept, and a job held to the kept ones' others
    would wait for nodes the rigid job took; Slurm's own choice then starts it where there is room.
    """
    handled = handled or {}
    peer_lost = peer_lost or {}
    plans: list[Plan] = []
    for job in state.elastic_jobs:
        if job_ids is not None and job.job_id not in job_ids:
            continue
        target = allocation.gpus.get(str(job.job_id))
        if target is None:
            continue
        plan = _plan_for(job, int(target), allocation.placement.get(str(job.job_id), {}), shape, state,
                         ours=handled.get(job.job_id) == job.restarts, lost_nodes=peer_lost.get(job.job_id, ()),
                         given_to_rigid=given_to_rigid)
        if plan is not None:
            plans.append(plan)
    plans += kept_queued(state, plans, lambda job: job_ids is None or job.job_id in job_ids,
                         lambda spec, gpus: shape(spec, gpus, {}))
    # A plan that leaves its job queued with no nodes named is released after the rest: released first,
    # Slurm starts it on the first GPUs free, the nodes a grow beside it was planned on.
    plans.sort(key=lambda p: (p.leaves_queued, not p.shrinks, p.job_id))
    return tuple(plans)


def _plan_for(job: Job, target: int, placement: Mapping[str, int], shape: ShapeFn,
              state: ClusterState, *, ours: bool = False, lost_nodes: tuple[str, ...] = (),
              given_to_rigid: frozenset[str] = frozenset()) -> Plan | None:
    spec = job.spec
    assert spec is not None
    if job.held:
        return None  # held by its user or an admin (ours are in the journal): never ours to release
    now = job.gpus
    size = shape(spec, target, placement) if target > 0 else shape(spec, spec.min_gpus, {})
    # No nodes named in a cycle that yields to a rigid job (make_plans' docstring), nor for a --constraint,
    # which is not modelled: nodes named without its features would never start it (BadConstraints)
    place = placed_on(size, placement) if target > 0 and not given_to_rigid and not job.constraint else ()
    common = dict(job_id=job.job_id, from_gpus=now, to_gpus=target, shape=size, user=job.user, place=place)
    if job.state is JobState.RUNNING:
        dead = dead_nodes(job, state)
        if dead and not dead <= set(lost_nodes):
            # Slurm requeues it itself when it marks the node down; it enters at step 3 then. Not a job whose
            # ranks reported those nodes lost: it gives them up (in place, its ranks kept) before Slurm's
            # node failure requeues it (seen in the demo: Slurm flagged the node NOT_RESPONDING 0.4 s after
            # the kill, every cycle dropped the plan, and the job was requeued at the node timeout).
            return None
        if lost_nodes:
            why = f"its ranks lost node{'s' if len(lost_nodes) > 1 else ''} {','.join(lost_nodes)} (the job's report)"
            why += "; restarting without them" if target > 0 else "; no room without them: queued at its minimum"
            return Plan(entry=PlanEntry.RUNNING, reason=why, forced=True, exclude=tuple(lost_nodes), **common)
        lost = lost_node(job, state)
        # The same count elsewhere: the solve took GPUs off a node the job holds (for a pending rigid job,
        # or for another job's shape). Its current placement is always open to the solve at the restart
        # charge's price (allocate/instance.py, `stays`), so a move is one the objective paid for.
        leaving = [n for n in job.nodes if placement.get(n, 0) < job.gpus_per_node]
        moved = target == now and bool(placement) and bool(leaving)
        if target == now and not lost and not moved:
            return None
        if target == 0:
            reason = "no room: back to the queue at its minimum"
        elif lost:
            reason = "a node it uses is drained or unavailable"
        elif moved:
            whom = "a pending rigid job" if all(n in given_to_rigid for n in leaving) else "other work"
            reason = f"move: its GPUs on {','.join(leaving)} are given to {whom}"
        else:
            reason = "grow" if target > now else "shrink"
        keep = nodes_kept(job, target, placement) if not lost else ()
        return Plan(entry=PlanEntry.RUNNING, reason=reason, forced=lost, keep=keep, **common)
    if job.state is JobState.PENDING:
        if requeued_by_slurm(job) and not ours:
            why = "requeued by Slurm after a node failure"
            if target == 0:
                why += "; no room now, queued at its minimum"
            return Plan(entry=PlanEntry.PENDING, reason=why, forced=True, **common)
        if target == 0:
            if not job.required_nodes:
                return None
            # An earlier plan's nodes, taken since: it would wait for them alone; at its size, anywhere
            return Plan(entry=PlanEntry.PENDING, reason=f"{CLEARED_REASON} ({','.join(job.required_nodes)}): no room "
                        "there now", **{**common, "to_gpus": now, "shape": shape(spec, now, {})})
        if (size.nodes, size.gpus_per_node) != (job.num_nodes, job.gpus_per_node):
            return Plan(entry=PlanEntry.PENDING, reason="queued job resized to what fits now", **common)
        if set(job.required_nodes) != set(place):
            # Held and placed before any plan frees GPUs: unplaced, Slurm starts it on the first nodes that
            # free up (another job's grow); and an earlier plan's nodes may be taken since
            where = f"on {','.join(place)}" if place else "anywhere"
            return Plan(entry=PlanEntry.PENDING, reason=f"queued job placed {where}", **common)
    return None


CLEARED_REASON = "queued job's earlier nodes cleared"
KEPT_QUEUED_REASON = "kept queued while this cycle's resized jobs start"


def kept_queued(state: ClusterState, plans: list[Plan], in_scope: Callable[[Job], bool],
                shape: Callable[[ElasticSpec, int], RequestShape]) -> list[Plan]:
    """Plans that hold the queued elastic jobs the solve leaves waiting while `plans` start their jobs.

    Slurm starts pending jobs on whatever is free, and a job being resized is held, at priority 0, from its
    requeue to its release: a queued job the solve left waiting, of any priority, took the GPUs freed for
    it (live, 22.05: allocated in the millisecond of the requeue), the resized job waited in the queue,
    and the next cycle sent the intruder back, freeing GPUs the next waiting job took (an adversarial
    probe: one user's 40 queued jobs, 458 requeues). Held from before any GPU is freed until the resized
    jobs have started (protocol.py), they cannot. Only jobs Slurm would start on free GPUs are held, and
    only those whose shape fits on the GPUs free now plus all that the cycle's plans could free: each hold
    and release is two or three Slurm calls, for every waiting job, and most cannot start there anyway."""
    if not any(p.to_gpus > 0 and not p.leaves_queued for p in plans):
        return []
    planned = {p.job_id for p in plans}
    could_free: dict[str, int] = {}     # per node, the GPUs free now and those of every job a plan may requeue
    for job in state.jobs:
        if job.job_id in planned and job.state.active:
            for name in job.nodes:
                could_free[name] = could_free.get(name, 0) + job.gpus_per_node
    for node in state.nodes:
        could_free[node.name] = could_free.get(node.name, 0) + node.free.gpus

    def could_start(job: Job) -> bool:
        nodes = [n for n in state.nodes if could_free[n.name] >= job.gpus_per_node
                 and (not job.partition or not n.partitions or job.partition in n.partitions)]
        return len(nodes) >= job.num_nodes

    out = []
    for job in state.elastic_jobs:
        if (job.job_id in planned or job.state is not JobState.PENDING or job.held or job.spec is None
                or job.reason not in WAITING_FOR_RESOURCES or not in_scope(job) or not could_start(job)):
            continue
        size = min(max(job.gpus, job.spec.min_gpus), job.spec.max_gpus)   # its shape stays as it is (not resized)
        out.append(Plan(job_id=job.job_id, from_gpus=job.gpus, to_gpus=job.gpus, shape=shape(job.spec, size),
                        entry=PlanEntry.PENDING, reason=KEPT_QUEUED_REASON, user=job.user))
    return out


def placed_on(size: RequestShape, placement: Mapping[str, int]) -> tuple[str, ...]:
    """The nodes a plan starts the job on (its ReqNodeList): the solve's, where they are the shape (that
    many nodes, as many GPUs on each); () leaves the choice to Slurm. Without them Slurm starts the jobs a
    cycle released on the first nodes that fit, in priority order, and one job's grow found its nodes
    taken by another job released beside it."""
    used = [n for n, g in placement.items() if g > 0]
    if len(used) != size.nodes or any(placement[n] != size.gpus_per_node for n in used):
        return ()
    return tuple(used)


def nodes_kept(job: Job, target: int, placement: Mapping[str, int]) -> tuple[str, ...]:
    """The nodes a running job keeps when the allocation shrinks it to some of its own nodes, each whole
    (as many GPUs there as now): then it can give the others up in place. () otherwise, and when its batch
    script's node (Job.first_node) would be given up: Slurm cannot take that one from a running job."""
    if not 0 < target < job.gpus or not job.nodes or not placement:
        return ()
    keep = tuple(n for n in job.nodes if placement.get(n, 0) > 0)
    if (set(placement) - set(keep) or job.first_node not in keep
            or any(placement[n] != job.gpus_per_node for n in keep) or len(keep) * job.gpus_per_node != target):
        return ()
    return keep


def keep_first_nodes(state: ClusterState, allocation: Allocation, keeps_ranks: Callable[[Job], bool], *,
                     fixed: frozenset[str] = frozenset()) -> tuple[Allocation, dict[str, str]]:
    """The allocation, with every shrink that would give up its job's first node (the batch script's, which
    Slurm cannot take from a running job) turned into one that keeps it, where that changes nothing else.

    The first node and one the shrink keeps swap names in every placement when the two are alike (same
    size, state, partitions and load, no other elastic job on them): each job then sees the capacity it was solved for,
    and the job `keeps_ranks` says goes on in place can give the other one up without a requeue. `fixed`:
    nodes whose name matters beyond their record (an advance reservation's), never swapped. Returns the
    allocation and the names swapped (each node -> the one it became), for what else names nodes."""
    placement: dict[str, dict[str, int]] | None = None
    swapped: dict[str, str] = {}
    for job in state.elastic_jobs:
        rows = (placement or allocation.placement).get(str(job.job_id), {})
        target = allocation.gpus.get(str(job.job_id), 0)
        if job.state is not JobState.RUNNING or len(job.nodes) < 2 or not 0 < target < job.gpus or not rows:
            continue
        first = job.first_node
        if first is None or first in fixed or rows.get(first, 0) or set(rows) - set(job.nodes) or any(v != job.gpus_per_node for v in rows.values()):
            continue
        swap = next((n for n in job.nodes if n in rows and n not in fixed and _alike(state, job, first, n)), None)
        if swap is None or not keeps_ranks(job):
            continue
        placement = placement or {k: dict(v) for k, v in allocation.placement.items()}
        swapped[first], swapped[swap] = swap, first
        for per_node in placement.values():
            a, b = per_node.pop(first, None), per_node.pop(swap, None)
            if a is not None:
                per_node[swap] = a
            if b is not None:
                per_node[first] = b
    return (allocation if placement is None else dataclasses.replace(allocation, placement=placement)), swapped


def _alike(state: ClusterState, job: Job, a: str, b: str) -> bool:
    """Nodes a and b are the same but for their names (size, state, partitions, what is allocated: `job`'s
    share of each is the same, so other users' jobs take the same there), and no other elastic job runs on
    either (its own placement would change with the names)."""
    if any(j.job_id != job.job_id and j.state.active and (a in j.nodes or b in j.nodes)
           for j in state.elastic_jobs):
        return False
    try:
        na, nb = state.node(a), state.node(b)
    except KeyError:
        return False
    return dataclasses.replace(nb, name=na.name, reason=na.reason) == na


def departed(plan: Plan, job: Job | None, *, restarts: int, held_by_us: bool) -> str | None:
    """Why the job, as observed now, is no longer what `plan` assumed; None while the plan still fits.

    `restarts` is the job's restart count when the plan opened; `held_by_us` says whether our
    hold step has been taken (or journaled: after a crash it may have been). Before our hold the
    plan assumes the job it saw: same owner, same size, not held by anyone, running (or queued)
    as planned. After it, only the end of the job or a new owner (a job id reused) stops us:
    the requeue itself moves the job through states the protocol expects.
    """
    if job is None:
        return "the job is gone from Slurm"
    if plan.user and job.user != plan.user:
        return f"job {job.job_id} now belongs to {job.user}, not {plan.user} (a reused job id)"
    if job.state.finished:
        return "the job was cancelled" if job.state is JobState.CANCELLED else f"the job ended ({job.state.value})"
    if held_by_us:
        return None
    if job.held:
        return "the job was held by someone else (its owner or an admin)"
    if plan.entry is PlanEntry.RUNNING:
        if job.state is JobState.RUNNING:
            if job.restarts != restarts:
                return f"the job was restarted meanwhile (restart {restarts} -> {job.restarts})"
            if job.gpus != plan.from_gpus:
                return f"the job was resized by someone else ({plan.from_gpus} -> {job.gpus} GPUs)"
            return None
        if job.state is JobState.PENDING and job.restarts > restarts:
            return None   # requeued by Slurm (a node failed): it enters at the hold, queued
        return f"the job is {job.state.value}, not running"
    if job.state is JobState.RUNNING:
        return "the queued job started before it could be held; the next cycle plans it as running"
    if job.state is not JobState.PENDING:
        return f"the job is {job.state.value}, not queued"
    if job.gpus != plan.from_gpus:
        return f"the queued job was resized by someone else ({plan.from_gpus} -> {job.gpus} GPUs)"
    return None
