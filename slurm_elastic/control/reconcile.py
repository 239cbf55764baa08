"""One level-triggered reconcile cycle: observe everything, solve, diff, act through the requeue protocol.

The Reconciler has two seams: a request source (control/requests/: how each
elastic job becomes a JobRequest; `default_request_source()` unless told) and
an allocator (a function problem -> Allocation; `allocate.solve` unless told).
`Reconciler.decide(state, now)` is the decision step alone: a state and a
clock in, the plans out, with hysteresis, the restart budget and the request
source applied; `cycle()` observes, decides and acts. See docs/simulator.md
for driving `decide` from another simulator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from slurm_elastic.allocate.commitments import Commitment
from slurm_elastic.allocate.from_state import (RigidDemand, RigidPolicy, away_from_lost_nodes, capacity_from_state,
                                              job_request, reserve_for_rigid, with_in_place, with_partitions,
                                              with_reservations)
from slurm_elastic.allocate.problem import (Allocation, AllocationProblem, JobDecision, JobRequest, NodeCapacity,
                                            Policy)
from slurm_elastic.allocate.shapes import never_placeable, request_shape, shape_of, spanning_widths
from slurm_elastic.allocate.users import with_neutral_places
from slurm_elastic.cluster.backend import Backend, NodeExcludingBackend
from slurm_elastic.cluster.model import (UNAVAILABLE_FLAGS, ClusterState, Job, JobState, NodeFlag, NodeState,
                                         Resources)
from slurm_elastic.cluster.reservations import AdvanceReservation, ReservationReader, blocking, open_nodes
from slurm_elastic.control.job_dirs import JobDirGuard
from slurm_elastic.control.journal import DONE, OPEN, Journal, PlanRecord
from slurm_elastic.control.peer_loss import KEPT, PeerLoss, PeerLossReader, readmission, ready, still_lost
from slurm_elastic.control.plan import Plan, PlanEntry, keep_first_nodes, lost_node, make_plans, requeued_by_slurm
from slurm_elastic.control.protocol import Outcome, ProtocolSettings, RequeueProtocol, keeps_ranks
from slurm_elastic.control.requests import (RequestSettings, Requests, RequestSource, default_request_source,
                                            with_basis)
from slurm_elastic.control.requests.rules import BatchGeometry, SpeedFrontier
from slurm_elastic.control.revive import Reviver
from slurm_elastic.errors import SlurmError
from slurm_elastic.settings import (ACK_TIMEOUT, DRAIN_EXPIRY, DRAIN_ON_PEER_LOSS, HYSTERESIS, NODE_CONFIRM_S,
                                    RECENT_PLAN_S, RESTART_BUDGET, SIGNAL, SPEED, Setting)

log = logging.getLogger(__name__)

HOUR_S = 3600.0
DRAINS_PER_USER_PER_HOUR = 2   # --drain-on-peer-loss: what one user's reports can drain, at most


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """How a controller behaves; the same for the admin daemon and user-mode watch."""

    policy: Policy = Policy()
    protocol: ProtocolSettings = ProtocolSettings()
    min_resize_interval_s: float = HYSTERESIS.default        # no resize sooner, unless a node the job uses is lost
    restart_budget_per_hour: int = RESTART_BUDGET.default     # controller-caused restarts per job per hour
    user: str | None = None                # user mode: only this user's jobs are elastic to us
    node_confirm_s: float = NODE_CONFIRM_S.default            # re-read nodes before acting on one just gone
    recent_plan_s: float = RECENT_PLAN_S.default              # our own requeue explains a BeginTime reason
    measured_speed: bool = SPEED.default == "measured"        # False: the default speed model
    drain_on_peer_loss: bool = DRAIN_ON_PEER_LOSS.default     # admin mode: drain a node a job reported lost
    drain_expiry_s: float = DRAIN_EXPIRY.default              # such a drain is resumed this long after it was made
    rigid: RigidPolicy = RigidPolicy()     # giving borrowed GPUs back to pending rigid jobs (allocate/from_state.py)

    def settings(self) -> dict[str, float | int | str]:
        """The settings a running controller announces (in the daemon heartbeat, under their keys in
        slurm_elastic/settings.py), so that `status`, `admin status` and a dry run decide with them
        rather than with their own defaults."""
        return {HYSTERESIS.heartbeat: self.min_resize_interval_s,  # type: ignore[dict-item]
                RESTART_BUDGET.heartbeat: self.restart_budget_per_hour,
                ACK_TIMEOUT.heartbeat: self.protocol.ack_timeout_s, SIGNAL.heartbeat: self.protocol.signal,
                SPEED.heartbeat: "measured" if self.measured_speed else "linear"}

    def request_settings(self, **changes: Any) -> RequestSettings:
        """The request source's settings this controller decides with (`changes` on top: the ablation's)."""
        return RequestSettings(measured_speed=self.measured_speed, hold_s=self.min_resize_interval_s,
                               objective=self.policy.objective, **changes)

    def with_settings(self, settings: Mapping[str, object]) -> ControllerConfig:
        """This config with a running controller's announced settings (each validated; others kept)."""
        def number(setting: Setting[Any]) -> float | None:
            v = settings.get(setting.heartbeat or "")
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and setting.in_bounds(v)
            return float(v) if ok else None  # type: ignore[arg-type]

        hyst = number(HYSTERESIS)
        budget = number(RESTART_BUDGET)
        ack = number(ACK_TIMEOUT)
        sig = settings.get(SIGNAL.heartbeat or "")
        speed = settings.get(SPEED.heartbeat or "")
        protocol = self.protocol
        if ack is not None:
            protocol = dataclasses.replace(protocol, ack_timeout_s=ack)
        if isinstance(sig, str) and sig.isalnum() and len(sig) <= 16:
            protocol = dataclasses.replace(protocol, signal=sig)
        return dataclasses.replace(
            self, protocol=protocol,
            min_resize_interval_s=self.min_resize_interval_s if hyst is None else hyst,
            restart_budget_per_hour=self.restart_budget_per_hour if budget is None else int(budget),
            measured_speed=self.measured_speed if speed not in SPEED.choices else speed == "measured")


@dataclass(frozen=True, slots=True)
class CycleReport:
    """What one cycle saw, decided and did (printed by `admin rebalance`, fed to the metrics)."""

    taken_at: float
    dry_run: bool
    plans: tuple[Plan, ...] = ()
    outcomes: tuple[Outcome, ...] = ()
    recovered: tuple[Outcome, ...] = ()
    allocation: Allocation | None = None
    problem: AllocationProblem | None = None
    pinned: Mapping[int, str] = field(default_factory=dict)
    malformed: Mapping[int, str] = field(default_factory=dict)
    nodes_lost: tuple[str, ...] = ()
    nodes_gained: tuple[str, ...] = ()
    job_states: Mapping[int, str] = field(default_factory=dict)
    current_gpus: Mapping[int, int] = field(default_factory=dict)
    waits: Mapping[int, str] = field(default_factory=dict)
    peer_losses: Mapping[int, PeerLoss] = field(default_factory=dict)
    drained: tuple[str, ...] = ()
    resumed: tuple[str, ...] = ()   # nodes whose drain on a job's report expired and was ended
    revived: tuple[int, ...] = ()   # jobs requeued after a kill meant for their previous incarnation
    gpus_total: int = 0
    gpus_elastic: int = 0
    gpus_free: int = 0
    cycle_s: float = 0.0
    rigid: RigidDemand | None = None   # what pending rigid jobs take back this cycle, and which still wait
    owners: Mapping[int, str] = field(default_factory=dict)   # job id -> its user, for the jobs it speaks of

    def target(self, job_id: int) -> int | None:
        if self.allocation is None:
            return None
        g = self.allocation.gpus.get(str(job_id))
        return None if g is None else int(g)

    def to_json(self) -> dict[str, object]:
        alloc = self.allocation
        return {
            "taken_at": self.taken_at, "dry_run": self.dry_run, "cycle_s": round(self.cycle_s, 4),
            "plans": [p.to_json() for p in self.plans],
            "outcomes": [o.to_json() for o in self.outcomes],
            "recovered": [o.to_json() for o in self.recovered],
            "jobs": [{"job_id": j, "state": s, "gpus": self.current_gpus.get(j, 0), "target_gpus": self.target(j),
                      "pinned": self.pinned.get(j), "why": self.waits.get(j)}
                     for j, s in sorted(self.job_states.items())],
            "malformed": [{"job_id": j, "error": e} for j, e in sorted(self.malformed.items())],
            "nodes_lost": list(self.nodes_lost), "nodes_gained": list(self.nodes_gained),
            "peer_losses": [{"job_id": j, "lost_nodes": list(x.lost_nodes), "step_id": x.step_id,
                             "commit": x.commit, "committed_step": x.committed_step,
                             "detected_at": x.detected_at, "seen_at": x.seen_at}
                            for j, x in sorted(self.peer_losses.items())],
            "drained": list(self.drained), "resumed": list(self.resumed), "revived": list(self.revived),
            "gpus": {"total": self.gpus_total, "elastic": self.gpus_elastic, "free": self.gpus_free},
            # no bound (greedy) or no score (the warm path): null, not JSON's invalid NaN
            "solver": None if alloc is None else {"status": alloc.status, "method": alloc.method,
                                                  "objective": _finite(alloc.objective),
                                                  "mip_gap": _finite(alloc.mip_gap), "bound": _finite(alloc.bound),
                                                  "solve_s": alloc.solve_s, "notes": list(alloc.notes)},
        }


_SECONDS = re.compile(r"\d+(?:\.\d+)?s\b")


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _read_once(word: Callable[[Job], bool]) -> Callable[[Job], bool]:
    """`word` read once per job incarnation (each read opens a file in the job's directory)."""
    seen: dict[tuple[int, int], bool] = {}

    def read(job: Job) -> bool:
        key = (job.job_id, job.restarts)
        if key not in seen:
            seen[key] = word(job)
        return seen[key]
    return read


def scope_state(state: ClusterState, user: str | None) -> tuple[ClusterState, dict[int, str]]:
    """The state as this controller may act on it, and the jobs whose elastic spec is malformed.

    In user mode the other users' elastic jobs become plain usage (spec None):
    the capacity left to the caller is whatever the rest of the cluster leaves.
    """
    malformed = {j.job_id: j.spec_error for j in state.jobs
                 if j.spec_error and not j.state.finished and (user is None or j.user == user)}
    # Held jobs (by their user or an admin; ours are finished by recovery before this) and, in
    # user mode, other users' jobs are not ours to size: they count as plain usage (spec None).
    jobs = tuple(j if j.spec is None or (not j.held and (user is None or j.user == user))
                 else dataclasses.replace(j, spec=None) for j in state.jobs)
    return dataclasses.replace(state, jobs=jobs), malformed  # type: ignore[return-value]


Allocator = Callable[[AllocationProblem], Allocation]


@dataclass(frozen=True, slots=True)
class Decision:
    """What the decision step chose for one state: the plans and how it got there."""

    taken_at: float
    plans: tuple[Plan, ...]
    problem: AllocationProblem
    allocation: Allocation
    scoped: ClusterState
    pinned: Mapping[int, str] = field(default_factory=dict)
    malformed: Mapping[int, str] = field(default_factory=dict)
    waits: Mapping[int, str] = field(default_factory=dict)   # job id -> why it is not being resized now
    peer_losses: Mapping[int, PeerLoss] = field(default_factory=dict)   # reports read (acted on or not yet)
    bad_geometry: Mapping[int, str] = field(default_factory=dict)   # job id -> why its ranks cannot run at its size
    rigid: RigidDemand | None = None


def holding_only(state: ClusterState, gone: Mapping[int, frozenset[str]]) -> ClusterState:
    """`state` with each job in `gone` holding only its other nodes (one it would lose entirely is left as is)."""
    if not gone:
        return state
    jobs = []
    for job in state.jobs:
        lost = gone.get(job.job_id, frozenset())
        keep = tuple(n for n in job.nodes if n not in lost)
        jobs.append(job if not keep or keep == job.nodes else dataclasses.replace(job, nodes=keep, num_nodes=len(keep)))
    return dataclasses.replace(state, jobs=tuple(jobs))


def without_reported_losses(capacity: tuple[NodeCapacity, ...], state: ClusterState,
                            losses: Mapping[int, PeerLoss]) -> tuple[NodeCapacity, ...]:
    """Capacity less what each job reporting a lost node holds there.

    Slurm still counts such a node up (until SlurmdTimeout) and the job's share of it as usable, so
    the solve would give the job its old size again, on GPUs no rank of it can use: requeued, it
    would wait for them (ExcNodeList keeps it off the node); it could not be shrunk in place. Only
    the reporting job's own share is taken away: its word does not change what others may use.
    """
    gone: dict[str, tuple[int, int, int]] = {}
    for job_id, loss in losses.items():
        job = state.job(job_id)
        for name in set(loss.lost_nodes) & set(job.nodes):
            g, c, m = gone.get(name, (0, 0, 0))
            gone[name] = (g + job.gpus_per_node, c + job.cpus_per_node, m + job.mem_per_node_mb)
    if not gone:
        return capacity
    return tuple(dataclasses.replace(n, gpus=max(n.gpus - gone[n.name][0], 0), cpus=max(n.cpus - gone[n.name][1], 0),
                                     mem_mb=max(n.mem_mb - gone[n.name][2], 0)) if n.name in gone else n
                 for n in capacity)


def solve(problem: AllocationProblem) -> Allocation:
    """The default allocator: the L1 MILP (allocate.solve)."""
    from slurm_elastic.allocate import solve as _solve

    return _solve(problem)


@contextlib.contextmanager
def native_stdout_silenced() -> Iterator[None]:
    """HiGHS prints a banner on fd 1 from C++ before any option can stop it; stdout is the CLI's
    (`sbatch --parsable`, `--json`), so the solver's native output goes to /dev/null."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


# The request rules whose notes say why a job's allowed counts stop below its max (each note ends in its name).
CAPPING_RULES = tuple(f"[{rule.name}]" for rule in (SpeedFrontier, BatchGeometry))


def pin_jobs(problem: AllocationProblem, pins: Mapping[int, int],
             must_run: frozenset[int] = frozenset()) -> AllocationProblem:
    """Fix the GPU count of each pinned job (job id -> GPUs); make `must_run` jobs run if anything fits.

    must_run is for jobs that were running until a node under them failed: they already paid
    their restart, and the point of the controller is that they come back at once on what is left.
    """
    if not pins and not must_run:
        return problem
    jobs: list[JobRequest] = []
    for req in problem.jobs:
        job_id = int(req.key) if req.key.isdigit() else None
        g = pins.get(job_id) if job_id is not None else None
        if g:
            req = dataclasses.replace(req, min_gpus=g, max_gpus=g, gpu_step=g, allowed_gpus=None, must_run=True,
                                      commitment=Commitment.HELD)
        elif job_id in must_run:
            req = dataclasses.replace(req, must_run=True, commitment=max(req.commitment, Commitment.NODE_LOST))
        jobs.append(req)
    return dataclasses.replace(problem, jobs=tuple(jobs))


def outside_windows(state: ClusterState, windows: Mapping[str, AdvanceReservation] | None, now: float, *,
                    lost: frozenset[int]) -> dict[int, str]:
    """Running elastic jobs a requeue would leave pending, and why each is kept at its size: its own
    reservation is no longer active (pending for good, reason Reservation), or it runs on nodes of another
    reservation that would not let it start again now (`reservations.blocking`: pending until that one
    ends), unless a pending job of that reservation waits for them (then it moves off). `windows` None:
    not readable, so every running job in one is kept. A job whose node was lost restarts anyway
    (elsewhere: `with_reservations` keeps it off those nodes)."""
    waited_for = {name for j in state.jobs if j.state is JobState.PENDING and j.reservation
                  for name in j.reservation.split(",")}
    out = {}
    for job in state.elastic_jobs:
        if job.state is not JobState.RUNNING or job.held or job.job_id in lost or lost_node(job, state):
            continue
        if job.reservation and windows is None:
            out[job.job_id] = f"its reservation {job.reservation} could not be read: kept at its size"
            continue
        if job.reservation and not open_nodes(windows, job.reservation):
            out[job.job_id] = (f"its reservation {job.reservation} is over: Slurm would not start it again "
                               "after a requeue")
            continue
        blocked = blocking(windows, job.reservation, now, job.time_limit_s)
        held = sorted(n for n in job.nodes if n in blocked)
        if held and not any(blocked[n].name in waited_for for n in held):
            window = blocked[held[0]]
            opens = ("now" if window.active or window.start_at is None or window.start_at <= now else
                     time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(window.start_at)))
            out[job.job_id] = (f"reservation {window.name} on {','.join(held)} (from {opens}) would keep it "
                               "pending after a requeue: kept where it is")
    return out


def _same_reason(seen: str, ours: str) -> bool:
    """Slurm shows a drain reason as it was set, less repeated blanks, cut at 200 characters (cli_backend)."""
    a, b = " ".join(seen.split()), " ".join(ours.split())[:200]
    return bool(a) and (a == b or a.startswith(b) or b.startswith(a))


def without_kept_jobs(problem: AllocationProblem, kept: Mapping[int, Job]) -> AllocationProblem:
    """`problem` without the jobs kept in place, their nodes' capacity less what they use there."""
    if not kept:
        return problem
    used: dict[str, Resources] = {}
    for job in kept.values():
        for name in job.nodes:
            used[name] = used.get(name, Resources()) + job.uses_per_node
    nodes = tuple(n if n.name not in used else
                  NodeCapacity(n.name, max(n.gpus - used[n.name].gpus, 0), max(n.cpus - used[n.name].cpus, 0),
                               max(n.mem_mb - used[n.name].mem_mb, 0))
                  for n in problem.nodes)
    keys = {str(j) for j in kept}
    return dataclasses.replace(problem, jobs=tuple(r for r in problem.jobs if r.key not in keys), nodes=nodes)


def with_kept_jobs(allocation: Allocation, kept: Mapping[int, Job], why: Mapping[int, str]) -> Allocation:
    """`allocation` with each kept job at its current GPUs on its current nodes."""
    if not kept:
        return allocation
    gpus = dict(allocation.gpus)
    placement = dict(allocation.placement)
    decisions = list(allocation.decisions)
    for job_id, job in sorted(kept.items()):
        gpus[str(job_id)] = job.gpus
        placement[str(job_id)] = {n: job.gpus_per_node for n in job.nodes}
        decisions.append(JobDecision(str(job_id), job.gpus, job.gpus, f"kept where it runs: {why.get(job_id, '')}",
                                     "pinned"))
    return dataclasses.replace(allocation, gpus=gpus, placement=placement, decisions=tuple(decisions))


class Reconciler:
    """Observe -> requests -> solve -> plans -> act; a missed event is corrected the next cycle."""

    def __init__(self, backend: Backend, journal: Journal, config: ControllerConfig = ControllerConfig(),
                 *, clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 protocol: RequeueProtocol | None = None, requests: RequestSource | None = None,
                 allocator: Allocator | None = None) -> None:
        self.backend = backend
        self.journal = journal
        self.config = config
        self.protocol = protocol or RequeueProtocol(backend, journal, config.protocol, clock=clock, sleep=sleep)
        self.requests = requests if requests is not None else default_request_source(
            config.request_settings(), sizes=journal)
        # On a large cluster a node event between two full solves is answered by the warm path
        # (allocate/repair.py); small clusters, the simulator's among them, always get the full solve.
        if allocator is None:
            from slurm_elastic.allocate.repair import RepairingSolver   # HiGHS loads only where a solve runs

            allocator = RepairingSolver(clock=clock, full=solve)
        self.allocator = allocator
        self._clock = clock
        self._sleep = sleep
        self._available: frozenset[str] | None = None
        self._reported_malformed: set[int] = set()
        self._said_no_reservations = False
        self._last_solved: tuple[AllocationProblem | None, Allocation | None] = (None, None)
        self._neutral: Mapping[str, Mapping[str, int]] = {}   # the last neutral solve's places (allocate/users.py)
        self._said: dict[int, str] = {}
        self.peer_losses = PeerLossReader(clock=clock)
        self.reviver = Reviver(backend, journal)
        self.job_dirs = JobDirGuard()
        self._can_exclude = isinstance(backend, NodeExcludingBackend)
        if not self._can_exclude:
            log.info("the %s backend cannot exclude nodes from a job: jobs' peer-lost reports are not acted on",
                     getattr(backend, "name", type(backend).__name__))

    def cycle(self, *, dry_run: bool = False, job_ids: frozenset[int] | None = None) -> CycleReport:
        """One cycle; `job_ids` limits the plans acted on (the solve still sees every elastic job)."""
        t0 = time.monotonic()
        state = self.backend.snapshot()
        self.reviver.observe(state, self._clock())
        recovered: list[Outcome] = []
        if not dry_run and self.journal.open_plans():
            recovered = self.protocol.recover(state)
            state = self.backend.snapshot()
        revived: tuple[int, ...] = ()
        if not dry_run and self.config.user is None:
            self.job_dirs.guard(state, self._clock())
        if not dry_run:
            revived = self.reviver.revive(scope_state(state, self.config.user)[0], self._clock())
            if revived:
                state = self.backend.snapshot()
        state = self._confirm_nodes(state)
        available = frozenset(n.name for n in state.nodes if n.available)
        lost = gained = ()
        if self._available is not None:
            lost = tuple(sorted(self._available - available))
            gained = tuple(sorted(available - self._available))
            for name in lost:
                log.warning("node %s lost", name)
            for name in gained:
                log.info("node %s gained", name)
        if not dry_run:
            self._available = available

        decision = self.decide(state, self._clock(), job_ids=job_ids)
        if not dry_run:
            self._say_waits(decision.waits)
            for job_id, why in decision.bad_geometry.items():
                if any(p.job_id == job_id for p in decision.plans):
                    log.warning("job %d: %s", job_id, why)
        plans = decision.plans
        for plan in plans:   # the holds of queued jobs kept back: one line for all (each in the journal)
            log.log(plan.log_level, "%s%s", "(dry run) " if dry_run else "",
                    plan.describe())
        kept = [str(p.job_id) for p in plans if p.keeps_queued]
        if kept:
            log.info("%squeued jobs %s kept back while this cycle's resized jobs start", "(dry run) " if dry_run
                     else "", ",".join(kept))
        outcomes: list[Outcome] = []
        if plans and not dry_run:
            losses = decision.peer_losses
            jobs = {j.job_id: j for j in decision.scoped.jobs}

            def launcher_stopped(job_id: int) -> str:
                if job_id in losses:
                    return losses[job_id].launcher_stopped()
                job = jobs.get(job_id)   # a later plan of an incarnation whose ranks were kept
                return KEPT if job is not None and self.peer_losses.srun_left_running(job) else ""
            outcomes = self.protocol.execute(plans, decision.scoped, launcher_stopped=launcher_stopped)
        for outcome in outcomes:
            loss = decision.peer_losses.get(outcome.job_id)
            if loss is not None and any(p.job_id == outcome.job_id and p.peer_lost for p in plans):
                for name, at in loss.marks().items():
                    self.journal.mark(outcome.plan_id, name, at)
        drained = self._drain_lost(plans, outcomes) if not dry_run else ()
        resumed = self._expire_drains(state) if not dry_run else ()
        elastic = scope_state(state, self.config.user)[0].elastic_jobs   # with those whose plan is still open
        spoken_of = {j.job_id for j in elastic}
        total = sum(n.gpus for n in state.nodes if n.available)
        used = sum(n.gpus_alloc for n in state.nodes if n.available)
        report = CycleReport(
            taken_at=state.taken_at, dry_run=dry_run, plans=plans, outcomes=tuple(outcomes),
            recovered=tuple(recovered), allocation=decision.allocation, problem=decision.problem,
            pinned=decision.pinned, malformed=decision.malformed, nodes_lost=lost, nodes_gained=gained,
            job_states={j.job_id: j.state.value for j in elastic},
            current_gpus={j.job_id: j.gpus for j in elastic}, waits=decision.waits,
            peer_losses=decision.peer_losses, drained=drained, resumed=resumed, revived=revived,
            gpus_total=total, gpus_elastic=sum(j.gpus for j in elastic if j.state is JobState.RUNNING),
            gpus_free=max(total - used, 0), cycle_s=time.monotonic() - t0, rigid=decision.rigid,
            owners={j.job_id: j.user for j in state.jobs if j.job_id in decision.waits or j.job_id in spoken_of})
        return report

    def decide(self, state: ClusterState, now: float, *, job_ids: frozenset[int] | None = None) -> Decision:
        """The decision step alone: `state` at time `now` in, the plans out (nothing is touched).

        Scope (user mode, held and malformed jobs), hysteresis and the restart
        budget (from the journal), the request source and the allocator are all
        applied, exactly as in `cycle()`.
        """
        scoped, malformed = scope_state(state, self.config.user)
        # A job with a plan still open (one that waits across cycles for Slurm, or, in a dry run, the
        # daemon's plan under way) is that plan's: it counts as usage of what it holds, and gets no
        # other plan until that one ends (seen: a plan waiting for Slurm's own requeue was opened again
        # in every cycle, and the duplicates requeued the job's next incarnation).
        open_plans = {r.job_id: r for r in self.journal.open_plans()}
        scoped = dataclasses.replace(scoped, jobs=tuple(  # type: ignore[arg-type]
            dataclasses.replace(j, spec=None) if j.job_id in open_plans and j.spec is not None else j
            for j in scoped.jobs))
        for job_id, err in malformed.items():
            if job_id not in self._reported_malformed:
                log.error("job %d: comment claims an elastic spec but it is malformed (%s); never touched",
                          job_id, err)
                self._reported_malformed.add(job_id)
        # A job whose ranks reported a lost node restarts now without it, past hysteresis and budget:
        # its incarnation is over (the survivors committed and exited).
        losses = self.peer_losses.losses(scoped) if self._can_exclude else {}
        acting = ready(losses, now, self.config.protocol.ack_timeout_s)
        windows = self._reservation_windows(scoped)
        keeps = _read_once(keeps_ranks)    # the rigid reservation and the in-place swap ask the same jobs
        rigid = reserve_for_rigid(scoped, capacity_from_state(scoped), self.config.rigid, windows, keeps,
                                  planned=frozenset(open_plans), submitted=self._submitted_gpus)
        # GPUs going back to a rigid job are above the rules among elastic jobs (hysteresis, the restart
        # budget, measure first, the share floor): kept by them, one job held its size and the other
        # went back to the queue though both minimums fitted beside the rigid job (seen live).
        yielding = any(r.gpus_reclaimed for r in rigid.reserved)
        # A job that reported a lost node is asked for as if it held only its surviving nodes: the rules
        # that keep a running job at its size must not hold it to GPUs it has lost.
        lost = {job_id: frozenset(loss.lost_nodes) for job_id, loss in acting.items()}
        decided = self._requests(holding_only(scoped, lost), now, yielding)
        # Only a job whose ranks go on in their processes has that path, and not one the plan relaunches
        # whatever the solve says (its ranks reported a lost node, or a node of its is unavailable).
        requests = with_in_place(decided.jobs, scoped, lambda j: j.job_id not in acting
                                 and not lost_node(j, scoped) and keeps(j))
        if yielding and self.config.rigid.protect_minimum:
            # Protected minimums: the solver must not meet the rigid job's claim by sending one running
            # job back to the queue (one restart) where shrinking two to their minimums fits (seen live).
            running = {str(j.job_id) for j in scoped.elastic_jobs if j.state is JobState.RUNNING and not j.held}
            requests = tuple(dataclasses.replace(r, must_run=True) if r.key in running else r for r in requests)
        stuck = decided.bad_geometry
        pinned, pins = ({}, {}) if yielding else self._pins(scoped, now, frozenset(stuck) | frozenset(acting))
        # A job we requeued ourselves may still read BeginTime for a moment after its release; after
        # `recent_plan_s` a pending job with that reason is kicked again (StartTime=now), whoever requeued it.
        since = now - self.config.recent_plan_s
        handled = {j.job_id: r for j in scoped.elastic_jobs if j.state is JobState.PENDING
                   and (r := self.journal.restarts_after_last_plan(j.job_id, since)) is not None}
        hit = frozenset(j.job_id for j in scoped.elastic_jobs
                        if (requeued_by_slurm(j) and handled.get(j.job_id) != j.restarts) or lost_node(j, scoped)
                        or j.job_id in stuck or j.job_id in acting)
        policy = self.config.policy
        capacity = without_reported_losses(rigid.capacity, scoped, acting)
        # Slurm's reservation windows are read against the time of Slurm's own state
        for job_id, why in outside_windows(scoped, windows, scoped.taken_at, lost=frozenset(acting)).items():
            pinned[job_id], pins[job_id] = why, next(j.gpus for j in scoped.elastic_jobs if j.job_id == job_id)
        requests = with_reservations(with_partitions(requests, scoped), scoped, windows, scoped.taken_at)
        reported = self.journal.lost_nodes(j.job_id for j in scoped.elastic_jobs)
        lost_now = {j: still_lost(r, scoped) for j, r in reported.items()}
        requests = away_from_lost_nodes(requests, scoped, lost_now,
                                        back={j: frozenset(r) - lost_now[j] for j, r in reported.items()})
        requests = with_neutral_places(requests, self._neutral)
        problem = pin_jobs(AllocationProblem(requests, capacity, policy), pins, hit)
        # A pinned job stays where it is: its current placement is always an answer for it, even one
        # the shape rule would not choose now (a spanning job whose nodes gained or lost other users'
        # jobs), so a pin can never turn into "no room". The others are solved around it.
        kept = {j.job_id: j for j in scoped.elastic_jobs if j.job_id in pins}
        solved = without_kept_jobs(problem, kept)
        if solved == self._last_solved[0] and self._last_solved[1] is not None:
            allocation = self._last_solved[1]       # the same problem as last cycle: the same answer
        else:
            with native_stdout_silenced():
                allocation = self.allocator(solved)
            self._last_solved = (solved, allocation)
            self._neutral = allocation.neutral
        allocation = with_kept_jobs(allocation, kept, pinned)
        allocation = with_basis(allocation, decided.basis)
        node_sizes = {n.gpus for n in scoped.nodes}
        swapped: dict[str, str] = {}
        if windows is not None:   # so that a shrink can be in place; never a node an advance reservation names
            allocation, swapped = keep_first_nodes(scoped, allocation, keeps, fixed=frozenset(
                n for w in windows.values() for n in w.nodes))
        if swapped:
            rigid = dataclasses.replace(rigid, reserved=tuple(
                dataclasses.replace(r, nodes=tuple(swapped.get(n, n) for n in r.nodes)) for r in rigid.reserved))
        given = frozenset(n for r in rigid.reserved for n in r.nodes)
        plans = make_plans(scoped, allocation,
                           lambda spec, g, placement: request_shape(spec, g, placement, node_sizes), job_ids=job_ids,
                           handled=handled, peer_lost={j: x.lost_nodes for j, x in acting.items()},
                           given_to_rigid=given)
        # Ranks that exited 87 on a bad geometry are gone: such a job's shrink is a requeue, never in place
        # (seen: kept in place, nothing ran on, and Slurm ended the job FAILED).
        plans = tuple(dataclasses.replace(p, keep=()) if p.job_id in stuck and p.keep else p for p in plans)
        waits = self._waits(scoped, allocation, plans, pinned, stuck, decided.waits, now)
        for job_id, record in open_plans.items():
            waits[job_id] = self._open_plan_wait(record, now)
        for job_id, lost in lost_now.items():
            if lost and waits.get(job_id, "").startswith("stays at"):
                waits[job_id] += "; kept off " + ", ".join(readmission(reported[job_id], scoped).values())
        for job_id, loss in losses.items():
            if job_id not in acting:
                left = max(self.config.protocol.ack_timeout_s - (now - loss.seen_at), 0.0)
                waits[job_id] = (f"{loss.describe()}: waiting for its just-in-time commit "
                                 f"(restarted without {','.join(loss.lost_nodes)} in {left:.0f}s at the latest)")
        for reservation in rigid.reserved:
            if reservation.gpus_reclaimed:
                waits[reservation.job_id] = reservation.describe()
        for job_id, why in rigid.waiting:
            waits[job_id] = f"rigid job {job_id} waits: {why}"
        return Decision(now, plans, problem, allocation, scoped, pinned, malformed, waits, losses, stuck, rigid)

    def _submitted_gpus(self, job: Job) -> int:
        """The GPUs a job was submitted at: its size before the controller's first plan for it, else its size
        now (Slurm itself never resizes a job)."""
        # A plan from before its submission was for an earlier job with its id (a minute for the clocks' skew)
        since = job.submit_time - 60.0 if job.submit_time is not None else 0.0
        first = self.journal.first_size(job.job_id, since=since)
        return first if first is not None else job.gpus

    def _requests(self, state: ClusterState, now: float, yielding: bool = False) -> Requests:
        """The request source's requests; when the source itself fails (a source that does not isolate
        its jobs), every job is decided with the default model this cycle, and the cycle goes on."""
        try:
            if yielding:
                return self.requests.requests(state, now, self.config.policy, yielding=True)
            return self.requests.requests(state, now, self.config.policy)
        except Exception:
            log.exception("the request source failed; every job is decided with the default model this cycle")
            return Requests(tuple(job_request(j) for j in state.elastic_jobs))

    def _waits(self, state: ClusterState, allocation: Allocation, plans: tuple[Plan, ...],
               pinned: Mapping[int, str], stuck: Mapping[int, str], measuring: Mapping[int, str],
               now: float) -> dict[int, str]:
        """Per elastic job, why it is not being resized now (absent: it is at its target, or being resized).
        A queued job only kept back while others start is not being resized: its reason stays its own."""
        planned = {p.job_id for p in plans if not p.keeps_queued}
        node_gpus = [n.gpus for n in state.nodes if n.available]
        decided = {d.key: d for d in allocation.decisions}
        out: dict[int, str] = {}
        for job in state.elastic_jobs:
            spec = job.spec
            assert spec is not None
            target = allocation.gpus.get(str(job.job_id))
            if job.job_id in planned:
                continue
            elif job.job_id in stuck:
                out[job.job_id] = stuck[job.job_id] + (" (no valid size fits now)" if not target else "")
            elif job.job_id in pinned:
                out[job.job_id] = pinned[job.job_id]
            elif job.job_id in measuring:
                out[job.job_id] = measuring[job.job_id]
            elif job.state is JobState.PENDING and not job.held and not target:
                never = never_placeable(spec, node_gpus, self.config.policy.whole_nodes_when_spanning)
                out[job.job_id] = (f"not placeable: {never}" if never else
                                   f"not placeable: its minimum of {spec.min_gpus} GPUs does not fit beside "
                                   f"the others now (Slurm: {job.reason or 'pending'})")
            elif job.state is JobState.PENDING and not job.held:
                out[job.job_id] = f"waiting for Slurm to start it at {target} GPUs (Slurm: {job.reason or 'pending'})"
            elif (job.state is JobState.RUNNING and not job.held and target == job.gpus < spec.max_gpus
                  and (d := decided.get(str(job.job_id))) is not None):
                # The solve's own reason a running job below its max is not grown (said once per size:
                # the text before " (" is what the log compares); at the largest count its request allows,
                # the request rule that stopped the counts there.
                reason = d.reason.removeprefix(f"{d.cause}: ")
                if d.cause == "max":
                    capped = [note for note in allocation.basis.get(str(job.job_id), "").split("; ")
                              if note.endswith(CAPPING_RULES)]
                    out[job.job_id] = f"stays at {job.gpus} GPUs (largest allowed): {'; '.join(capped) or reason}"
                else:
                    out[job.job_id] = f"stays at {job.gpus} GPUs ({d.cause}): {reason}"
        return out

    def _open_plan_wait(self, record: PlanRecord, now: float) -> str:
        """What a job with an open plan waits for: its checkpoint ACK, or (a plan taken up again by each cycle's
        recovery) what its last step said it waits for."""
        what = f"plan {record.plan_id}, {record.plan.from_gpus}->{record.plan.to_gpus} GPUs, step {record.step}"
        if record.step in ("open", "signal", "ack"):
            left = max(self.config.protocol.ack_timeout_s - (now - record.created_at), 0.0)
            return f"waiting for its checkpoint ACK ({what}; requeued anyway in {left:.0f}s)"
        said = [note for step, _, note in self.journal.steps(record.plan_id) if step == record.step and note]
        return f"{said[-1]} ({what})" if said else f"being resized ({what})"

    def _say_waits(self, waits: Mapping[int, str]) -> None:
        """Log each job's reason when it changes (the daemon's and the watch's log), not every cycle: the text
        before " (", its seconds aside (a countdown is the same reason)."""
        def gist(why: str) -> str:
            return _SECONDS.sub("#s", why.split(" (")[0])
        for job_id, why in waits.items():
            if self._said.get(job_id) != gist(why):
                log.info("job %d: not resized now: %s", job_id, why)
        self._said = {j: gist(w) for j, w in waits.items()}

    def record_applied(self, decision: Decision) -> None:
        """Journal a decision's plans as carried out at its time, by someone else (another simulator).

        Hysteresis and the restart budget then see them, as they see the plans `cycle()` carries out.
        """
        for plan in decision.plans:
            job = decision.scoped.job(plan.job_id)
            plan_id = self.journal.open_plan(plan, restarts=job.restarts, now=decision.taken_at)
            self.journal.finish(plan_id, "done", "applied outside the protocol", now=decision.taken_at)

    def _drain_lost(self, plans: tuple[Plan, ...], outcomes: list[Outcome]) -> tuple[str, ...]:
        """--drain-on-peer-loss (admin mode only): drain the nodes a finished peer-loss plan excluded.

        A job's word is its user's: each user's reports drain at most DRAINS_PER_USER_PER_HOUR nodes
        an hour (journaled), and only nodes the job ran on (checked when the report was read) where no
        other job runs when the drain would be made (Slurm reads afresh: the plan's requeue took seconds,
        and another user's job started there meanwhile was then moved off the drained node).
        Draining stops new jobs there; the ones running go on.
        """
        if not self.config.drain_on_peer_loss or self.config.user is not None:
            return ()
        done = {o.plan_id for o in outcomes if o.status == DONE}
        by_job = {o.job_id: o.plan_id for o in outcomes}
        drained: list[str] = []
        now = self._clock()
        running: dict[str, set[int]] | None = None
        for plan in plans:
            if not plan.peer_lost or by_job.get(plan.job_id) not in done:
                continue
            if running is None:
                running = {}
                for job in self.backend.snapshot().jobs:
                    if job.state.active:
                        for name in job.nodes:
                            running.setdefault(name, set()).add(job.job_id)
            for node in plan.exclude:
                others = sorted(running.get(node, set()) - {plan.job_id})
                if others:
                    log.warning("job %d: not draining %s on its report: job%s %s run%s there now", plan.job_id,
                                node, "s" if len(others) > 1 else "", ",".join(map(str, others)),
                                "" if len(others) > 1 else "s")
                    continue
                if self.journal.drains_since(plan.user, now - HOUR_S) >= DRAINS_PER_USER_PER_HOUR:
                    log.warning("job %d: not draining %s: %s's jobs drained %d nodes in the last hour already",
                                plan.job_id, node, plan.user, DRAINS_PER_USER_PER_HOUR)
                    break
                reason = f"slurm-elastic: job {plan.job_id} ({plan.user}) reported its ranks here lost"
                try:
                    self.backend.drain(node, reason)  # type: ignore[attr-defined]
                except SlurmError as exc:
                    log.error("job %d: cannot drain %s: %s", plan.job_id, node, exc)
                    continue
                self.journal.record_drain(node, user=plan.user, job_id=plan.job_id, reason=reason,
                                          until=now + self.config.drain_expiry_s, now=now)
                log.warning("drained %s: %s", node, reason)
                drained.append(node)
        return tuple(drained)

    def _expire_drains(self, state: ClusterState) -> tuple[str, ...]:
        """Resume each node drained on a job's report once its `drain_expiry_s` is over (admin mode), so
        one user's false reports cannot keep nodes out for longer. A node whose drain is no longer ours
        (resumed by hand, drained again with another reason) is left as it is; the drain ends either way."""
        if self.config.user is not None or not self._can_exclude:
            return ()
        now = self._clock()
        nodes = {n.name: n for n in state.nodes}
        resumed: list[str] = []
        for drain in self.journal.drains():
            if drain.until > now:
                continue
            node = nodes.get(drain.node)
            if node is None or NodeFlag.DRAIN not in node.flags or not _same_reason(node.reason, drain.reason):
                self.journal.end_drain(drain.drain_id, "expired; no longer drained by us, left as it is", now)
                log.info("drain of %s on job %d's report expired; the node is no longer drained by us: left as it is",
                         drain.node, drain.job_id)
                continue
            try:
                self.backend.resume(drain.node)  # type: ignore[attr-defined]
            except SlurmError as exc:
                log.error("cannot resume %s after its drain expired (tried again next cycle): %s", drain.node, exc)
                continue
            self.journal.end_drain(drain.drain_id, "expired; resumed", now)
            log.warning("resumed %s: its drain on job %d's report (%s) expired after %gs", drain.node, drain.job_id,
                        drain.user, drain.until - drain.at)
            resumed.append(drain.node)
        return tuple(resumed)

    # -- where jobs may run -------------------------------------------------------------------
    def _reservation_windows(self, state: ClusterState) -> dict[str, AdvanceReservation] | None:
        """The advance reservations (every cycle: one to come keeps jobs off its nodes, whether or not a job
        names it); None: they could not be read."""
        if not isinstance(self.backend, ReservationReader):
            if not self._said_no_reservations:
                log.warning("the %s backend cannot read reservations: jobs in one are kept at their size, and "
                            "reservations to come are not seen", type(self.backend).__name__)
                self._said_no_reservations = True
            return None if any(j.reservation and not j.state.finished for j in state.jobs) else {}
        try:
            return {r.name: r for r in self.backend.reservations()}
        except SlurmError as exc:
            log.warning("cannot read the reservations (%s): jobs in one are kept at their size this cycle", exc)
            return None

    # -- hysteresis and the restart budget ----------------------------------------------------
    def _pins(self, state: ClusterState, now: float,
              stuck: frozenset[int] = frozenset()) -> tuple[dict[int, str], dict[int, int]]:
        why: dict[int, str] = {}
        pins: dict[int, int] = {}
        hold = self.config.min_resize_interval_s
        for job in state.elastic_jobs:
            if (job.state is not JobState.RUNNING or job.held or lost_node(job, state) or requeued_by_slurm(job)
                    or job.job_id in stuck):
                continue  # pending jobs cost no restart; a lost node or a size its batch cannot use always allows one
            last = self.journal.last_change_at(job.job_id)
            # A job that just started (or restarted) is held like one just resized: its start-up is paid.
            started = job.start_time if job.start_time is not None and job.start_time <= now else None
            since = max((t for t in (last, started) if t is not None), default=None)
            if since is not None and now - since < hold:
                what = "resized" if since == last else "started"
                why[job.job_id] = (f"hysteresis: {what} {now - since:.0f}s ago, {hold - (now - since):.0f}s left "
                                   f"(hysteresis {hold:g}s)")
            elif self.journal.restarts_since(job.job_id, now - HOUR_S) >= self.config.restart_budget_per_hour:
                why[job.job_id] = (f"restart budget of {self.config.restart_budget_per_hour}/hour spent "
                                   f"(next restart allowed in {self._budget_left(job.job_id, now):.0f}s)")
            else:
                continue
            pins[job.job_id] = job.gpus
            log.debug("job %d: kept at %d GPUs: %s", job.job_id, job.gpus, why[job.job_id])
        return why, pins

    def _budget_left(self, job_id: int, now: float) -> float:
        """Seconds until the oldest restart in the budget's hour leaves it."""
        budget = self.config.restart_budget_per_hour
        times = sorted(r.created_at for r in self.journal.plans(job_id, limit=max(budget, 1) * 4)
                       if r.plan.entry is PlanEntry.RUNNING and r.created_at >= now - HOUR_S
                       and r.status in (DONE, OPEN))
        if budget <= 0 or len(times) < budget:
            return 0.0 if budget > 0 else HOUR_S
        return max(times[-budget] + HOUR_S - now, 0.0)

    def _confirm_nodes(self, state: ClusterState) -> ClusterState:
        """A node that just became unavailable is read again after a moment before anyone is resized.

        Slurm 24.11 was seen marking a healthy busy node 'not responding' for under a second.
        """
        if self._available is None or self.config.node_confirm_s <= 0:
            return state
        lost = [n for n in state.nodes if n.name in self._available and not n.available]
        # DOWN, DRAIN and the like are decisions; only a bare "not responding" may be a blip.
        if not any(n.state is not NodeState.DOWN and n.flags & UNAVAILABLE_FLAGS <= {NodeFlag.NOT_RESPONDING}
                   for n in lost):
            return state
        self._sleep(self.config.node_confirm_s)
        state = self.backend.snapshot()
        self.reviver.observe(state, self._clock())
        return state
