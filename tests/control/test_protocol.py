"""The requeue protocol against FakeSlurm (a stand-in for Slurm): the happy path, failures and crash recovery."""

from __future__ import annotations

import dataclasses
import getpass
import os

import pytest

from slurm_elastic.cluster.model import JobState
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.control.journal import ABANDONED, DONE, ROLLED_BACK, STEPS, Journal
from slurm_elastic.control.plan import Plan, PlanEntry, kept_queued
from slurm_elastic.control.protocol import ProtocolSettings, RequeueProtocol
from slurm_elastic.spec import ElasticSpec
from slurm_elastic import jobfiles as shim

from control.fake_slurm import FakeSlurm


class SimulatedCrash(BaseException):
    """Raised by the crash hook in place of SIGKILL."""


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def _crash() -> None:
    raise SimulatedCrash()


def _protocol(slurm: FakeSlurm, journal: Journal, *, crash_after: str | None = None,
              ack_timeout_s: float = 5.0) -> RequeueProtocol:
    clock = FakeClock()
    return RequeueProtocol(slurm, journal, ProtocolSettings(ack_timeout_s=ack_timeout_s, settle_timeout_s=2.0),
                           clock=clock, sleep=clock.sleep, crash_after=crash_after or "", crash=_crash)


def _shrink_plan(slurm: FakeSlurm, job_id: int) -> Plan:
    job = slurm.jobs[job_id]
    return Plan(job_id=job_id, from_gpus=job.gpus, to_gpus=4, shape=RequestShape(1, 4, 1, 1024),
                entry=PlanEntry.RUNNING, reason="shrink", user=job.user)


@pytest.fixture
def setup(tmp_path):
    slurm = FakeSlurm()
    spec = ElasticSpec(4, 8, gpu_step=4, ckpt_dir=str(tmp_path / "ckpt"))
    job_id = slurm.add_job(spec, nodes=2, gpus_per_node=4)
    journal = Journal(tmp_path / "journal.sqlite")
    return slurm, job_id, journal


def test_running_job_is_signalled_acked_requeued_resized_and_released(setup):
    slurm, job_id, journal = setup
    assert slurm.jobs[job_id].gpus == 8
    [out] = _protocol(slurm, journal).execute([_shrink_plan(slurm, job_id)], slurm.snapshot())
    job = slurm.jobs[job_id]
    assert out.status == DONE and out.acked is True
    assert job.state is JobState.RUNNING and job.gpus == 4 and not job.held and job.restarts == 1
    verbs = [v for v, _ in slurm.calls]
    assert verbs == ["signal", "requeue_hold", "set_resources", "release", "set_priority"]
    assert journal.open_plans() == []
    assert [s for s, _, _ in journal.steps(out.plan_id)] == ["open", *STEPS[1:], "done"]


def test_a_resized_job_keeps_its_place_in_slurms_queue(setup):
    """Released, Slurm ranks a job behind every job submitted after it (priority/basic, seen live on 22.05:
    4294901759 before the hold, 4294901756 after the release), and another user's 40 pending jobs took
    every GPU the controller freed for a resized job, which stayed pending (found by a probe). The
    controller gives it back its own priority after the release."""
    slurm, job_id, journal = setup
    slurm.release_lowers_priority = True
    later = slurm.add_job(ElasticSpec(1, 8), nodes=1, gpus_per_node=4, user="mallory")
    before = slurm.jobs[job_id].priority
    assert before > slurm.jobs[later].priority
    [out] = _protocol(slurm, journal).execute([_shrink_plan(slurm, job_id)], slurm.snapshot())
    assert out.status == DONE and slurm.jobs[job_id].priority == before


@pytest.mark.parametrize("keep_queued", [True, False])
def test_a_queued_job_the_solve_leaves_waiting_never_takes_the_gpus_freed_for_a_resized_one(tmp_path, keep_queued):
    """A live Slurm starts released jobs at its next pass, by priority: another user's older queued job
    took the GPUs a cycle freed for a grow, and the next cycle sent it back, freeing GPUs the next one of
    that user's 40 queued jobs took (an adversarial probe: 458 requeues). The cycle holds the queued jobs
    it leaves waiting until its resized jobs have started. Without that (`keep_queued` False) the race is
    lost: the test sees what the probe saw."""
    clock = FakeClock()
    slurm = FakeSlurm(nodes=2, gpus_per_node=4, clock=clock)
    ckpt = str(tmp_path / "ckpt")
    bob = slurm.add_job(ElasticSpec(4, 8, gpu_step=4, ckpt_dir=ckpt), nodes=1, gpus_per_node=4, user="bob")
    mine = slurm.add_job(ElasticSpec(4, 4, ckpt_dir=ckpt), nodes=1, gpus_per_node=4, user="mallory")
    queued = slurm.add_job(ElasticSpec(4, 4, ckpt_dir=ckpt), nodes=1, gpus_per_node=4, user="mallory",
                           priority=slurm.jobs[bob].priority + 10)   # ahead of bob's job (fair-share)
    # behind it: held for its resize, bob's job has priority 0 (seen live: such a job took its GPUs)
    later = slurm.add_job(ElasticSpec(4, 4, ckpt_dir=ckpt), nodes=1, gpus_per_node=4, user="mallory",
                          priority=slurm.jobs[bob].priority - 10)
    assert [slurm.jobs[j].state for j in (bob, mine, queued, later)] == [
        JobState.RUNNING, JobState.RUNNING, JobState.PENDING, JobState.PENDING]
    slurm.start_latency_s = 1.0   # a live Slurm's next scheduling pass
    shape4 = RequestShape(1, 4, 1, 1024)
    plans = [Plan(job_id=mine, from_gpus=4, to_gpus=0, shape=shape4, entry=PlanEntry.RUNNING,
                  reason="no room: back to the queue at its minimum", user="mallory"),
             Plan(job_id=bob, from_gpus=4, to_gpus=8, shape=RequestShape(2, 4, 1, 1024), entry=PlanEntry.RUNNING,
                  reason="grow", user="bob", place=("n1", "n2"))]
    guards = kept_queued(slurm.snapshot(), plans, lambda job: True, lambda spec, gpus: shape4)
    assert [(g.job_id, g.leaves_queued, g.keeps_queued) for g in guards] == [(queued, True, True),
                                                                            (later, True, True)]
    journal = Journal(tmp_path / "journal.sqlite")
    proto = RequeueProtocol(slurm, journal, ProtocolSettings(ack_timeout_s=5.0, settle_timeout_s=2.0),
                            clock=clock, sleep=clock.sleep, crash_after="", crash=_crash)
    outcomes = proto.execute(plans + guards if keep_queued else plans, slurm.snapshot())
    assert {o.status for o in outcomes} == {DONE}
    clock.t += 5.0
    state = {j: slurm.jobs[j] for j in (bob, mine, queued, later)}
    if keep_queued:
        assert (state[bob].state, state[bob].gpus) == (JobState.RUNNING, 8)
        assert [state[j].state for j in (mine, queued, later)] == [JobState.PENDING] * 3
        assert not state[queued].held and state[queued].priority == slurm.jobs[bob].priority + 10
        assert not state[later].held and state[later].priority == slurm.jobs[bob].priority - 10
        assert ("set_resources", queued) not in slurm.calls   # only held: its size and begin time untouched
    else:
        assert state[bob].state is JobState.PENDING and state[queued].state is JobState.RUNNING


def test_missing_ack_waits_for_the_deadline_then_proceeds(setup):
    slurm, job_id, journal = setup
    slurm.ack = False
    proto = _protocol(slurm, journal, ack_timeout_s=3.0)
    [out] = proto.execute([_shrink_plan(slurm, job_id)], slurm.snapshot())
    assert out.status == DONE and out.acked is False
    assert proto._clock() >= 3.0
    assert "no ACK within 3s" in [n for s, _, n in journal.steps(out.plan_id) if s == "ack"][0]


def test_job_requeued_by_slurm_enters_at_hold_and_starts_without_begin_time(setup):
    slurm, job_id, journal = setup
    slurm.node_down("n2")
    job = slurm.jobs[job_id]
    assert job.state is JobState.PENDING and job.reason == "BeginTime"
    plan = Plan(job_id=job_id, from_gpus=8, to_gpus=4, shape=RequestShape(1, 4, 1, 1024), entry=PlanEntry.PENDING,
                reason="requeued", forced=True)
    [out] = _protocol(slurm, journal).execute([plan], slurm.snapshot())
    assert out.status == DONE
    assert [v for v, _ in slurm.calls] == ["hold", "set_resources", "release", "set_priority"]
    job = slurm.jobs[job_id]
    assert job.state is JobState.RUNNING and job.gpus == 4 and job.nodes[0] != "n2"


def test_a_refused_resize_rolls_back_and_leaves_the_job_released(setup):
    slurm, job_id, journal = setup
    slurm.fail["set_resources"] = lambda _jid: True
    [out] = _protocol(slurm, journal).execute([_shrink_plan(slurm, job_id)], slurm.snapshot())
    assert out.status == ROLLED_BACK and "injected failure" in out.note
    assert not slurm.jobs[job_id].held
    assert journal.open_plans() == []


def test_a_programming_error_in_one_plan_releases_its_job_and_the_other_plans_go_on(setup, monkeypatch):
    slurm, job_id, journal = setup
    other = slurm.add_job(ElasticSpec(4, 8, gpu_step=4), nodes=2, gpus_per_node=4)
    real = slurm.set_resources

    def broken(job, *args, **kwargs):
        if job == job_id:
            raise NameError("name 'val' is not defined")   # as pyslurm 24.11's memory_per_gpu setter
        return real(job, *args, **kwargs)

    monkeypatch.setattr(slurm, "set_resources", broken)
    outcomes = _protocol(slurm, journal).execute([_shrink_plan(slurm, job_id), _shrink_plan(slurm, other)],
                                                 slurm.snapshot())
    by_job = {o.job_id: o for o in outcomes}
    assert by_job[job_id].status == ROLLED_BACK and "internal error at resize" in by_job[job_id].note
    assert by_job[other].status == DONE
    assert not slurm.jobs[job_id].held and not slurm.jobs[other].held, "no job of the cycle may stay held"
    assert slurm.jobs[other].gpus == 4
    assert journal.open_plans() == []


def test_a_defect_outside_the_steps_releases_every_job_the_cycle_held_then_surfaces(setup, monkeypatch):
    slurm, job_id, journal = setup
    protocol = _protocol(slurm, journal)

    def broken(records, finished, held, *, before):
        if before == "release":
            raise KeyError("phase")     # after the hold, outside any one plan's step

    monkeypatch.setattr(protocol, "_recheck", broken)
    with pytest.raises(KeyError):
        protocol.execute([_shrink_plan(slurm, job_id)], slurm.snapshot())
    assert not slurm.jobs[job_id].held, "a defect between phases must not leave the job held"
    assert journal.open_plans() == []


# Queued (here: requeued by Slurm) jobs are not signalled, so they have no signal/ack steps.
CRASH_POINTS = [("running", s) for s in STEPS] + [("requeued", s) for s in STEPS if s not in ("signal", "ack")]


@pytest.mark.parametrize("entry,step", CRASH_POINTS)
def test_crash_after_each_step_then_recovery_leaves_no_job_held(setup, step, entry):
    slurm, job_id, journal = setup
    other = slurm.add_job(ElasticSpec(1, 4), nodes=1, gpus_per_node=2)
    if entry == "requeued":
        slurm.node_down("n1")  # both jobs use n1 (first fit), Slurm requeues them
        plans = [Plan(job_id=j, from_gpus=slurm.jobs[j].gpus, to_gpus=4, shape=RequestShape(1, 4, 1, 1024),
                      entry=PlanEntry.PENDING, reason="requeued",
                      forced=True) for j in (job_id, other)]
    else:
        plans = [_shrink_plan(slurm, job_id)]
    with pytest.raises(SimulatedCrash):
        _protocol(slurm, journal, crash_after=step).execute(plans, slurm.snapshot())
    journal2 = Journal(journal.path)
    outcomes = _protocol(slurm, journal2).recover(slurm.snapshot())
    assert journal2.open_plans() == []
    for job in slurm.snapshot().jobs:
        assert not job.held, f"job {job.job_id} left held after a crash at {step}"
        assert job.state in (JobState.RUNNING, JobState.PENDING)
    first = next(o for o in outcomes if o.job_id == job_id)
    if step == "open":
        assert first.status == ROLLED_BACK
    else:
        # The plan that had taken a step is finished; a later plan still at 'open' is rolled back.
        assert first.status == DONE and slurm.jobs[job_id].gpus == 4
        assert {o.status for o in outcomes} <= {DONE, ROLLED_BACK}


def test_recovery_abandons_plans_of_jobs_that_ended(setup):
    slurm, job_id, journal = setup
    with pytest.raises(SimulatedCrash):
        _protocol(slurm, journal, crash_after="hold").execute([_shrink_plan(slurm, job_id)], slurm.snapshot())
    slurm.cancel(job_id)
    [out] = _protocol(slurm, journal).recover(slurm.snapshot())
    assert out.status == ABANDONED and journal.open_plans() == []


def test_release_waits_out_the_credential_revocation_second(setup):
    slurm, job_id, journal = setup
    proto = _protocol(slurm, journal)
    at: dict[str, float] = {}
    for verb in ("requeue_hold", "release"):
        real = getattr(slurm, verb)

        def spy(jid, _real=real, _verb=verb):
            at[_verb] = proto._clock()
            return _real(jid)
        setattr(slurm, verb, spy)
    [out] = proto.execute([_shrink_plan(slurm, job_id)], slurm.snapshot())
    assert out.status == DONE
    assert at["release"] - at["requeue_hold"] >= ProtocolSettings().credential_gap_s


# -- every step re-observes the job (issue 14, class 2) -----------------------------------------------------
def test_a_job_cancelled_during_the_ack_wait_is_abandoned_and_never_requeued(setup):
    slurm, job_id, journal = setup
    slurm.ack = False
    proto = _protocol(slurm, journal, ack_timeout_s=30.0)
    sleep = proto._sleep

    def owner_cancels_during_the_wait(s: float) -> None:
        if proto._clock() >= 1.0 and slurm.jobs[job_id].state is JobState.RUNNING:
            slurm.cancel(job_id)
        sleep(s)
    proto._sleep = owner_cancels_during_the_wait
    [out] = proto.execute([_shrink_plan(slurm, job_id)], slurm.snapshot())
    assert out.status == ABANDONED and "cancelled" in out.note
    assert [v for v, _ in slurm.calls] == ["signal", "cancel"]
    assert slurm.jobs[job_id].state is JobState.CANCELLED
    assert proto._clock() < 10.0, "a cancelled job is not waited for until the ACK deadline"
    assert [s for s, _, _ in journal.steps(out.plan_id)] == ["open", "signal", "ack", ABANDONED]


def test_a_job_held_or_resized_by_someone_else_before_the_hold_is_left_alone(setup):
    slurm, job_id, journal = setup
    real_signal = slurm.signal

    def admin_holds_it_meanwhile(jid: int, sig: str) -> None:
        real_signal(jid, sig)
        slurm.requeue_hold(jid)      # someone else's requeuehold: the job is held, not by us
    slurm.signal = admin_holds_it_meanwhile  # type: ignore[method-assign]
    [out] = _protocol(slurm, journal).execute([_shrink_plan(slurm, job_id)], slurm.snapshot())
    assert out.status == ABANDONED and "held by someone else" in out.note
    assert slurm.jobs[job_id].held, "someone else's hold is theirs to release"
    assert [v for v, _ in slurm.calls] == ["signal", "requeue_hold"]

    other = slurm.add_job(ElasticSpec(1, 4), nodes=1, gpus_per_node=2)
    plan = Plan(job_id=other, from_gpus=2, to_gpus=4, shape=RequestShape(1, 4, 1, 1024), entry=PlanEntry.RUNNING,
                reason="grow")
    snap = slurm.snapshot()
    slurm.jobs[other] = dataclasses.replace(slurm.jobs[other], gpus_per_node=1)   # shrunk in place by an admin
    slurm.calls.clear()
    [out] = _protocol(slurm, journal).execute([plan], snap)
    assert out.status == ABANDONED and "resized by someone else" in out.note
    assert slurm.calls == []


def test_recovery_abandons_a_plan_whose_job_id_now_belongs_to_someone_else(setup):
    slurm, job_id, journal = setup
    with pytest.raises(SimulatedCrash):
        _protocol(slurm, journal, crash_after="signal").execute([_shrink_plan(slurm, job_id)], slurm.snapshot())
    slurm.jobs[job_id] = dataclasses.replace(slurm.jobs[job_id], user="mallory")   # a new cluster reused the id
    slurm.calls.clear()
    [out] = _protocol(slurm, journal).recover(slurm.snapshot())
    assert out.status == ABANDONED and "mallory" in out.note
    assert slurm.calls == []


def test_a_queued_job_that_started_before_its_hold_is_not_requeued(setup):
    slurm, job_id, journal = setup
    queued = slurm.add_job(ElasticSpec(1, 4), nodes=1, gpus_per_node=4, run=False)
    slurm.jobs[queued] = dataclasses.replace(slurm.jobs[queued], reason="Resources")
    plan = Plan(job_id=queued, from_gpus=4, to_gpus=2, shape=RequestShape(1, 2, 1, 1024), entry=PlanEntry.PENDING,
                reason="queued job resized to what fits now")
    snap = slurm.snapshot()
    slurm.jobs[queued] = dataclasses.replace(slurm.jobs[queued], state=JobState.RUNNING, nodes=("n4",))
    [out] = _protocol(slurm, journal).execute([plan], snap)
    assert out.status == ABANDONED and "started before it could be held" in out.note
    assert slurm.jobs[queued].state is JobState.RUNNING and slurm.jobs[queued].restarts == 0


@pytest.mark.parametrize("ran_before", [True, False])
def test_a_queued_job_that_has_run_is_released_after_the_credential_gap(setup, ran_before):
    """Requeued a moment ago by its owner or Slurm (restarts > 0), its credential may be revoked within this
    second: released at once onto the same node it fails as non-startable (22.05). One that never ran has
    no credential to wait out."""
    slurm, job_id, journal = setup
    slurm.schedule = lambda: None          # it stays queued: only the order of the calls matters here
    queued = slurm.add_job(ElasticSpec(1, 4), nodes=1, gpus_per_node=4, run=False)
    slurm.jobs[queued] = dataclasses.replace(slurm.jobs[queued], reason="None", restarts=1 if ran_before else 0)
    proto = _protocol(slurm, journal)
    at: dict[str, float] = {}
    for verb in ("set_resources", "release"):
        real = getattr(slurm, verb)

        def spy(*args, _real=real, _verb=verb, **kwargs):
            at[_verb] = proto._clock()
            return _real(*args, **kwargs)
        setattr(slurm, verb, spy)
    plan = Plan(job_id=queued, from_gpus=4, to_gpus=4, shape=RequestShape(1, 4, 1, 1024), entry=PlanEntry.PENDING,
                reason="queued job placed on n4", place=("n4",))
    [out] = proto.execute([plan], slurm.snapshot())
    assert out.status == DONE
    waited = at["release"] - at["set_resources"]
    assert waited >= ProtocolSettings().credential_gap_s if ran_before else waited < ProtocolSettings().credential_gap_s


def test_may_act_stops_a_plan_before_its_first_step(setup):
    slurm, job_id, journal = setup
    proto = RequeueProtocol(slurm, journal, ProtocolSettings(ack_timeout_s=1.0),
                            may_act=lambda: "the admin daemon (pid 1 on h) is running")
    [out] = proto.execute([_shrink_plan(slurm, job_id)], slurm.snapshot())
    assert out.status == ABANDONED and "admin daemon" in out.note
    assert slurm.calls == [] and slurm.jobs[job_id].gpus == 8


def _geometry_file(slurm: FakeSlurm, job_id: int, world: int, valid: list[int]) -> str:
    job = slurm.jobs[job_id]
    path = shim.geometry_path(job.spec.ckpt_dir, shim.job_key(job_id))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(shim.Geometry(world, tuple(valid), global_batch=24, micro_batch=3).to_bytes())
    return path


@pytest.fixture
def own_job(tmp_path):
    """A job of the user running the tests (only its owner's geometry.json is believed), its ranks never ACK."""
    slurm = FakeSlurm(ack=False)
    spec = ElasticSpec(4, 8, gpu_step=4, ckpt_dir=str(tmp_path / "ckpt"))
    job_id = slurm.add_job(spec, nodes=2, gpus_per_node=4, user=getpass.getuser())
    return slurm, job_id, Journal(tmp_path / "journal.sqlite")


def test_a_geometry_exit_ends_the_ack_wait_at_once(own_job):
    slurm, job_id, journal = own_job
    _geometry_file(slurm, job_id, 8, [1, 2, 3, 4, 6])     # 24 samples cannot be split over 8: exit 87
    proto = _protocol(slurm, journal, ack_timeout_s=60.0)
    [out] = proto.execute([_shrink_plan(slurm, job_id)], slurm.snapshot())
    assert out.status == DONE and out.acked is False and slurm.jobs[job_id].gpus == 4
    assert proto._clock() < 10.0                           # not the 60 s ACK timeout
    assert "exited 87 on a bad batch geometry" in [n for s, _, n in journal.steps(out.plan_id) if s == "ack"][0]


@pytest.mark.parametrize("case", ["valid-size", "other-size", "earlier-start", "someone-else"])
def test_a_geometry_file_that_says_nothing_about_this_start_does_not_end_the_wait(own_job, case):
    slurm, job_id, journal = own_job
    path = _geometry_file(slurm, job_id, 8 if case != "other-size" else 4,
                          [1, 2, 4, 8] if case == "valid-size" else [1, 2, 3, 4, 6])
    if case == "earlier-start":
        os.utime(path, (0, 0))                              # written before this start (at 1e6 s)
    if case == "someone-else":
        slurm.jobs[job_id] = dataclasses.replace(slurm.jobs[job_id], user_id=os.getuid() + 1)
    proto = _protocol(slurm, journal, ack_timeout_s=60.0)
    [out] = proto.execute([_shrink_plan(slurm, job_id)], slurm.snapshot())
    assert out.acked is False and proto._clock() >= 60.0


class _SlurmThatStartsTheJobAsItIsHeld(FakeSlurm):
    """Slurm starts the queued job in the instant the hold arrives: real Slurm takes the hold of a running job,
    invisible while it runs (job_held) and carried into its next requeue as priority 0; a release clears it
    (both seen live on 22.05)."""

    def __init__(self) -> None:
        super().__init__()
        self.carried: set[int] = set()

    def schedule(self) -> None:
        """Nothing starts but by `hold` here."""

    def hold(self, job_id: int) -> None:
        self.jobs[job_id] = dataclasses.replace(self.jobs[job_id], state=JobState.RUNNING, nodes=("n4",))
        self.carried.add(job_id)

    def release(self, job_id: int) -> None:
        self.carried.discard(job_id)
        super().release(job_id)


def test_a_queued_job_that_started_under_its_hold_is_released_so_no_later_requeue_leaves_it_held(tmp_path):
    slurm = _SlurmThatStartsTheJobAsItIsHeld()
    journal = Journal(tmp_path / "journal.sqlite")
    queued = slurm.add_job(ElasticSpec(1, 4), nodes=1, gpus_per_node=4, run=False)
    slurm.jobs[queued] = dataclasses.replace(slurm.jobs[queued], reason="Resources")
    plan = Plan(job_id=queued, from_gpus=4, to_gpus=2, shape=RequestShape(1, 2, 1, 1024), entry=PlanEntry.PENDING,
                reason="queued job resized to what fits now")
    [out] = _protocol(slurm, journal).execute([plan], slurm.snapshot())
    assert out.status in (ABANDONED, ROLLED_BACK) and "started before it could be held" in out.note
    assert slurm.jobs[queued].state is JobState.RUNNING and queued not in slurm.carried


def test_a_job_that_ignored_its_last_signal_holds_the_next_cycle_for_a_short_wait_only(tmp_path):
    """A job that never acknowledges (an adversarial probe: alice's script ignores the signal) held every cycle
    it was planned in, and every other job's plan of that cycle, for the whole ACK timeout. Once is its due;
    after that its wait is IGNORED_SIGNAL_WAIT_S, and an honest job planned beside it is requeued soon after
    its own ACK."""
    from slurm_elastic.control.protocol import IGNORED_SIGNAL_WAIT_S

    slurm = FakeSlurm(nodes=4)
    spec = ElasticSpec(4, 8, gpu_step=4, ckpt_dir=str(tmp_path / "ckpt"))
    alice = slurm.add_job(spec, nodes=2, gpus_per_node=4, user="alice")
    bob = slurm.add_job(spec, nodes=2, gpus_per_node=4, user="bob")
    real_signal = slurm.signal

    def signal(job_id, name):
        if job_id != alice:            # alice's script ignores the signal: no ACK, ever
            real_signal(job_id, name)
    slurm.signal = signal
    journal = Journal(tmp_path / "journal.sqlite")
    proto = _protocol(slurm, journal, ack_timeout_s=60.0)

    def shrink(job_id):
        job = slurm.jobs[job_id]
        return Plan(job_id=job_id, from_gpus=job.gpus, to_gpus=4, shape=RequestShape(1, 4, 1, 1024),
                    entry=PlanEntry.RUNNING, reason="shrink", user=job.user)

    t0 = proto._clock()
    [first] = proto.execute([shrink(alice)], slurm.snapshot())
    assert first.acked is False and proto._clock() - t0 >= 60.0          # the whole timeout, once
    grow = Plan(job_id=alice, from_gpus=slurm.jobs[alice].gpus, to_gpus=8, shape=RequestShape(2, 4, 1, 1024),
                entry=PlanEntry.RUNNING, reason="grow", user="alice")
    t1 = proto._clock()
    outcomes = proto.execute([grow, shrink(bob)], slurm.snapshot())
    assert {o.job_id: o.acked for o in outcomes} == {alice: False, bob: True}
    assert proto._clock() - t1 < IGNORED_SIGNAL_WAIT_S + 5.0            # not another 60 s for bob's plan
