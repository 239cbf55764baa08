"""The requeue protocol: signal, wait for the checkpoint ACK, requeuehold, resize, release; and its recovery.

A plan for a job whose ranks reported a lost node (Plan.exclude) sends no signal and waits for no
ACK (its survivors already committed and exited); its hold first shrinks the running job to the
nodes it keeps, so the requeue does not wait for the dead node, and its resize excludes the lost
nodes for that job.

A shrink to whole nodes the job holds (Plan.keep) of a job whose batch script says its ranks go on
in their processes (keeps-ranks-J-R, jobfiles/names.py) is done in place: no signal, no ACK, no
requeue; the hold gives the other nodes up (Slurm SIGKILLs the ranks there) and the survivors commit
and re-form their group as after a lost node (train/regroup.py). Should Slurm refuse, or the word be
gone by then, the job is signalled at the hold and requeued as any other.

Every step looks at the jobs again first and abandons (journaled, with the reason) a plan whose
job is no longer what the plan assumed: a job its owner cancels during the ACK wait is never
requeued, resized or released.
"""

from __future__ import annotations

import logging
import os
import signal as _signal
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from slurm_elastic.cluster.backend import Backend, NodeExcludingBackend, PriorityKeepingBackend
from slurm_elastic.cluster.model import ClusterState, Job, JobState
from slurm_elastic.control.journal import ABANDONED, DONE, ROLLED_BACK, Journal, PlanRecord
from slurm_elastic.control.peer_loss import still_lost
from slurm_elastic.control.plan import Plan, PlanEntry, departed
from slurm_elastic.control.requests import owner_uid, read_job_geometry
from slurm_elastic.errors import ElasticError, SlurmError
from slurm_elastic import jobfiles as shim
from slurm_elastic.settings import ACK_TIMEOUT, CRASH_AFTER

log = logging.getLogger(__name__)

_STEPS = ("hold", "resize", "release")   # steps 3-5, after signal and ACK
IN_PLACE = shim.RELAUNCHES_IN_PLACE      # the job's batch script relaunches the ranks in place
KEPT = shim.RANKS_KEPT                   # its survivors went on in their processes (the srun still runs)
STOPPED = "stopped"                      # its batch script SIGKILLed the step's srun (jobfiles LauncherStopped)
WAITING = "waiting"                      # an Outcome whose plan stays open (see _NotYet)
IN_PLACE_NOTE = "shrunk in place (the lost nodes given up, the job kept running)"
KEPT_SHRINK_NOTE = "shrunk in place on its healthy nodes (its ranks kept)"
NOT_SIGNALLED_NOTE = "not sent: shrunk in place, its ranks go on in their processes"

IGNORED_SIGNAL_WAIT_S = 5.0
"""The ACK wait for a job that did not acknowledge its last signal: the whole timeout once, then this. The wait
holds the cycle, and every other plan of it, so a job that never answers (a script without the shim, or a
user who ignores the signal on purpose: an adversarial probe held every cycle it was planned in for 60 s)
costs only its own steps since its last periodic checkpoint."""

CRASH_ENV = CRASH_AFTER.env
"""Test hook: SIGKILL this process right after the named step (open, signal, ack, hold, resize, release)."""


@dataclass(frozen=True, slots=True)
class ProtocolSettings:
    signal: str = shim.DEFAULT_SIGNAL
    ack_timeout_s: float = ACK_TIMEOUT.default   # then proceed: the last periodic checkpoint is the resume point
    ack_poll_s: float = 0.2
    settle_timeout_s: float = 30.0   # a requeued job passes through COMPLETING before Slurm lets it be updated
    settle_poll_s: float = 0.25
    credential_gap_s: float = 1.05   # no release sooner after the requeue (see RequeueProtocol._credential_gap)
    observe_every_s: float = 2.0     # during the ACK wait, look at the jobs this often (a cancel ends the wait)
    launcher_wait_s: float = 3.0     # how long a peer-lost plan waits for the batch script's launcher-stopped word
    start_wait_s: float = 5.0        # how long the jobs a cycle leaves queued stay held while its resized jobs start


@dataclass(frozen=True, slots=True)
class Outcome:
    plan_id: int
    job_id: int
    status: str          # done | rolled_back | abandoned | waiting (open: a later cycle goes on with it)
    note: str = ""
    acked: bool | None = None

    def to_json(self) -> dict[str, object]:
        return {"plan_id": self.plan_id, "job_id": self.job_id, "status": self.status, "note": self.note,
                "acked": self.acked}


class RequeueProtocol:
    """Carries plans through the protocol; every step is journaled before it is taken and is idempotent."""

    def __init__(self, backend: Backend, journal: Journal, settings: ProtocolSettings = ProtocolSettings(),
                 *, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 crash_after: str | None = None, crash: Callable[[], None] | None = None,
                 may_act: Callable[[], str | None] | None = None) -> None:
        """`may_act` (user mode) says why this controller must not start on a job now (the admin
        daemon took over), or None; it is asked before the signal and before the hold."""
        self.backend = backend
        self.journal = journal
        self.settings = settings
        self._clock = clock
        self._sleep = sleep
        self._crash_after = crash_after if crash_after is not None else CRASH_AFTER.read()
        self._crash = crash or _sigkill_self
        self._requeued_at: dict[int, float] = {}
        self._held_queued: set[int] = set()       # plans that held a queued job (Slurm may have started it)
        self._old_srun_until: dict[int, float] = {}   # plan id -> when a lingering old srun has given up
        self._may_act = may_act
        self._launcher_stopped: Callable[[int], str] = lambda job_id: ""
        self._in_place: set[int] = set()              # plan ids shrunk in place: no requeue, no release
        self._geometry_exited: set[int] = set()       # plan ids whose ranks exited 87: no ACK to wait for
        self._kept_shrinks: set[int] = set()          # plan ids to shrink in place, their ranks kept (Plan.keep)
        self._slurm_requeues: dict[int, float] = {}   # plan id -> until when Slurm's own requeue is waited for
        self._priority: dict[int, int] = {}           # job id -> its Slurm priority when its plan opened
        self._keeps_priority = isinstance(backend, PriorityKeepingBackend)

    # -- the forward path ------------------------------------------------------------------
    def execute(self, plans: Sequence[Plan], state: ClusterState, *,
                launcher_stopped: Callable[[int], str] | None = None) -> list[Outcome]:
        """Run `plans` (all running jobs are signalled together, so their checkpoints overlap).

        `launcher_stopped(job id)` says what a job that reported a lost peer did with its old srun
        (control/peer_loss.py: "", "stopped", "in-place"): a stopped one is released without the
        KillWait wait; one that relaunches in place is shrunk in place when its survivors hold all
        the plan gives it."""
        self._launcher_stopped = launcher_stopped or (lambda job_id: "")
        records: list[PlanRecord] = []
        for plan in plans:
            job = state.job(plan.job_id)
            if job.priority and not job.held:
                self._priority[plan.job_id] = job.priority
            plan_id = self.journal.open_plan(plan, restarts=job.restarts)
            self._maybe_crash("open")
            records.append(self._record(plan_id))
        finished: dict[int, Outcome] = {}
        held: set[int] = set()      # plans whose hold step has been taken
        try:
            outcomes = self._carry(records, finished, held, state)
            for outcome in outcomes:   # a plan that ended without a release (in place, abandoned) keeps none
                if outcome.status != WAITING:
                    self._priority.pop(outcome.job_id, None)
            return outcomes
        except ElasticError:
            raise     # Slurm unreachable: the plans stay open and the next cycle's recovery finishes them
        except Exception:
            # A defect outside any one plan's steps: no job this cycle held stays held (each is
            # released now, its plan rolled back), then the error surfaces to the daemon's loop.
            for rec in records:
                if rec.plan_id in held and rec.plan_id not in finished:
                    try:
                        self._roll_back(rec, "the cycle ended early")
                    except Exception:
                        log.exception("job %d: plan %d: cannot release it; left to recovery", rec.job_id,
                                      rec.plan_id)
            raise

    def _carry(self, records: list[PlanRecord], finished: dict[int, Outcome], held: set[int],
               state: ClusterState) -> list[Outcome]:
        """Steps 1-5 for the opened `records` (see `execute`)."""
        # Queued jobs are held first: GPUs that a shrinking job frees below must not let Slurm start
        # one of them at its old size between our hold and our update.
        queued = [r for r in records if r.plan.entry is PlanEntry.PENDING]
        self._recheck(queued, finished, held, before="hold")
        for rec in queued:
            if rec.plan_id not in finished:
                outcome = self._step(rec, "hold", crash=True)
                if outcome is None:
                    held.add(rec.plan_id)
                else:
                    finished[rec.plan_id] = outcome
        running = [r for r in records if r.plan.entry is PlanEntry.RUNNING]
        self._recheck(running, finished, held, before="signal")
        running = [r for r in running if r.plan_id not in finished]
        for rec in running:
            if rec.plan.peer_lost:
                self.journal.record(rec.plan_id, "signal", "not sent: its ranks ended on losing a peer")
                continue
            if rec.plan.keep and keeps_ranks(_find(state, rec.job_id)):
                self._kept_shrinks.add(rec.plan_id)
                self.journal.record(rec.plan_id, "signal", NOT_SIGNALLED_NOTE)
                continue
            self.journal.record(rec.plan_id, "signal", self.settings.signal)
            try:
                self.backend.signal(rec.job_id, self.settings.signal)
                log.info("job %d: sent %s (plan %d)", rec.job_id, self.settings.signal, rec.plan_id)
            except SlurmError as exc:
                # A job that just ended or was requeued by Slurm cannot be signalled; the hold step sorts it out.
                log.warning("job %d: could not signal (%s); continuing", rec.job_id, exc)
            except Exception:
                log.exception("job %d: internal error signalling it (plan %d); continuing without its ACK",
                              rec.job_id, rec.plan_id)
            self._maybe_crash("signal")
        acked = self._wait_for_acks(running, state)
        for rec in running:
            note = "acked" if acked.get(rec.plan_id) else f"no ACK within {self.settings.ack_timeout_s:g}s"
            if rec.plan.peer_lost:
                note = f"none needed: {rec.plan.reason}"
            elif rec.plan_id in self._kept_shrinks:
                note = "none needed: its ranks commit as they go on"
            elif rec.plan_id in self._geometry_exited:
                note = f"none coming: its ranks exited {shim.GEOMETRY_EXIT_CODE} on a bad batch geometry"
            self.journal.record(rec.plan_id, "ack", note)
            if not acked.get(rec.plan_id):
                log.warning("job %d: %s; the last periodic checkpoint is the resume point", rec.job_id, note)
            self._maybe_crash("ack")
        self._recheck(running, finished, held, before="hold")
        # Steps 3-5 go phase by phase across all plans, not plan by plan: Slurm finishes the
        # requeues (and the credential gaps run out) side by side, so a cycle with many plans
        # costs about one plan's waits, and every shrink is in place before any job is released.
        for step in _STEPS:
            if step != "hold":
                self._recheck(records, finished, held, before=step)
            # Releases in the order their waits run out: one waiting out an old srun (KillWait) holds
            # back no job whose own gap is over. Jobs left queued go last, once the others have started.
            ordered = sorted(records, key=lambda r: (r.plan.leaves_queued, self._release_not_before(r.plan_id))) \
                if step == "release" else records
            released: list[PlanRecord] = []
            for rec in ordered:
                if rec.plan_id in finished or (step == "hold" and rec.plan.entry is PlanEntry.PENDING):
                    continue
                if step == "release" and rec.plan.leaves_queued and released:
                    self._wait_for_starts(released)
                    released = []
                outcome = self._step(rec, step, crash=True)
                if outcome is not None:
                    finished[rec.plan_id] = outcome
                elif step == "hold":
                    held.add(rec.plan_id)
                elif step == "release" and not rec.plan.leaves_queued:
                    released.append(rec)
        outcomes = []
        for rec in records:
            outcome = finished.get(rec.plan_id)
            if outcome is None:
                self.journal.finish(rec.plan_id, DONE)
                outcome = Outcome(rec.plan_id, rec.job_id, DONE)
            outcomes.append(Outcome(outcome.plan_id, outcome.job_id, outcome.status, outcome.note,
                                    acked.get(rec.plan_id) if rec.plan.entry is PlanEntry.RUNNING else None))
        return outcomes

    def _recheck(self, records: Sequence[PlanRecord], finished: dict[int, Outcome], held: set[int], *,
                 before: str) -> None:
        """Look at the jobs again before `before` and abandon every plan whose job moved on.

        One snapshot for all plans of the phase (a snapshot per plan would cost a 200-job cycle
        200 squeue calls); the gap between it and the step is one phase's Slurm calls.
        """
        live = [r for r in records if r.plan_id not in finished]
        if not live:
            return
        guard = self._may_act() if self._may_act is not None and before in ("signal", "hold") else None
        state = self._observe_settled(live, held)
        for rec in live:
            ours = rec.plan_id in held
            why = departed(rec.plan, _find(state, rec.job_id), restarts=rec.restarts, held_by_us=ours)
            if why is None and guard is not None and not ours:
                why = guard
            if why is not None:
                finished[rec.plan_id] = self._abandon(rec, why, f"before {before}")

    def _observe_settled(self, records: Sequence[PlanRecord], held: set[int]) -> ClusterState:
        """A snapshot in which no job we have not held yet is COMPLETING (cancelled, or requeued by Slurm:
        which one decides the plan), unless that takes longer than `settle_timeout_s`."""
        deadline = self._clock() + self.settings.settle_timeout_s
        while True:
            state = self.backend.snapshot()
            ending = [r.job_id for r in records if r.plan_id not in held
                      and (job := _find(state, r.job_id)) is not None and job.state is JobState.COMPLETING]
            if not ending or self._clock() >= deadline:
                return state
            log.debug("jobs %s are COMPLETING; looking again", ending)
            self._sleep(self.settings.settle_poll_s)

    def _abandon(self, rec: PlanRecord, why: str, when: str) -> Outcome:
        """Finish a plan whose job moved on, taking no step on it (journaled with the reason)."""
        note = f"{why} ({when})"
        log.warning("job %d: plan %d abandoned: %s", rec.job_id, rec.plan_id, note)
        self._clear_hold_of_started(rec)
        self.journal.finish(rec.plan_id, ABANDONED, note)
        return Outcome(rec.plan_id, rec.job_id, ABANDONED, note)

    # -- recovery ---------------------------------------------------------------------------
    def recover(self, state: ClusterState) -> list[Outcome]:
        """Finish or roll back every open plan of a controller that died, so nothing stays held."""
        outcomes = []
        for rec in self.journal.open_plans():
            # From the journaled hold on, the hold may be ours; before it the job must be as planned.
            ours = rec.step in ("open", "hold", "resize", "release")
            held = {rec.plan_id} if ours else set()
            job = _find(state, rec.job_id)
            if job is not None and job.state is JobState.COMPLETING and not ours:
                job = _find(self._observe_settled([rec], held), rec.job_id)
            why = departed(rec.plan, job, restarts=rec.restarts, held_by_us=ours)
            if why is None and not ours and self._may_act is not None:
                why = self._may_act()   # not held yet: the admin daemon, if it runs now, plans the job
            if why is not None:
                outcomes.append(self._abandon(rec, why, "on recovery"))
                continue
            if rec.step == "open":
                # Nothing was taken yet: the signal is journaled before it is sent.
                self.journal.finish(rec.plan_id, ROLLED_BACK, "controller stopped before the first step")
                log.info("job %d: plan %d rolled back on recovery (no step taken)", rec.job_id, rec.plan_id)
                outcomes.append(Outcome(rec.plan_id, rec.job_id, ROLLED_BACK, "no step taken"))
                continue
            notes = {note for _, _, note in self.journal.steps(rec.plan_id)}
            done_in_place = notes & {IN_PLACE_NOTE, KEPT_SHRINK_NOTE}
            if done_in_place:
                # Shrunk in place before the crash: the job runs on, relaunched by its batch script.
                note = done_in_place.pop()
                self.journal.finish(rec.plan_id, DONE, note)
                outcomes.append(Outcome(rec.plan_id, rec.job_id, DONE, note))
                continue
            if NOT_SIGNALLED_NOTE in notes:
                self._kept_shrinks.add(rec.plan_id)   # the hold shrinks it in place, or signals it first
            log.info("job %d: plan %d resumed on recovery after step %r", rec.job_id, rec.plan_id, rec.step)
            # The job may have been signalled and its shim may be waiting to be requeued, so from
            # 'signal' on the plan is finished, not undone.
            start = {"signal": "hold", "ack": "hold", "hold": "hold", "resize": "resize",
                     "release": "release"}[rec.step]
            if start == "release":
                # When the requeue ended is not known after a crash: keep the whole credential gap.
                self._requeued_at[rec.plan_id] = self._clock()
            outcomes.append(self._from_hold(rec, start=start, crash=False))
        return outcomes

    # -- steps 3-5 -----------------------------------------------------------------------------
    def _from_hold(self, rec: PlanRecord, *, start: str = "hold", crash: bool) -> Outcome:
        # `crash` is True on the forward path (test hook armed, plan entry trusted), False on recovery.
        for step in _STEPS[_STEPS.index(start):]:
            outcome = self._step(rec, step, crash=crash)
            if outcome is not None:
                return outcome
        self.journal.finish(rec.plan_id, DONE)
        return Outcome(rec.plan_id, rec.job_id, DONE)

    def _step(self, rec: PlanRecord, step: str, *, crash: bool) -> Outcome | None:
        """Journal and take one of steps 3-5 for one plan; an Outcome when the plan ends early."""
        plan = rec.plan
        if rec.plan_id in self._in_place and step != "hold":
            self.journal.record(rec.plan_id, step, f"not taken: {IN_PLACE_NOTE}")
            if step == _STEPS[-1]:
                self._in_place.discard(rec.plan_id)
            return None
        try:
            if rec.step != step:   # a plan recovery takes up again at the step it waits in is journaled once
                self.journal.record(rec.plan_id, step)
            if step == "hold":
                why = self._hold(rec, fresh=crash)
                if why is not None:
                    return self._abandon(rec, why, "at hold")
            elif step == "resize" and plan.keeps_queued:
                pass   # held only: its size, its nodes and a begin time of its user's stay as they are
            elif step == "resize":
                self._resize(plan, rec.plan_id, ran_before=rec.restarts > 0)
                log.info("job %d: resized to %s GPUs, StartTime=now", plan.job_id, plan.shape.describe())
            else:
                self._credential_gap(rec.plan_id)
                self._release(rec.job_id, fresh=crash)
                log.log(plan.log_level, "job %d: released (plan %d done)",
                        plan.job_id, rec.plan_id)
            if crash:
                self._maybe_crash(step)
        except _Departed as gone:
            return self._abandon(rec, str(gone), f"at {step}")
        except _NotYet as wait:
            if rec.step != step:     # said once, for `status` (what the open plan waits for)
                self.journal.record(rec.plan_id, step, str(wait))
            return Outcome(rec.plan_id, rec.job_id, WAITING, str(wait))
        except SlurmError as exc:
            return self._roll_back(rec, f"{exc}")
        except Exception as exc:
            # A programming error is not a Slurm outage, but it is this plan's alone: its job is
            # released (never left held until the next recovery) and the other plans go on.
            log.exception("job %d: plan %d: internal error at %s", rec.job_id, rec.plan_id, step)
            return self._roll_back(rec, f"internal error at {step}: {exc!r}")
        return None

    def _hold(self, rec: PlanRecord, *, fresh: bool) -> str | None:
        """Requeue-hold a running job or hold a pending one; why not, when the plan must stop instead.

        On the forward path (`fresh`) the job was observed just before the phase and the plan's
        entry says what it is; only when Slurm refuses (or on recovery) is it observed again.
        """
        if fresh:
            try:
                self._hold_action(rec.job_id, running=rec.plan.entry is PlanEntry.RUNNING, plan=rec.plan,
                                  plan_id=rec.plan_id)
                if rec.plan.entry is PlanEntry.PENDING:
                    self._held_queued.add(rec.plan_id)
                return None
            except SlurmError as exc:
                log.info("job %d: hold refused (%s); looking again", rec.job_id, exc)
        job = self._observe(rec.job_id)
        why = departed(rec.plan, job, restarts=rec.restarts, held_by_us=True)
        if why is not None or job is None:
            return why or "the job is gone from Slurm"
        if job.held:
            return None  # done before a crash, or by the requeuehold itself
        if rec.plan.entry is PlanEntry.PENDING and job.state is JobState.RUNNING:
            return "the queued job started before it could be held; the next cycle plans it as running"
        self._hold_action(rec.job_id, running=job.state is not JobState.PENDING, plan=rec.plan, plan_id=rec.plan_id)
        return None

    def _resize(self, plan: Plan, plan_id: int, *, ran_before: bool = False) -> None:
        """set_resources(..., StartTime=now), checked: Slurm 22.05 silently drops an update made while the
        requeued job is still COMPLETING, and resets BeginTime when the requeue completes."""
        for _ in range(5):
            self._wait_until_requeued(plan, requeued=plan.entry is PlanEntry.RUNNING or plan.forced,
                                      plan_id=plan_id)
            if plan.entry is PlanEntry.RUNNING or plan.forced or ran_before:
                # The requeue (ours, or Slurm's after a node failure) has completed: revoked by now. A queued
                # job that has run may have been requeued a moment ago by its owner or Slurm, and StartTime=now
                # overrides the BeginTime Slurm set for that (seen on 22.05: placed 0.7 s after an owner's
                # `scontrol requeue`, it was killed as non-startable, "Job credential revoked", and FAILED).
                self._requeued_at[plan_id] = self._clock()
            # with the solve's nodes (the plan's place; none: cleared, so no earlier plan's nodes hold it back)
            self._settle(plan.job_id, lambda: self.backend.set_resources(plan.job_id, plan.shape, start_now=True,
                                                                         nodes=plan.place))
            if plan.exclude:
                # For this job only: Slurm still counts the node as up (until SlurmdTimeout) and would
                # otherwise start the job there again.
                self._settle(plan.job_id, lambda: self.backend.exclude_nodes(  # type: ignore[attr-defined]
                    plan.job_id, plan.exclude))
            self._exclude_earlier_losses(plan)
            job = self._observe(plan.job_id)
            why = departed(plan, job, restarts=0, held_by_us=True)
            if why is not None or job is None:
                raise _Departed(why or "the job is gone from Slurm")
            if (job.state in (JobState.PENDING, JobState.REQUEUE_HOLD) and job.gpus_per_node == plan.shape.gpus_per_node
                    and set(job.required_nodes) == set(plan.place)):
                return
            log.info("job %d: update not in effect yet (%s, %d GPUs/node); again", plan.job_id,
                     job.state.value, job.gpus_per_node)
            self._sleep(self.settings.settle_poll_s)
        raise SlurmError(f"job {plan.job_id}: Slurm did not keep the new size {plan.shape.describe()}")

    def _exclude_earlier_losses(self, plan: Plan) -> None:
        """ExcNodeList again for the nodes the job's ranks reported lost in earlier plans, and without those
        that have come back since (peer_loss.still_lost). Slurm refuses it on a running job (22.05 without
        accounting), so a job shrunk in place off a lost node gets it here, at its next requeue. A refusal
        (a node since removed from the cluster) is logged: the solve keeps the job off those nodes all the
        same (allocate/from_state.py `away_from_lost_nodes`). A node the user excluded at submission and
        its ranks also reported lost is readmitted once it is back: the two cannot be told apart here."""
        if not isinstance(self.backend, NodeExcludingBackend):
            return
        reported = {n: at for n, at in self.journal.lost_nodes((plan.job_id,)).get(plan.job_id, {}).items()
                    if n not in plan.exclude}
        if not reported:
            return
        lost = still_lost(reported, self.backend.snapshot())
        back = tuple(sorted(set(reported) - lost))
        try:
            self.backend.exclude_nodes(plan.job_id, tuple(sorted(lost)), readmit=back)
        except SlurmError as exc:
            log.warning("job %d: ExcNodeList of the nodes its ranks reported lost before (%s; back since: %s) "
                        "not set: %s", plan.job_id, ",".join(sorted(lost)) or "none", ",".join(back) or "none", exc)

    def _credential_gap(self, plan_id: int) -> None:
        """Keep a requeued job held until `credential_gap_s` after its requeue.

        A requeue revokes the job's credential on its nodes, and slurmd refuses a new launch whose
        credential is not newer than the revocation, at one-second resolution: a job released
        within the same second lands on the same node, fails with "Job credential revoked" and
        ends FAILED (seen live on 22.05). Slurm's own ~120 s BeginTime exists for this. Both times
        are slurmctld's: the revocation is stamped when it processes the requeue, before we see the
        job requeued (`_requeued_at`), and the new credential when it launches the job, after our
        release. A second between the two on our clock therefore puts them in different whole
        seconds of slurmctld's, whatever the offset between the clocks; the 0.05 s is for a rate
        difference between them.
        """
        until = self._old_srun_until.get(plan_id)
        if until is not None and until > self._clock():
            log.info("plan %d: releasing in %.0f s, once the old srun (its step spanned the lost node) has given "
                     "up, so its last cancel cannot hit the next incarnation's step", plan_id, until - self._clock())
        left = self._release_not_before(plan_id) - self._clock()
        self._requeued_at.pop(plan_id, None)
        self._old_srun_until.pop(plan_id, None)
        if left > 0:
            self._sleep(left)

    def _release_not_before(self, plan_id: int) -> float:
        """When the plan's job may be released (on this protocol's clock): after its old srun has given up and
        the credential gap after its requeue (`_credential_gap`)."""
        since = self._requeued_at.get(plan_id)
        return max(self._old_srun_until.get(plan_id, float("-inf")),
                   since + self.settings.credential_gap_s if since is not None else float("-inf"))

    def _wait_for_starts(self, released: Sequence[PlanRecord]) -> None:
        """Until the jobs just released onto GPUs run, or `start_wait_s`: only then are the jobs the cycle
        leaves queued released. A live Slurm starts released jobs at its next scheduling pass, in priority
        order, so released together an older queued job took the GPUs freed for a resized one."""
        deadline = self._clock() + self.settings.start_wait_s
        ids = {r.job_id for r in released}
        while True:
            state = self.backend.snapshot()
            waiting = sorted(i for i in ids if (job := _find(state, i)) is not None and job.state is JobState.PENDING
                             and not job.held)
            if not waiting or self._clock() >= deadline:
                if waiting:
                    log.info("jobs %s have not started within %gs; releasing the jobs this cycle leaves queued",
                             ",".join(map(str, waiting)), self.settings.start_wait_s)
                return
            self._sleep(self.settings.settle_poll_s)

    def _wait_until_requeued(self, plan: Plan, *, requeued: bool = True, plan_id: int = 0) -> None:
        """Until a requeued job has finished COMPLETING.

        Slurm sets BeginTime = now + ~120 s again when the requeue completes (batch_requeue_fini),
        so StartTime=now given earlier would be overwritten. A job held for Slurm's own requeue (its
        batch host lost) is waited for until Slurm has marked the node down, and requeued by us only
        if that never comes (the node answered after all). That wait is not made inside the cycle: while
        it lasts the step raises _NotYet, the plan stays open, and each later cycle's recovery looks again
        (a report naming a batch host that is alive would otherwise hold every other job's plans, and the
        whole controller, for SlurmdTimeout and more).
        """
        job_id = plan.job_id
        slurms = self._slurm_requeues.get(plan_id)
        if slurms is None and plan.exclude and self._batch_host_lost(job_id, plan.exclude):
            # Resumed after a restart of the controller: the job it held still waits for Slurm's requeue.
            slurms = self._slurm_requeues[plan_id] = self._clock() + self._slurm_requeue_wait_s()
        deadline = slurms if slurms is not None else self._clock() + self.settings.settle_timeout_s
        while True:
            job = self._observe(job_id)
            why = departed(plan, job, restarts=0, held_by_us=True)
            if why is not None or job is None:
                self._slurm_requeues.pop(plan_id, None)
                raise _Departed(why or "the job is gone from Slurm")
            if job.state in (JobState.PENDING, JobState.REQUEUE_HOLD):
                self._slurm_requeues.pop(plan_id, None)
                return
            if slurms is not None and self._clock() < deadline:
                raise _NotYet(f"held for Slurm's own requeue (its batch host was reported lost); requeued by the "
                              f"controller in {deadline - self._clock():.0f} s unless Slurm does it first")
            if slurms is not None:
                log.warning("job %d: Slurm has not requeued it since its batch host was reported lost; "
                            "requeuing it now", job_id)
                self._slurm_requeues.pop(plan_id, None)
                self.backend.requeue_hold(job_id)
                slurms, deadline = None, self._clock() + self.settings.settle_timeout_s
                continue
            if not requeued and job.state is JobState.RUNNING:
                # A queued job Slurm started between the snapshot and our hold: nothing will requeue
                # it, so waiting is pointless; roll back and let the next cycle plan it as running.
                raise SlurmError(f"job {job_id} started before it could be held; the next cycle plans it again")
            if self._clock() >= deadline:
                log.warning("job %d: still %s after %gs; resizing anyway", job_id, job.state.value,
                            self.settings.settle_timeout_s)
                return
            self._sleep(self.settings.settle_poll_s)

    def _hold_action(self, job_id: int, *, running: bool, plan: Plan | None = None, plan_id: int = 0) -> None:
        if running and plan is not None and plan_id in self._kept_shrinks:
            self._kept_shrinks.discard(plan_id)
            if self._shrink_keeping_ranks(job_id, plan, plan_id):
                return
            self._signal_late(plan_id, job_id)
        if running and plan is not None and plan.exclude and self._give_up_lost_nodes(job_id, plan.exclude):
            said = self._old_srun_stopped(job_id)
            if said in (IN_PLACE, KEPT) and self._fits_in_place(job_id, plan):
                self.journal.record(plan_id, "hold", IN_PLACE_NOTE)
                self._in_place.add(plan_id)
                log.info("job %d: shrunk in place to its surviving nodes; %s", job_id,
                         "its surviving ranks went on in their processes" if said == KEPT
                         else "its batch script relaunches the ranks")
                try:   # the job's own exclusion, for a later requeue; Slurm may refuse it on a running job
                    self.backend.exclude_nodes(job_id, plan.exclude)  # type: ignore[attr-defined]
                except SlurmError as exc:
                    log.info("job %d: ExcNodeList not set while running (%s)", job_id, exc)
                return
            if said in (IN_PLACE, STOPPED):
                log.info("job %d: its batch script stopped the old srun; releasing without the KillWait wait", job_id)
            else:
                self._old_srun_until[plan_id] = self._clock() + self._old_srun_wait_s()
        if running and plan is not None and plan.exclude and self._batch_host_lost(job_id, plan.exclude):
            # Requeued while its dead batch host holds it COMPLETING, a job restarts without its GPUs
            # (22.05.8: "Invalid generic resource (gres) specification" at its first srun, and the GPUs
            # of its new node stay counted as used until a reconfigure); requeued by Slurm itself once
            # the node is DOWN, it does not. So it is held, and Slurm's own requeue leaves it held.
            wait = self._slurm_requeue_wait_s()
            self.backend.hold(job_id)
            self._slurm_requeues[plan_id] = self._clock() + wait
            log.info("job %d: its batch host is lost: held for Slurm's own requeue once it marks the node "
                     "down (up to %.0f s)", job_id, wait)
            return
        if running:
            if plan_id not in self._old_srun_until and self._kept_srun_runs(job_id):
                # Its ranks went on in their processes after a lost peer, under the srun that still waits
                # for the lost node's tasks: requeued later (a grow, a move), that srun outlives the job's
                # batch script and cancels J.0 once KillWait is up, by then the next incarnation's step
                # (seen converting a real script: the grown job FAILED 30 s after its restart).
                self._old_srun_until[plan_id] = self._clock() + self._old_srun_wait_s()
            self.backend.requeue_hold(job_id)
            log.info("job %d: requeued and held", job_id)
        else:
            self.backend.hold(job_id)
            log.log(plan.log_level if plan is not None else logging.INFO, "job %d: held", job_id)

    def _shrink_keeping_ranks(self, job_id: int, plan: Plan, plan_id: int) -> bool:
        """Give up the nodes the plan does not keep, the job running on; whether it was done. Asked of a job
        that still says its ranks go on in their processes and still runs on every node the plan keeps."""
        job = self._observe(job_id)
        restarts = self._record(plan_id).restarts
        if job is not None and job.state is JobState.RUNNING and job.restarts == restarts \
                and set(job.nodes) == set(plan.keep):
            # Given up before a crash that came ahead of its journal row: done, nothing to take again.
            self.journal.record(plan_id, "hold", KEPT_SHRINK_NOTE)
            self._in_place.add(plan_id)
            return True
        if job is None or job.state is not JobState.RUNNING or job.restarts != restarts or not keeps_ranks(job) \
                or not set(plan.keep) < set(job.nodes):
            log.info("job %d: not shrunk in place (its ranks no longer say they go on, or it moved); requeued",
                     job_id)
            return False
        gone = tuple(n for n in job.nodes if n not in plan.keep)
        try:
            self.backend.keep_nodes(job_id, plan.keep)  # type: ignore[attr-defined]
        except (SlurmError, AttributeError) as exc:
            log.warning("job %d: could not give up %s in place (%s); requeued instead", job_id, ",".join(gone), exc)
            return False
        self.journal.record(plan_id, "hold", KEPT_SHRINK_NOTE)
        self._in_place.add(plan_id)
        log.info("job %d: shrunk in place to %s (gave up %s); its ranks there commit and go on", job_id,
                 ",".join(plan.keep), ",".join(gone))
        return True

    def _signal_late(self, plan_id: int, job_id: int) -> None:
        """The in-place shrink could not be done: the job gets the signal now and its ACK is waited for, so
        the requeue that follows loses no step. Journaled as notes of the hold step: from the hold on, a
        controller that dies treats the job's hold as its own (recover)."""
        self.journal.record(plan_id, "hold", f"not shrunk in place: signal {self.settings.signal} sent")
        try:
            self.backend.signal(job_id, self.settings.signal)
        except SlurmError as exc:
            log.warning("job %d: could not signal (%s); continuing", job_id, exc)
            return
        acked = self._wait_for_acks([self._record(plan_id)], self.backend.snapshot())
        self.journal.record(plan_id, "hold", "acked" if acked.get(plan_id) else
                            f"no ACK within {self.settings.ack_timeout_s:g}s")

    def _give_up_lost_nodes(self, job_id: int, lost: tuple[str, ...]) -> bool:
        """Shrink the running job to the nodes it keeps before requeuing it; whether it was shrunk.

        A requeued job stays COMPLETING until every node it holds has answered; a node whose slurmd
        is gone answers once Slurm marks it DOWN (SlurmdTimeout). Given up first, it is not waited for.
        """
        job = self._observe(job_id)
        if job is None or job.state is not JobState.RUNNING or not set(lost) & set(job.nodes):
            return False
        keep = tuple(n for n in job.nodes if n not in lost)
        if not keep:
            return False
        try:
            self.backend.keep_nodes(job_id, keep)  # type: ignore[attr-defined]
            log.info("job %d: gave up %s, kept %s", job_id, ",".join(lost), ",".join(keep))
            return True
        except SlurmError as exc:
            # E.g. the lost node is the batch host (see _hold_action: then Slurm requeues the job itself).
            log.warning("job %d: could not give up %s while it runs (%s)", job_id, ",".join(lost), exc)
            return False

    def _old_srun_stopped(self, job_id: int) -> str:
        """What the job's batch script said it did with the old srun ("" nothing), asked for up to
        `launcher_wait_s` (the script polls for the settled report every half second, so its word
        follows within a second)."""
        deadline = self._clock() + self.settings.launcher_wait_s
        while True:
            said = self._launcher_stopped(job_id)
            if said or self._clock() >= deadline:
                return said
            self._sleep(self.settings.settle_poll_s)

    def _kept_srun_runs(self, job_id: int) -> bool:
        """Whether the srun under which the job's ranks went on after a lost peer still runs: its batch
        script said "kept" and has not said, within `launcher_wait_s`, that it stopped that srun. Asked
        once the ranks acknowledged: each says it ended as it exits, and the script ends the srun on their
        word within a second, so a later requeue need not wait KillWait for it."""
        deadline = self._clock() + self.settings.launcher_wait_s
        while self._launcher_stopped(job_id) == KEPT:
            if self._clock() >= deadline:
                return True
            self._sleep(self.settings.settle_poll_s)
        return False

    def _batch_host_lost(self, job_id: int, lost: tuple[str, ...]) -> bool:
        """Whether the running job's batch host is among the `lost` nodes it still holds (Slurm never
        takes the batch host from a running job, so it was not given up)."""
        job = self._observe(job_id)
        return (job is not None and job.state is JobState.RUNNING and bool(job.batch_host)
                and job.batch_host in lost and job.batch_host in job.nodes)

    def _slurm_requeue_wait_s(self) -> float:
        """How long Slurm may take to mark a dead node down and requeue its jobs: SlurmdTimeout, then a
        ping round (up to a third of it) and a margin."""
        try:
            timeout = float(self.backend.slurmd_timeout_s())  # type: ignore[attr-defined]
        except (SlurmError, AttributeError) as exc:
            log.warning("cannot read SlurmdTimeout (%s); assuming Slurm's default of 300 s", exc)
            timeout = 300.0
        return timeout * 4 / 3 + 15.0

    def _fits_in_place(self, job_id: int, plan: Plan) -> bool:
        """The job, shrunk to its surviving nodes, holds at least what the plan gives it: then a relaunch
        in place gets it there without the queue. Growth (the plan wants more) goes through requeue."""
        job = self._observe(job_id)
        return job is not None and job.state is JobState.RUNNING and job.gpus >= plan.to_gpus > 0

    def _old_srun_wait_s(self) -> float:
        """How long the old incarnation's srun may outlive the requeue: KillWait + 2 s, and a second.

        Its step spanned the dead node, which never confirms the step's end: srun waits KillWait + 2 s
        ("Timed out waiting for job step to complete") and then cancels its step by id - J.0, which by
        then names the next incarnation's first step if that has started (seen live on 22.05 with
        proctrack/linuxproc: the restarted job's ranks were killed 32 s after the requeue).
        """
        try:
            return float(self.backend.kill_wait_s()) + 3.0  # type: ignore[attr-defined]
        except SlurmError as exc:
            log.warning("cannot read KillWait (%s); assuming Slurm's default of 30 s", exc)
            return 33.0

    def _release(self, job_id: int, *, fresh: bool = False) -> None:
        if fresh:
            try:
                self._release_keeping_priority(job_id)
                return
            except SlurmError as exc:
                log.info("job %d: release refused (%s); looking again", job_id, exc)

        def attempt() -> None:
            job = self._observe(job_id)
            if job is None or job.state.finished or not job.held:
                return
            self._release_keeping_priority(job_id)
        self._settle(job_id, attempt)

    def _release_keeping_priority(self, job_id: int) -> None:
        """Release the job, then give it back the priority it had when its plan opened: released, Slurm
        ranks it behind every job that came after it (priority/basic; multifactor counts its age from the
        requeue), and those would take the GPUs the plan freed for it. Setting a priority is an operator's
        right: a controller without it (a user's watch) releases only, and says so once."""
        self.backend.release(job_id)
        priority = self._priority.pop(job_id, None)
        if priority is None or not self._keeps_priority:
            return
        try:
            self.backend.set_priority(job_id, priority)      # type: ignore[attr-defined]
        except SlurmError as exc:
            if "denied" not in str(exc).lower():
                # e.g. it started meanwhile: nothing to keep for this job
                log.info("job %d: its priority was not set back (%s)", job_id, exc)
                return
            self._keeps_priority = False
            log.warning("job %d: released at the priority Slurm gives it, not its own %d (%s); jobs resized from "
                        "now on wait behind those submitted after them", job_id, priority, exc)

    def _clear_hold_of_started(self, rec: PlanRecord) -> None:
        """A queued job Slurm started just before our hold took it anyway (priority 0), and a running job shows
        no hold (cluster.slurm_values.job_held): released here, or its next requeue (a lost node) would
        leave it held for good (seen in CI on 22.05). Slurm takes a release of a running job."""
        if rec.plan_id not in self._held_queued:
            return
        self._held_queued.discard(rec.plan_id)
        job = self._observe(rec.job_id)
        if job is not None and job.state is JobState.RUNNING:
            try:
                self.backend.release(rec.job_id)
            except SlurmError as exc:
                log.error("job %d: could not release the hold it started under: %s", rec.job_id, exc)

    def _roll_back(self, rec: PlanRecord, why: str) -> Outcome:
        """A step failed: leave the job released (with whatever shape it has), never held."""
        log.error("job %d: plan %d failed (%s); releasing the job unchanged", rec.job_id, rec.plan_id, why)
        self._clear_hold_of_started(rec)
        try:
            self._release(rec.job_id)
        except SlurmError as exc:
            log.error("job %d: release after a failed plan failed too: %s", rec.job_id, exc)
            # Stays open: the next recovery tries again, so the job cannot stay held for good.
            return Outcome(rec.plan_id, rec.job_id, "open", f"{why}; release failed: {exc}")
        self.journal.finish(rec.plan_id, ROLLED_BACK, why)
        return Outcome(rec.plan_id, rec.job_id, ROLLED_BACK, why)

    def _settle(self, job_id: int, action: Callable[[], None]) -> None:
        """Retry `action` while Slurm still finishes the requeue (the job passes through COMPLETING).

        A job that is RUNNING (Slurm started it meanwhile) or gone is not waited for.
        """
        deadline = self._clock() + self.settings.settle_timeout_s
        while True:
            try:
                action()
                return
            except SlurmError as exc:
                job = self._observe(job_id)
                if self._clock() >= deadline or job is None or job.state in (JobState.RUNNING,) or \
                        job.state.finished:
                    raise
                log.debug("job %d: Slurm not ready (%s, state %s); retrying", job_id, exc, job.state.value)
                self._sleep(self.settings.settle_poll_s)

    # -- the ACK hand-shake ------------------------------------------------------------------------
    def _wait_for_acks(self, running: Sequence[PlanRecord], state: ClusterState) -> dict[int, bool]:
        # Committed before they exited, or commit as they go on (a shrink in place): nothing to wait for.
        lost = {rec.plan_id: True for rec in running if rec.plan.peer_lost or rec.plan_id in self._kept_shrinks}
        running = [rec for rec in running if rec.plan_id not in lost]
        if not running:
            return lost
        paths: dict[int, str | None] = {}
        for rec in running:
            job = _find(state, rec.job_id)
            ckpt = job.spec.ckpt_dir if job is not None and job.spec is not None else None
            paths[rec.plan_id] = (shim.ack_path(ckpt, shim.job_key(rec.job_id), rec.job_id, rec.restarts)
                                  if ckpt else None)
        acked = {pid: False for pid in paths}
        moved_on: set[int] = set()   # jobs no longer as planned (cancelled...): not waited for
        moved_on |= self._geometry_exits(running, state)
        start = self._clock()
        deadline = {rec.plan_id: start + (self.settings.ack_timeout_s if not self._ignored_last_signal(rec)
                                          else min(self.settings.ack_timeout_s, IGNORED_SIGNAL_WAIT_S))
                    for rec in running}
        next_look = self._clock() + self.settings.observe_every_s
        while True:
            for pid, path in paths.items():
                if not acked[pid] and path is not None and os.path.exists(path):
                    acked[pid] = True
            if all(acked[pid] or pid in moved_on or self._clock() >= deadline[pid] for pid in acked):
                return {**acked, **lost}
            if self._clock() >= next_look:
                moved_on |= self._moved_on([r for r in running if not acked[r.plan_id]])
                next_look = self._clock() + self.settings.observe_every_s
            self._sleep(self.settings.ack_poll_s)

    def _ignored_last_signal(self, rec: PlanRecord) -> bool:
        """The job's last signalled plan before this one got no ACK within the timeout."""
        for earlier in self.journal.plans(rec.job_id, limit=8):
            if earlier.plan_id >= rec.plan_id:
                continue
            notes = [note for step, _, note in self.journal.steps(earlier.plan_id) if step == "ack"]
            if notes and (notes[0] == "acked" or notes[0].startswith("no ACK within")):
                return notes[0] != "acked"
        return False

    def _geometry_exits(self, records: Sequence[PlanRecord], state: ClusterState) -> set[int]:
        """Plans whose job's ranks exited 87 at this start: they are gone, so no ACK will come."""
        out = set()
        for rec in records:
            job = _find(state, rec.job_id)
            if job is not None and exited_on_geometry(job):
                log.info("job %d: its ranks exited %d on a bad batch geometry; not waiting for an ACK",
                         rec.job_id, shim.GEOMETRY_EXIT_CODE)
                self._geometry_exited.add(rec.plan_id)
                out.add(rec.plan_id)
        return out

    def _moved_on(self, records: Sequence[PlanRecord]) -> set[int]:
        """Plans whose job is no longer what they assumed; the hold step's re-check decides what happens."""
        try:
            state = self.backend.snapshot()
        except SlurmError as exc:
            log.debug("ACK wait: cannot look at the jobs (%s); waiting on", exc)
            return set()
        return {r.plan_id for r in records
                if departed(r.plan, _find(state, r.job_id), restarts=r.restarts, held_by_us=False) is not None}

    # -- plumbing ---------------------------------------------------------------------------------
    def _observe(self, job_id: int) -> Job | None:
        return _find(self.backend.snapshot(), job_id)

    def _record(self, plan_id: int) -> PlanRecord:
        for rec in self.journal.open_plans():
            if rec.plan_id == plan_id:
                return rec
        raise KeyError(plan_id)

    def _maybe_crash(self, step: str) -> None:
        if self._crash_after == step:
            log.warning("%s=%s: killing the controller now (test hook)", CRASH_ENV, step)
            self._crash()


class _Departed(Exception):
    """The job moved on under a step (ended, cancelled, a new owner): the plan is abandoned, not rolled back."""


class _NotYet(Exception):
    """The step waits for Slurm (a requeue of its own) longer than a cycle should: the plan stays open and a
    later cycle's recovery takes the step again."""


def _sigkill_self() -> None:
    logging.shutdown()
    os.kill(os.getpid(), _signal.SIGKILL)


def _running_job_dir(job: Job | None) -> tuple[str, int] | None:
    """A running job's directory and the uid its files must be owned by; None where either is not known."""
    spec = job.spec if job is not None else None
    if job is None or job.state is not JobState.RUNNING or spec is None or not spec.ckpt_dir:
        return None
    uid = owner_uid(job)
    if uid is None:
        return None
    try:
        return shim.job_dir(spec.ckpt_dir, shim.job_key(job.job_id)), uid
    except ValueError:
        return None


def keeps_ranks(job: Job | None) -> bool:
    """`job`'s batch script says, for this incarnation, that its ranks go on in their processes when nodes
    are taken from it (keeps-ranks-J-R in its job directory: the owner's regular file, no link followed)."""
    found = _running_job_dir(job)
    if job is None or found is None:
        return False
    directory, uid = found
    path = os.path.join(directory, shim.keeps_ranks_file_name(job.job_id, job.restarts))
    try:
        return shim.read_user_file(path, owner_uid=uid, max_bytes=64, what="a marker") is not None
    except ValueError:
        return False


def exited_on_geometry(job: Job) -> bool:
    """`job`'s ranks, at this start, found its global batch cannot be split over its size and exited 87.

    Only the owner's own geometry.json counts (the contract's reader), and only one written since
    the job last started: a file left by an earlier start at the same size says nothing about now.
    """
    found = _running_job_dir(job)
    if found is None:
        return False
    directory, uid = found
    path = os.path.join(directory, shim.GEOMETRY_FILE)
    geometry, _ = read_job_geometry(path, owner_uid=uid, max_bytes=shim.GEOMETRY_MAX_BYTES)
    if geometry is None or not geometry.stuck or geometry.world_size != job.gpus:
        return False
    if job.start_time is None:
        return False
    try:
        return os.stat(path, follow_symlinks=False).st_mtime >= job.start_time
    except OSError:
        return False


def _find(state: ClusterState, job_id: int) -> Job | None:
    for job in state.jobs:
        if job.job_id == job_id:
            return job
    return None
