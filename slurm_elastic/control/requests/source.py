"""The request source: each cycle, every elastic job's Measurement (measuring.py) run through the request
rules (rules.py) into a JobRequest, returned as one Requests record.

Every controller (daemon, `admin rebalance`, user-mode `watch`, the simulator) gets its source from
`default_request_source`, so they decide alike. The source keeps the memory the rules need between
cycles: when each job started waiting, the size it asked for, whether the controller took it to zero.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Protocol

from slurm_elastic.allocate.from_state import job_request
from slurm_elastic.allocate.problem import Allocation, JobRequest, Policy
from slurm_elastic.cluster.model import ClusterState, Job, JobState
from slurm_elastic.control.requests import progress
from slurm_elastic.control.requests.measuring import JobFiles, SizesRan
from slurm_elastic.control.requests.rules import RULES, JobContext, Rule, apply_rules
from slurm_elastic.control.requests.settings import RequestSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Requests:
    """What a request source decided for one state: the requests, and why."""

    jobs: tuple[JobRequest, ...] = ()
    basis: Mapping[str, str] = field(default_factory=dict)        # job key -> what its request was decided from
    waits: Mapping[int, str] = field(default_factory=dict)        # job id -> why it is kept at its size now
    # job id -> why its ranks cannot run at its current size (it wrote geometry.json and exited 87): such a
    # job is re-planned at once, whatever hysteresis and the restart budget say
    bad_geometry: Mapping[int, str] = field(default_factory=dict)

    def __iter__(self):
        return iter(self.jobs)

    def __len__(self) -> int:
        return len(self.jobs)


class RequestSource(Protocol):
    """Turns the elastic jobs of a (scoped) state into JobRequests, and says what each was built from."""

    def requests(self, state: ClusterState, now: float, policy: Policy, yielding: bool = False) -> Requests:
        """`yielding`: elastic jobs give GPUs back to a rigid job this cycle; rules that keep a running
        job at its size (measure first, the share floor) do not hold against that."""
        ...


class MeasuredRequests:
    """The default request source: what each job measured (measuring.py), decided by the rules (rules.py)."""

    def __init__(self, settings: RequestSettings = RequestSettings(), rules: tuple[Rule, ...] = RULES,
                 sizes: SizesRan | None = None) -> None:
        self.settings = settings
        self.rules = rules
        self.files = JobFiles(settings, sizes)
        self._waiting_since: dict[int, float] = {}
        self._asked: dict[int, int] = {}          # job id -> GPUs it was submitted at (first seen pending)

    def requests(self, state: ClusterState, now: float, policy: Policy, yielding: bool = False) -> Requests:
        node_sizes = frozenset(n.gpus for n in state.nodes if n.gpus > 0)
        out = []
        basis: dict[str, str] = {}
        waits: dict[int, str] = {}
        bad: dict[int, str] = {}
        own = own_weights(state)
        shares = fair_shares(state)
        self.files.begin_cycle(state)
        for job in state.elastic_jobs:
            self._remember(job, now)
            try:
                ctx = self._decide(job, now, policy, node_sizes, shares.get(job.job_id, 0), own[job.job_id],
                                   yielding)
                req = dataclasses.replace(
                    job_request(job, restart_cost_s=ctx.restart_charge_s, in_place_cost_s=ctx.in_place_charge_s,
                                charge_weight=ctx.charge_weight,
                                throughput=ctx.model, weight=ctx.weight,
                                own_weight=ctx.own_weight, allowed_gpus=ctx.allowed, must_run=ctx.must_run),
                    commitment=ctx.commitment)
                why = "; ".join(ctx.notes)
                if ctx.wait:
                    waits[job.job_id] = ctx.wait
                if ctx.bad_geometry:
                    bad[job.job_id] = ctx.bad_geometry
            except Exception as exc:
                # The job's own files are its user's input: whatever reading them raises (deep JSON, a
                # defect a crafted file finds), only this job falls back to the default model.
                req = job_request(job, own_weight=own[job.job_id])
                why = f"default model: its files could not be used ({exc!r})"
                self.files.report(job, "its job directory", f"raised {type(exc).__name__} while read ({exc!r:.200})")
            out.append(req)
            basis[req.key] = why
        return Requests(tuple(out), basis, waits, bad)

    def _remember(self, job: Job, now: float) -> None:
        """What the rules need from earlier cycles: the size it asked for and since when it waits."""
        running = job.state is JobState.RUNNING
        if job.job_id not in self._asked and job.state is JobState.PENDING and job.gpus > 0 and job.spec:
            # The size it was submitted at, seen before any plan resized it (rules.ShareFloor).
            self._asked[job.job_id] = min(max(job.gpus, job.spec.min_gpus), job.spec.max_gpus)
        if running:
            self._waiting_since.pop(job.job_id, None)
        elif not job.held:
            self._waiting_since.setdefault(job.job_id, now if job.submit_time is None else
                                           min(now, job.submit_time))

    def _decide(self, job: Job, now: float, policy: Policy, node_sizes: frozenset[int], share: int,
                own_weight: float = 1.0, yielding: bool = False) -> JobContext:
        measured = self.files.measure(job)
        ctx = JobContext(job=job, now=now, policy=policy, settings=self.settings, measured=measured,
                         node_sizes=node_sizes, share=share, own_weight=own_weight,
                         waiting_s=now - self._waiting_since.get(job.job_id, now), yielding=yielding,
                         submitted=self._asked.get(job.job_id))
        return apply_rules(ctx, self.rules)


class ProgressRequests(MeasuredRequests):
    """The progress objective's request source (settings.objective "progress"): the kept rules measure each
    job (progress.PROGRESS_RULES); then, across the jobs that want GPUs, heSRPT rank weights on remaining
    work, the stay fraction of the restart and the finish-time-fairness floor (progress.py)."""

    def __init__(self, settings: RequestSettings = RequestSettings(),
                 rules: tuple[Rule, ...] = progress.PROGRESS_RULES, sizes: SizesRan | None = None) -> None:
        super().__init__(settings, rules, sizes)
        self._attained: dict[int, float] = {}                    # job id -> 1-GPU-seconds of progress credited
        self._seen: dict[int, tuple[float, float]] = {}          # job id -> (when, S at the size Slurm ran it)
        self._ran: set[int] = set()

    def requests(self, state: ClusterState, now: float, policy: Policy, yielding: bool = False) -> Requests:
        node_sizes = frozenset(n.gpus for n in state.nodes if n.gpus > 0)
        own = own_weights(state)
        shares = fair_shares(state)
        s = self.settings
        built: list[tuple[Job, JobContext, progress.ProgressTerms]] = []
        out: dict[int, JobRequest] = {}
        basis: dict[str, str] = {}
        waits: dict[int, str] = {}
        bad: dict[int, str] = {}
        self.files.begin_cycle(state)
        for job in state.elastic_jobs:
            self._remember(job, now)
            try:
                ctx = self._decide(job, now, policy, node_sizes, shares.get(job.job_id, 0), own[job.job_id],
                                   yielding)
                terms = progress.progress_terms(ctx, self._credit(job, now, ctx))
            except Exception as exc:
                # as MeasuredRequests: a job's files are its user's input; only this job gets the default
                out[job.job_id] = job_request(job, own_weight=own[job.job_id])
                basis[str(job.job_id)] = f"default model: its files could not be used ({exc!r})"
                self.files.report(job, "its job directory", f"raised {type(exc).__name__} while read ({exc!r:.200})")
                continue
            if ctx.wait:
                waits[job.job_id] = ctx.wait
            if ctx.bad_geometry:
                bad[job.job_id] = ctx.bad_geometry
            built.append((job, ctx, terms))
        wanting = [(job, ctx, t) for job, ctx, t in built if t.speedup and (
            job.state is JobState.RUNNING or (job.state is JobState.PENDING and not job.held))]
        p = progress.elasticity([(t, shares.get(job.job_id, 0)) for job, _, t in wanting])
        ranks = progress.hesrpt_weights({str(job.job_id): t.work_s for job, _, t in wanting}, p)
        m = len(wanting)
        rank_of = {k: r for r, k in enumerate(sorted(ranks, key=lambda k: (ranks[k], k)), start=1)}
        for job, ctx, t in built:
            key = str(job.job_id)
            omega = ranks.get(key, 1.0)
            values = tuple((g, ctx.own_weight * omega * v) for g, v in t.speedup if v > 0)
            pi = progress.stay_fraction(ctx.restart_s, s.hold_s, t.left_s)
            phi, overdue, floor_why = 0, 0.0, ""
            if not yielding and not ctx.bad_geometry and key in ranks:
                started = job.submit_time if job.submit_time is not None else self._waiting_since.get(job.job_id, now)
                phi, overdue, floor_why = progress.ftf_floor(
                    t, age_s=max(now - started, 0.0), attained_s=self._attained.get(job.job_id, 0.0),
                    fair=shares.get(job.job_id, 0), counts=[g for g, _ in t.speedup], hold_s=s.hold_s,
                    target=s.ftf_target, ever_ran=job.job_id in self._ran)
            req = job_request(job, restart_cost_s=ctx.restart_s, throughput=ctx.model, own_weight=ctx.own_weight,
                              allowed_gpus=ctx.allowed)
            out[job.job_id] = dataclasses.replace(req, values=values or None, stay_fraction=pi, floor_gpus=phi,
                                                  floor_priority=overdue)
            line = (f"rank {rank_of.get(key, 0)}/{m} (p {p:.1f}) omega {omega:.3g}; {t.why}"
                    f"{'' if t.trusted else ' [LAS]'}; S({job.gpus}) {t.at(job.gpus):.3g}; restart "
                    f"{ctx.restart_s:.0f}s, pi {pi:.3f}" + (f"; {floor_why}" if floor_why else ""))
            basis[key] = "; ".join(ctx.notes + (f"{line} [progress]",))
        jobs = tuple(out[j.job_id] for j in state.elastic_jobs if j.job_id in out)
        present = {j.job_id for j in state.elastic_jobs}
        for gone in [jid for jid in self._seen if jid not in present]:      # ended: nothing more to credit
            self._seen.pop(gone)
            self._attained.pop(gone, None)
        return Requests(jobs, basis, waits, bad)

    def _credit(self, job: Job, now: float, ctx: JobContext) -> float:
        """Attained service: 1-GPU-seconds of progress at the sizes Slurm ran the job at (LAS's measure; the
        job's files say nothing here but its own speed ratio, which is capped at the GPU count)."""
        jid = job.job_id
        last = self._seen.get(jid)
        if last is not None:
            self._attained[jid] = self._attained.get(jid, 0.0) + max(now - last[0], 0.0) * last[1]
        rate = 0.0
        if job.state is JobState.RUNNING and job.gpus > 0 and ctx.model is not None:
            self._ran.add(jid)
            curve = progress.speedup_curve(ctx.model, [job.gpus], ctx.nodes_for)
            rate = curve[0][1] if curve else float(job.gpus)
        self._seen[jid] = (now, rate)
        return self._attained.get(jid, 0.0)


def _wanting(state: ClusterState) -> list[Job]:
    """The elastic jobs that want GPUs: running, or pending and not held."""
    return [j for j in state.elastic_jobs if j.state is JobState.RUNNING or (j.state is JobState.PENDING and not j.held)]


def own_weights(state: ClusterState) -> dict[int, float]:
    """Job id -> its weight among its own user's jobs: its `--weight` / the mean `--weight` of that user's
    elastic jobs that want GPUs (of all the user's elastic jobs when none does).

    A user's jobs weigh as many as they are whatever `--weight` says: the weight a user writes moves GPUs
    among that user's own jobs, never from another user's (docs/security.md)."""
    def weight(job: Job) -> float:
        return job.spec.weight if job.spec else 1.0

    every: dict[str, list[float]] = {}
    wanting: dict[str, list[float]] = {}
    for job in state.elastic_jobs:
        every.setdefault(job.user, []).append(weight(job))
    for job in _wanting(state):
        wanting.setdefault(job.user, []).append(weight(job))
    return {job.job_id: weight(job) / statistics.mean(wanting.get(job.user) or every[job.user])
            for job in state.elastic_jobs}


def fair_shares(state: ClusterState) -> dict[int, int]:
    """Job id -> its fair share of the GPUs elastic work can use: those GPUs / the number of elastic jobs
    that want GPUs, rounded down.

    No weight enters it: the share floor it bounds is part of the equal-weight solve that fixes what each
    user's jobs hold (allocate/users.py), and a `--weight` in it moved GPUs between users (a job its user
    weighted near zero had no floor, and the equal-weight solve broke a tie against another user's job)."""
    usable = sum(n.gpus for n in state.nodes if n.available)
    usable -= sum(j.gpus for j in state.jobs if j.spec is None and j.state is JobState.RUNNING)
    wanting = _wanting(state)
    if usable <= 0 or not wanting:
        return {}
    return {j.job_id: int(usable / len(wanting) + 1e-9) for j in wanting}


def default_request_source(settings: RequestSettings | None = None, sizes: SizesRan | None = None) -> RequestSource:
    """The request source every controller uses unless told otherwise (one home for that choice): the rule
    chain, or the progress objective's source when `settings.objective` is "progress". `sizes`: where the
    sizes Slurm ran each job at are remembered (the controller's journal)."""
    settings = settings or RequestSettings()
    if settings.objective == "progress":
        return ProgressRequests(settings, sizes=sizes)
    return MeasuredRequests(settings, sizes=sizes)


def with_basis(allocation: Allocation, basis: Mapping[str, str]) -> Allocation:
    """The allocation carrying what each job's request was decided from (printed by `--explain`)."""
    return dataclasses.replace(allocation, basis=dict(basis))
