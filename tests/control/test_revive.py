"""An elastic job ended by a kill meant for its previous incarnation is requeued, once (control/revive.py).

The in-memory Slurm plays the 26.05.5 sequence seen live: the job's node fails (Slurm requeues
it), the node returns, the job starts there again and its batch script dies of SIGTERM seconds
later (FAILED). tests/control/test_stale_kill_live.py runs the same on a real Slurm.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import weakref

import pytest

from slurm_elastic.cluster.model import ClusterState, JobState
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler
from slurm_elastic.control.revive import stale_kill_victims
from slurm_elastic.spec import ElasticSpec

from control.fake_slurm import FakeSlurm


# What a controller running through the node failure saw (the snapshot while the node was down, and
# when): a stale kill is revived only by a controller that saw a node of the job fail.
_FAILURES_SEEN: weakref.WeakKeyDictionary[FakeSlurm, tuple[ClusterState, float]] = weakref.WeakKeyDictionary()


def _slurm_with_a_restarted_job(*, spec: ElasticSpec | None = ElasticSpec(2, 2)) -> tuple[FakeSlurm, int]:
    slurm = FakeSlurm()
    job = slurm.add_job(spec, nodes=1, gpus_per_node=2)
    node = slurm.jobs[job].nodes[0]
    slurm.node_down(node)              # Slurm requeues it: restart 1, BeginTime
    _FAILURES_SEEN[slurm] = (slurm.snapshot(), slurm.now)
    slurm.node_up(node)
    slurm.now += 200                   # past BeginTime: it starts again
    slurm.schedule()
    assert slurm.jobs[job].state is JobState.RUNNING and slurm.jobs[job].restarts == 1
    return slurm, job


def _reconciler(slurm: FakeSlurm, tmp_path, *, saw_the_failure: bool = True, **config) -> Reconciler:
    rec = Reconciler(slurm, Journal(tmp_path / "j.sqlite"), ControllerConfig(node_confirm_s=0, **config),
                     clock=lambda: slurm.now, sleep=lambda s: None)
    if saw_the_failure and slurm in _FAILURES_SEEN:
        rec.reviver.observe(*_FAILURES_SEEN[slurm])
    return rec


def test_a_job_killed_by_its_previous_incarnations_kill_is_requeued_once(tmp_path):
    slurm, job = _slurm_with_a_restarted_job()
    slurm.now += 1
    slurm.finish(job, JobState.FAILED, signal=signal.SIGTERM)
    rec = _reconciler(slurm, tmp_path)
    report = rec.cycle()
    assert report.revived == (job,)
    assert ("requeue", job) in slurm.calls
    assert slurm.jobs[job].state in (JobState.PENDING, JobState.RUNNING) and slurm.jobs[job].restarts == 2
    # the same incarnation seen FAILED again (a second controller, a replayed snapshot) is not requeued twice
    assert rec.journal.claim_revival(job, 1, per_hour=3) is False


def test_a_claimed_incarnation_is_not_requeued_again_by_a_restarted_controller(tmp_path):
    slurm, job = _slurm_with_a_restarted_job()
    slurm.now += 1
    slurm.finish(job, JobState.FAILED, signal=signal.SIGTERM)
    state = slurm.snapshot()
    first = _reconciler(slurm, tmp_path)
    assert first.journal.claim_revival(job, state.job(job).restarts, per_hour=3)   # claimed, then it died
    first.journal.close()
    again = _reconciler(slurm, tmp_path)
    assert again.cycle().revived == ()
    assert slurm.jobs[job].state is JobState.FAILED


@pytest.mark.parametrize("case", ["cancelled", "exit code", "never restarted", "ran long", "not elastic",
                                  "not requeueable", "killed by SIGKILL"])
def test_what_is_not_the_signature_is_left_alone(tmp_path, case):
    spec = None if case == "not elastic" else ElasticSpec(2, 2)
    if case == "never restarted":
        slurm = FakeSlurm()
        job = slurm.add_job(spec, nodes=1, gpus_per_node=2)
    else:
        slurm, job = _slurm_with_a_restarted_job(spec=spec)
    if case == "not requeueable":
        import dataclasses
        slurm.jobs[job] = dataclasses.replace(slurm.jobs[job], requeue=False)
    slurm.now += 3600 if case == "ran long" else 1
    if case == "cancelled":
        slurm.cancel(job)
    else:
        slurm.finish(job, JobState.FAILED,
                     signal={"exit code": None, "killed by SIGKILL": signal.SIGKILL}.get(case, signal.SIGTERM))
    assert stale_kill_victims(slurm.snapshot()) == []
    rec = _reconciler(slurm, tmp_path)
    assert rec.cycle().revived == ()
    assert ("requeue", job) not in slurm.calls


def test_a_dry_run_revives_nothing(tmp_path):
    slurm, job = _slurm_with_a_restarted_job()
    slurm.now += 1
    slurm.finish(job, JobState.FAILED, signal=signal.SIGTERM)
    assert _reconciler(slurm, tmp_path).cycle(dry_run=True).revived == ()
    assert slurm.jobs[job].state is JobState.FAILED


def test_user_mode_revives_only_the_users_own_jobs(tmp_path):
    slurm, job = _slurm_with_a_restarted_job()
    slurm.now += 1
    slurm.finish(job, JobState.FAILED, signal=signal.SIGTERM)
    rec = _reconciler(slurm, tmp_path, user="bob")
    assert rec.cycle().revived == ()            # the job is alice's


def _dies_again(slurm: FakeSlurm, job: int) -> None:
    if slurm.jobs[job].state is not JobState.RUNNING:
        slurm.now += 200               # past BeginTime
        slurm.schedule()
    assert slurm.jobs[job].state is JobState.RUNNING
    slurm.now += 1
    slurm.finish(job, JobState.FAILED, signal=signal.SIGTERM)


def test_a_job_killed_at_every_start_is_requeued_three_times_an_hour(tmp_path, caplog):
    slurm, job = _slurm_with_a_restarted_job()
    rec = _reconciler(slurm, tmp_path)
    rec.reviver.node_failure_s = 2 * 3600     # the one node failure seen stays evidence: the budget is tested
    for _ in range(3):
        _dies_again(slurm, job)
        assert rec.cycle().revived == (job,)
    _dies_again(slurm, job)
    assert rec.cycle().revived == () and slurm.jobs[job].state is JobState.FAILED   # the fourth in the hour
    assert sum("not requeued" in r.message for r in caplog.records) == 1   # said once, not every cycle
    rec.cycle()
    assert sum("not requeued" in r.message for r in caplog.records) == 1
    slurm.now += 3600                  # an hour on: the budget is back
    assert rec.cycle().revived == (job,)


def test_a_requeue_that_fails_is_tried_again_next_cycle(tmp_path):
    slurm, job = _slurm_with_a_restarted_job()
    slurm.now += 1
    slurm.finish(job, JobState.FAILED, signal=signal.SIGTERM)
    slurm.fail["requeue"] = lambda j: True        # slurmctld not answering
    rec = _reconciler(slurm, tmp_path)
    assert rec.cycle().revived == ()
    del slurm.fail["requeue"]
    assert rec.cycle().revived == (job,)


@pytest.mark.parametrize("signal_sent", [signal.SIGTERM, signal.SIGINT])
def test_an_owners_signal_just_after_a_restart_is_final_when_no_node_of_the_job_failed(tmp_path, caplog,
                                                                                      signal_sent):
    """`scancel --full --signal=TERM` by its owner leaves Slurm's record of a stale kill (FAILED, 0:15): what
    tells them apart is the node failure a stale kill needs, and this one had none."""
    caplog.set_level(logging.INFO, logger="slurm_elastic.control.revive")
    slurm = FakeSlurm()
    job = slurm.add_job(ElasticSpec(2, 2), nodes=1, gpus_per_node=2)
    rec = _reconciler(slurm, tmp_path)
    rec.cycle()
    slurm.requeue(job)                 # restarted without a node failure (a resize, `scontrol requeue`)
    slurm.now += 200
    slurm.schedule()
    assert slurm.jobs[job].state is JobState.RUNNING and slurm.jobs[job].restarts == 1
    rec.cycle()
    slurm.now += 5
    slurm.finish(job, JobState.FAILED, signal=signal_sent)     # the owner's scancel --full --signal=...
    for _ in range(2):
        assert rec.cycle().revived == ()
    assert slurm.jobs[job].state is JobState.FAILED and slurm.calls.count(("requeue", job)) == 1   # the test's
    assert sum("final; not requeued" in r.getMessage() for r in caplog.records) == (signal_sent == signal.SIGTERM)


def test_a_controller_that_did_not_see_the_node_fail_does_not_revive(tmp_path):
    slurm, job = _slurm_with_a_restarted_job()
    slurm.now += 1
    slurm.finish(job, JobState.FAILED, signal=signal.SIGTERM)
    assert _reconciler(slurm, tmp_path, saw_the_failure=False).cycle().revived == ()
    assert slurm.jobs[job].state is JobState.FAILED


def test_a_node_failure_long_before_the_end_is_no_evidence(tmp_path):
    slurm, job = _slurm_with_a_restarted_job()
    slurm.now += 1
    rec = _reconciler(slurm, tmp_path)
    slurm.now += rec.reviver.node_failure_s
    slurm.finish(job, JobState.FAILED, signal=signal.SIGTERM)
    slurm.jobs[job] = dataclasses.replace(slurm.jobs[job], start_time=slurm.now - 1)
    assert rec.cycle().revived == ()
