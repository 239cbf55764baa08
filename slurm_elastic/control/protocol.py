"""The requeue protocol: signal, wait for the checkpoint ACK, requeuehold, resize, release; and its recovery."""

from __future__ import annotations

import logging
import os
import signal as _signal
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from slurm_elastic.cluster.backend import Backend
from slurm_elastic.cluster.model import ClusterState, Job, JobState
from slurm_elastic.control.journal import ABANDONED, DONE, ROLLED_BACK, Journal, PlanRecord
from slurm_elastic.control.plan import Plan, PlanEntry
from slurm_elastic.errors import SlurmError
from slurm_elastic.train import protocol as shim

log = logging.getLogger(__name__)

_STEPS = ("hold", "resize", "release")   # steps 3-5, after signal and ACK

CRASH_ENV = "SLURM_ELASTIC_CRASH_AFTER"
"""Test hook: SIGKILL this process right after the named step (open, signal, ack, hold, resize, release)."""


@dataclass(frozen=True, slots=True)
class ProtocolSettings:
    signal: str = shim.DEFAULT_SIGNAL
    ack_timeout_s: float = 60.0      # then proceed: the last periodic checkpoint is the resume point
    ack_poll_s: float = 0.2
    settle_timeout_s: float = 30.0   # a requeued job passes through COMPLETING before Slurm lets it be updated
    settle_poll_s: float = 0.25
    credential_gap_s: float = 1.5    # no release sooner after the requeue (see RequeueProtocol._credential_gap)


@dataclass(frozen=True, slots=True)
class Outcome:
    plan_id: int
    job_id: int
    status: str          # done | rolled_back | abandoned
    note: str = ""
    acked: bool | None = None

    def to_json(self) -> dict[str, object]:
        return {"plan_id": self.plan_id, "job_id": self.job_id, "status": self.status, "note": self.note,
                "acked": self.acked}


class RequeueProtocol:
    """Carries plans through the protocol; every step is journaled before it is taken and is idempotent."""

    def __init__(self, backend: Backend, journal: Journal, settings: ProtocolSettings = ProtocolSettings(),
                 *, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 crash_after: str | None = None, crash: Callable[[], None] | None = None) -> None:
        self.backend = backend
        self.journal = journal
        self.settings = settings
        self._clock = clock
        self._sleep = sleep
        self._crash_after = crash_after if crash_after is not None else os.environ.get(CRASH_ENV) or None
        self._crash = crash or _sigkill_self
        self._requeued_at: dict[int, float] = {}

    # -- the forward path ------------------------------------------------------------------
    def execute(self, plans: Sequence[Plan], state: ClusterState) -> list[Outcome]:
        """Run `plans` (all running jobs are signalled together, so their checkpoints overlap)."""
        records: list[PlanRecord] = []
        for plan in plans:
            job = state.job(plan.job_id)
            plan_id = self.journal.open_plan(plan, restarts=job.restarts)
            self._maybe_crash("open")
            records.append(self._record(plan_id))
        # Queued jobs are held first: GPUs that a shrinking job frees below must not let Slurm start
        # one of them at its old size between our hold and our update.
        held_first: dict[int, bool] = {}
        for rec in records:
            if rec.plan.entry is PlanEntry.PENDING:
                self.journal.record(rec.plan_id, "hold")
                held_first[rec.plan_id] = self._hold(rec, fresh=True)
                self._maybe_crash("hold")
        running = [r for r in records if r.plan.entry is PlanEntry.RUNNING]
        for rec in running:
            self.journal.record(rec.plan_id, "signal", self.settings.signal)
            try:
                self.backend.signal(rec.job_id, self.settings.signal)
                log.info("job %d: sent %s (plan %d)", rec.job_id, self.settings.signal, rec.plan_id)
            except SlurmError as exc:
                # A job that just ended or was requeued by Slurm cannot be signalled; the hold step sorts it out.
                log.warning("job %d: could not signal (%s); continuing", rec.job_id, exc)
            self._maybe_crash("signal")
        acked = self._wait_for_acks(running, state)
        for rec in running:
            note = "acked" if acked.get(rec.plan_id) else f"no ACK within {self.settings.ack_timeout_s:g}s"
            self.journal.record(rec.plan_id, "ack", note)
            if not acked.get(rec.plan_id):
                log.warning("job %d: %s; the last periodic checkpoint is the resume point", rec.job_id, note)
            self._maybe_crash("ack")
        # Steps 3-5 go phase by phase across all plans, not plan by plan: Slurm finishes the
        # requeues (and the credential gaps run out) side by side, so a cycle with many plans
        # costs about one plan's waits, and every shrink is in place before any job is released.
        finished: dict[int, Outcome] = {}
        starts: dict[int, str] = {}
        for rec in records:
            if rec.plan.entry is PlanEntry.PENDING and not held_first[rec.plan_id]:
                self.journal.finish(rec.plan_id, ABANDONED, "job ended")
                finished[rec.plan_id] = Outcome(rec.plan_id, rec.job_id, ABANDONED, "job ended")
            else:
                starts[rec.plan_id] = "resize" if rec.plan.entry is PlanEntry.PENDING else "hold"
        for step in _STEPS:
            for rec in records:
                if rec.plan_id in finished or _STEPS.index(step) < _STEPS.index(starts[rec.plan_id]):
                    continue
                outcome = self._step(rec, step, crash=True)
                if outcome is not None:
                    finished[rec.plan_id] = outcome
        outcomes = []
        for rec in records:
            outcome = finished.get(rec.plan_id)
            if outcome is None:
                self.journal.finish(rec.plan_id, DONE)
                outcome = Outcome(rec.plan_id, rec.job_id, DONE)
            outcomes.append(Outcome(outcome.plan_id, outcome.job_id, outcome.status, outcome.note,
                                    acked.get(rec.plan_id) if rec.plan.entry is PlanEntry.RUNNING else None))
        return outcomes

    # -- recovery ---------------------------------------------------------------------------
    def recover(self, state: ClusterState) -> list[Outcome]:
        """Finish or roll back every open plan of a controller that died, so nothing stays held."""
        outcomes = []
        for rec in self.journal.open_plans():
            job = _find(state, rec.job_id)
            if job is None or job.state.finished:
                self.journal.finish(rec.plan_id, ABANDONED, "job ended")
                log.info("job %d: plan %d abandoned on recovery: the job ended", rec.job_id, rec.plan_id)
                outcomes.append(Outcome(rec.plan_id, rec.job_id, ABANDONED, "job ended"))
                continue
            if rec.step == "open":
                # Nothing was taken yet: the signal is journaled before it is sent.
                self.journal.finish(rec.plan_id, ROLLED_BACK, "controller stopped before the first step")
                log.info("job %d: plan %d rolled back on recovery (no step taken)", rec.job_id, rec.plan_id)
                outcomes.append(Outcome(rec.plan_id, rec.job_id, ROLLED_BACK, "no step taken"))
                continue
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
        try:
            self.journal.record(rec.plan_id, step)
            if step == "hold":
                if not self._hold(rec, fresh=crash):
                    self.journal.finish(rec.plan_id, ABANDONED, "job ended")
                    return Outcome(rec.plan_id, rec.job_id, ABANDONED, "job ended")
            elif step == "resize":
                self._resize(plan, rec.plan_id)
                log.info("job %d: resized to %dx%d GPUs, StartTime=now", plan.job_id, plan.nodes,
                         plan.gpus_per_node)
            else:
                self._credential_gap(rec.plan_id)
                self._release(rec.job_id, fresh=crash)
                log.info("job %d: released (plan %d done)", plan.job_id, rec.plan_id)
            if crash:
                self._maybe_crash(step)
        except SlurmError as exc:
            return self._roll_back(rec, f"{exc}")
        return None

    def _hold(self, rec: PlanRecord, *, fresh: bool) -> bool:
        """Requeue-hold a running job or hold a pending one; False when the job is gone.

        On the forward path (`fresh`) the plan's entry says what the job is; only when Slurm refuses
        (or on recovery) is the job observed again, which keeps a cycle to one snapshot.
        """
        if fresh:
            try:
                self._hold_action(rec.job_id, running=rec.plan.entry is PlanEntry.RUNNING)
                return True
            except SlurmError as exc:
                log.info("job %d: hold refused (%s); looking again", rec.job_id, exc)
        job = self._observe(rec.job_id)
        if job is None or job.state.finished:
            return False
        if job.held:
            return True  # done before a crash, or by the requeuehold itself
        self._hold_action(rec.job_id, running=job.state is not JobState.PENDING)
        return True

    def _resize(self, plan: Plan, plan_id: int) -> None:
        """set_resources(..., StartTime=now), checked: Slurm 22.05 silently drops an update made while the
        requeued job is still COMPLETING, and resets BeginTime when the requeue completes."""
        for _ in range(5):
            self._wait_until_requeued(plan.job_id, requeued=plan.entry is PlanEntry.RUNNING or plan.forced)
            if plan.entry is PlanEntry.RUNNING or plan.forced:
                # The requeue (ours, or Slurm's after a node failure) has completed: revoked by now.
                self._requeued_at[plan_id] = self._clock()
            self._settle(plan.job_id, lambda: self.backend.set_resources(
                plan.job_id, nodes=plan.nodes, gpus_per_node=plan.gpus_per_node,
                cpus_per_gpu=plan.cpus_per_gpu, mem_per_gpu_mb=plan.mem_per_gpu_mb, start_now=True))
            job = self._observe(plan.job_id)
            if job is None or job.state.finished:
                return
            if job.state in (JobState.PENDING, JobState.REQUEUE_HOLD) and job.gpus_per_node == plan.gpus_per_node:
                return
            log.info("job %d: update not in effect yet (%s, %d GPUs/node); again", plan.job_id,
                     job.state.value, job.gpus_per_node)
            self._sleep(self.settings.settle_poll_s)
        raise SlurmError(f"job {plan.job_id}: Slurm did not keep the new size {plan.nodes}x{plan.gpus_per_node}")

    def _credential_gap(self, plan_id: int) -> None:
        """Keep a requeued job held until `credential_gap_s` after its requeue.

        A requeue revokes the job's credential on its nodes, and slurmd refuses a new launch whose
        credential is not newer than the revocation, at one-second resolution: a job released
        within the same second lands on the same node, fails with "Job credential revoked" and
        ends FAILED (seen live on 22.05). Slurm's own ~120 s BeginTime exists for this; a second
        and a half is enough.
        """
        since = self._requeued_at.pop(plan_id, None)
        if since is None:
            return
        left = since + self.settings.credential_gap_s - self._clock()
        if left > 0:
            self._sleep(left)

    def _wait_until_requeued(self, job_id: int, *, requeued: bool = True) -> None:
        """Until a requeued job has finished COMPLETING.

        Slurm sets BeginTime = now + ~120 s again when the requeue completes (batch_requeue_fini),
        so StartTime=now given earlier would be overwritten.
        """
        deadline = self._clock() + self.settings.settle_timeout_s
        while True:
            job = self._observe(job_id)
            if job is None or job.state.finished or job.state in (JobState.PENDING, JobState.REQUEUE_HOLD):
                return
            if not requeued and job.state is JobState.RUNNING:
                # A queued job Slurm started between the snapshot and our hold: nothing will requeue
                # it, so waiting is pointless; roll back and let the next cycle plan it as running.
                raise SlurmError(f"job {job_id} started before it could be held; the next cycle plans it again")
            if self._clock() >= deadline:
                log.warning("job %d: still %s after %gs; resizing anyway", job_id, job.state.value,
                            self.settings.settle_timeout_s)
                return
            self._sleep(self.settings.settle_poll_s)

    def _hold_action(self, job_id: int, *, running: bool) -> None:
        if running:
            self.backend.requeue_hold(job_id)
            log.info("job %d: requeued and held", job_id)
        else:
            self.backend.hold(job_id)
            log.info("job %d: held", job_id)

    def _release(self, job_id: int, *, fresh: bool = False) -> None:
        if fresh:
            try:
                self.backend.release(job_id)
                return
            except SlurmError as exc:
                log.info("job %d: release refused (%s); looking again", job_id, exc)

        def attempt() -> None:
            job = self._observe(job_id)
            if job is None or job.state.finished or not job.held:
                return
            self.backend.release(job_id)
        self._settle(job_id, attempt)

    def _roll_back(self, rec: PlanRecord, why: str) -> Outcome:
        """A step failed: leave the job released (with whatever shape it has), never held."""
        log.error("job %d: plan %d failed (%s); releasing the job unchanged", rec.job_id, rec.plan_id, why)
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
        if not running:
            return {}
        paths: dict[int, str | None] = {}
        for rec in running:
            job = _find(state, rec.job_id)
            ckpt = job.spec.ckpt_dir if job is not None and job.spec is not None else None
            paths[rec.plan_id] = (shim.ack_path(ckpt, shim.job_key(rec.job_id), rec.job_id, rec.restarts)
                                  if ckpt else None)
        acked = {pid: False for pid in paths}
        deadline = self._clock() + self.settings.ack_timeout_s
        while True:
            for pid, path in paths.items():
                if not acked[pid] and path is not None and os.path.exists(path):
                    acked[pid] = True
            if all(acked.values()) or self._clock() >= deadline:
                return acked
            self._sleep(self.settings.ack_poll_s)

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


def _sigkill_self() -> None:
    logging.shutdown()
    os.kill(os.getpid(), _signal.SIGKILL)


def _find(state: ClusterState, job_id: int) -> Job | None:
    for job in state.jobs:
        if job.job_id == job_id:
            return job
    return None
