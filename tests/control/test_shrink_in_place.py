"""A shrink on healthy nodes done in place: the job gives up whole nodes and runs on, its ranks kept.

The in-memory Slurm as in test_reconcile_peer_loss.py (keep_nodes as `scontrol update NodeList=`); the
job's word is its batch script's keeps-ranks-J-R file. tests/control/test_peer_loss_live.py does it on
Slurm, with real ranks.
"""

from __future__ import annotations

import dataclasses
import os
import pwd

import pytest

from slurm_elastic.cluster.model import Job, JobState
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.plan import Plan, PlanEntry, nodes_kept
from slurm_elastic.control.protocol import KEPT_SHRINK_NOTE, NOT_SIGNALLED_NOTE, RequeueProtocol
from slurm_elastic.spec import ElasticSpec
from slurm_elastic import jobfiles as shim
from tests.control.test_reconcile_peer_loss import ExcludingSlurm, _reconciler, _report, _write

ME = pwd.getpwuid(os.getuid()).pw_name


def _shared(tmp_path):
    """Elastic job a (4-8 GPUs) on n1+n2, the rest full; then a rigid job asks for a whole node."""
    slurm = ExcludingSlurm()
    ckpt = tmp_path / "ckpt"
    a = slurm.add_job(ElasticSpec(4, 8, gpu_step=4, ckpt_dir=str(ckpt)), nodes=2, gpus_per_node=4, user=ME)
    for _ in range(2):
        slurm.add_job(None, nodes=1, gpus_per_node=4, user="bob")
    assert slurm.jobs[a].nodes == ("n1", "n2")
    return slurm, a, ckpt


def _says_it_keeps_ranks(ckpt, job_id: int, restart: int = 0):
    path = ckpt / str(job_id) / shim.keeps_ranks_file_name(job_id, restart)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("0\n")
    return path


class Crash(BaseException):
    """As a SIGKILL of the controller: nothing of the protocol runs after it."""


def _crash() -> None:
    raise Crash


def _dies_after(rec, clock, step: str) -> None:
    rec.protocol = RequeueProtocol(rec.backend, rec.journal, rec.config.protocol, clock=clock, sleep=clock.sleep,
                                   crash_after=step, crash=_crash)


def _rigid_arrives(slurm, rec) -> int:
    rec.cycle()
    rigid = slurm.add_job(None, nodes=1, gpus_per_node=4, user="bob", priority=10**9)
    assert slurm.jobs[rigid].state is JobState.PENDING
    return rigid


def test_a_job_whose_ranks_go_on_gives_up_a_whole_node_in_place_and_the_rigid_job_starts_there(tmp_path):
    slurm, a, ckpt = _shared(tmp_path)
    _says_it_keeps_ranks(ckpt, a)
    rec, clock = _reconciler(slurm, tmp_path)
    rigid = _rigid_arrives(slurm, rec)
    report = rec.cycle()
    assert [(p.job_id, p.to_gpus, p.keep) for p in report.plans] == [(a, 4, ("n1",))]
    assert report.outcomes[0].status == "done"
    job = slurm.jobs[a]
    assert job.state is JobState.RUNNING and job.nodes == ("n1",) and job.restarts == 0
    verbs = [v for v, j in slurm.calls if j == a]
    assert verbs.count("keep_nodes") == 1 and not {"signal", "requeue_hold", "release", "set_resources"} & set(verbs)
    steps = rec.journal.steps(report.outcomes[0].plan_id)
    assert ("signal", NOT_SIGNALLED_NOTE) in [(s, n) for s, _, n in steps]
    assert ("hold", KEPT_SHRINK_NOTE) in [(s, n) for s, _, n in steps]
    assert clock.skipped < 5.0      # no ACK wait, no credential gap
    slurm.schedule()
    assert slurm.jobs[rigid].state is JobState.RUNNING and slurm.jobs[rigid].nodes == ("n2",)
    # The survivors' report of the ranks Slurm killed names the node given up: nothing to act on.
    _write(ckpt, a, _report(a, lost=("n2",), surviving=("n1",)))
    assert rec.cycle().plans == () and rec.cycle().plans == () and slurm.jobs[a].restarts == 0


def test_a_decision_reads_each_incarnations_word_once():
    """The rigid reservation and the in-place swap may both ask whether a job keeps its ranks: one file
    read per job and incarnation in a decision, and a requeued job's new incarnation is asked again."""
    from slurm_elastic.control.reconcile import _read_once

    reads: list[tuple[int, int]] = []

    def word(job):
        reads.append((job.job_id, job.restarts))
        return job.job_id == 7
    keeps = _read_once(word)
    first, other = (Job(job_id=i, user=ME, name="j", state=JobState.RUNNING) for i in (7, 8))
    assert [keeps(first), keeps(other), keeps(first), keeps(other)] == [True, False, True, False]
    assert reads == [(7, 0), (8, 0)]
    keeps(dataclasses.replace(first, restarts=1))
    assert reads[-1] == (7, 1)


@pytest.mark.parametrize("word", ["absent", "foreign", "link", "old restart"])
def test_without_the_jobs_own_word_the_shrink_is_signalled_and_requeued(tmp_path, word):
    slurm, a, ckpt = _shared(tmp_path)
    if word != "absent":
        path = _says_it_keeps_ranks(ckpt, a, restart=1 if word == "old restart" else 0)
        if word == "foreign":
            os.chown(path, os.getuid() + 4242, -1)
        elif word == "link":
            target = path.with_name("elsewhere")
            path.rename(target)
            path.symlink_to(target)
    rec, _ = _reconciler(slurm, tmp_path)
    _rigid_arrives(slurm, rec)
    report = rec.cycle()
    assert [p.job_id for p in report.plans] == [a]
    verbs = [v for v, j in slurm.calls if j == a]
    assert "signal" in verbs and "requeue_hold" in verbs and "keep_nodes" not in verbs
    assert slurm.jobs[a].restarts == 1


def test_a_refused_shrink_in_place_is_signalled_then_requeued_losing_no_step(tmp_path, monkeypatch):
    slurm, a, ckpt = _shared(tmp_path)
    _says_it_keeps_ranks(ckpt, a)
    rec, _ = _reconciler(slurm, tmp_path)
    _rigid_arrives(slurm, rec)
    from slurm_elastic.errors import SlurmError

    def refuse(job_id, nodes):
        slurm.calls.append(("keep_nodes", job_id))
        raise SlurmError("Requested operation not presently supported")
    monkeypatch.setattr(slurm, "keep_nodes", refuse)
    report = rec.cycle()
    steps = [(s, n) for s, _, n in rec.journal.steps(report.outcomes[0].plan_id)]
    verbs = [v for v, j in slurm.calls if j == a]
    # Signalled at the hold (its ACK waited for), then requeued as any other shrink.
    assert verbs.index("keep_nodes") < verbs.index("signal") < verbs.index("requeue_hold")
    assert steps[:2] == [("open", steps[0][1]), ("signal", NOT_SIGNALLED_NOTE)]
    assert ("hold", f"not shrunk in place: signal {shim.DEFAULT_SIGNAL} sent") in steps
    assert slurm.jobs[a].restarts == 1


def test_a_controller_that_dies_before_the_hold_shrinks_in_place_on_recovery(tmp_path):
    slurm, a, ckpt = _shared(tmp_path)
    _says_it_keeps_ranks(ckpt, a)
    rec, clock = _reconciler(slurm, tmp_path)
    _rigid_arrives(slurm, rec)
    _dies_after(rec, clock, "ack")
    with pytest.raises(Crash):
        rec.cycle()
    assert slurm.jobs[a].nodes == ("n1", "n2")
    rec2, _ = _reconciler(slurm, tmp_path)
    report = rec2.cycle()
    assert [o.status for o in report.recovered] == ["done"]
    assert slurm.jobs[a].nodes == ("n1",) and slurm.jobs[a].restarts == 0
    assert "signal" not in [v for v, j in slurm.calls if j == a]


def _job(nodes, gpn=4):
    return Job(job_id=1, user=ME, name="j", state=JobState.RUNNING, nodes=tuple(nodes), num_nodes=len(nodes),
               gpus_per_node=gpn, spec=ElasticSpec(1, 16))


def test_only_a_shrink_to_whole_nodes_the_job_holds_with_its_first_node_can_be_kept():
    job = _job(("n1", "n2", "n3"))
    assert nodes_kept(job, 8, {"n1": 4, "n3": 4}) == ("n1", "n3")
    assert nodes_kept(job, 4, {"n1": 4}) == ("n1",)
    assert nodes_kept(job, 4, {"n2": 4}) == ()              # the batch script's node would go
    assert nodes_kept(job, 6, {"n1": 4, "n2": 2}) == ()     # part of a node: Slurm cannot take GPUs in place
    assert nodes_kept(job, 8, {"n1": 4, "n4": 4}) == ()     # a node it does not hold: a move
    assert nodes_kept(job, 12, {"n1": 4, "n2": 4, "n3": 4}) == ()   # not a shrink
    assert nodes_kept(job, 0, {}) == ()
    on_n2 = dataclasses.replace(job, batch_host="n2")     # Slurm's batch host, where it is not the first named
    assert nodes_kept(on_n2, 4, {"n2": 4}) == ("n2",) and nodes_kept(on_n2, 4, {"n1": 4}) == ()


def test_the_phases_of_a_shrink_in_place_end_at_the_survivors_first_step(tmp_path):
    import json
    from slurm_elastic.control.phases import last_restart
    from tests.control.test_reconcile_peer_loss import _mark, _report

    ckpt = tmp_path / "ckpt"
    t = 1_800_000_000.0
    job = Job(job_id=7, user=ME, name="j", state=JobState.RUNNING, nodes=("n1",), num_nodes=1, gpus_per_node=1,
              restarts=0, start_time=t - 100, spec=ElasticSpec(1, 2, ckpt_dir=str(ckpt)))
    journal = Journal(tmp_path / "j.sqlite")
    plan = Plan(job_id=7, from_gpus=2, to_gpus=1, shape=RequestShape(1, 1, 1, 1), entry=PlanEntry.RUNNING,
                reason="shrink", user=ME, keep=("n1",))
    pid = journal.open_plan(plan, restarts=0, now=t)
    journal.record(pid, "signal", NOT_SIGNALLED_NOTE, now=t + 0.1)
    journal.record(pid, "hold", now=t + 0.2)
    journal.record(pid, "hold", KEPT_SHRINK_NOTE, now=t + 0.5)
    journal.finish(pid, "done", now=t + 0.6)
    assert journal.plans(7)[0].plan.keep == ("n1",)
    jd = ckpt / "7"
    body = _report(7, lost=("n2",), surviving=("n1",), world=2, detected_at=t + 0.6)
    body["lost"] = [{"rank": 1, "node": "n2"}]
    _mark(jd / shim.peer_lost_file_name(7, 0, 0), t + 1.0, json.dumps(body))
    # An earlier loss of the same step re-formed generation 0; this shrink's group is generation 1's.
    _mark(jd / shim.run_dir_name(7, 0, 0) / shim.REGROUP_FILE, t - 50, json.dumps({"go": True}))
    _mark(jd / (shim.run_dir_name(7, 0, 0) + ".1") / shim.REGROUP_FILE, t + 1.2, json.dumps({"go": True}))
    row = {"step": 42, "time": t + 2.0, "gpus": 1, "nodes": 1, "steps_per_s": 1.0, "samples_per_s": 48.0}
    old = {**row, "step": 40, "time": t - 5, "gpus": 2, "nodes": 2}
    _mark(jd / shim.METRICS_FILE, t + 2.0, json.dumps(old) + "\n" + json.dumps(row) + "\n")
    phases = last_restart(job, journal, owner_uid=os.getuid())
    assert phases is not None and phases.kind == "resize, ranks kept"
    assert phases.phases() == [("plan opened -> nodes given up", 0.5), ("nodes given up -> checkpoint committed", 0.5),
                               ("committed -> group re-formed", 0.2), ("group re-formed -> first step", 0.8)]
    assert phases.total_s() == 2.0


def test_a_shrink_off_the_first_node_keeps_it_instead_where_the_two_nodes_are_alike():
    from slurm_elastic.allocate.problem import Allocation
    from slurm_elastic.cluster.model import ClusterState, Node, NodeState
    from slurm_elastic.control.plan import keep_first_nodes

    def node(name, mem_alloc=2000):
        return Node(name, NodeState.MIXED, cpus=8, cpus_alloc=4, mem_mb=16000, mem_alloc_mb=mem_alloc, gpus=4,
                    gpus_alloc=4, partitions=("gpu",))

    job = _job(("n1", "n2"), gpn=1)
    rigid = Job(job_id=2, user="bob", name="r", state=JobState.RUNNING, nodes=("n1", "n2"), num_nodes=2,
                gpus_per_node=3)
    other = Job(job_id=3, user="bob", name="o", state=JobState.RUNNING, nodes=("n3",), num_nodes=1, gpus_per_node=4,
                spec=ElasticSpec(1, 4))
    state = ClusterState(nodes=(node("n1"), node("n2"), node("n3")), jobs=(job, rigid, other), taken_at=0.0)
    allocation = Allocation(gpus={"1": 1, "3": 5}, placement={"1": {"n2": 1}, "3": {"n3": 4, "n1": 1}},
                            status="optimal", method="milp", objective=1.0, mip_gap=0.0, bound=1.0, solve_s=0.0)
    kept, swapped = keep_first_nodes(state, allocation, lambda j: True)
    # The names swap in every placement: job 3's grow goes to the node job 1 gives up.
    assert kept.placement == {"1": {"n1": 1}, "3": {"n3": 4, "n2": 1}} and kept.gpus == allocation.gpus
    assert swapped == {"n1": "n2", "n2": "n1"}
    assert keep_first_nodes(state, allocation, lambda j: False) == (allocation, {})     # no word: as solved
    unlike = dataclasses.replace(state, nodes=(node("n1"), node("n2", mem_alloc=3000), node("n3")))
    assert keep_first_nodes(unlike, allocation, lambda j: True) == (allocation, {})    # other load on one
    shared = dataclasses.replace(state, jobs=(job, rigid, dataclasses.replace(other, nodes=("n2",))))
    assert keep_first_nodes(shared, allocation, lambda j: True) == (allocation, {})    # another elastic job there


def test_a_controller_that_dies_after_the_fallback_requeue_finishes_it_on_recovery(tmp_path, monkeypatch):
    """Refused in place, signalled and requeued, then SIGKILLed: the hold is the controller's own, so the
    next controller resizes and releases the job (never leaves it held)."""
    from slurm_elastic.errors import SlurmError

    slurm, a, ckpt = _shared(tmp_path)
    _says_it_keeps_ranks(ckpt, a)
    rec, clock = _reconciler(slurm, tmp_path)
    _rigid_arrives(slurm, rec)

    def refuse(job_id, nodes):
        raise SlurmError("Requested operation not presently supported")
    monkeypatch.setattr(slurm, "keep_nodes", refuse)
    _dies_after(rec, clock, "hold")
    with pytest.raises(Crash):
        rec.cycle()
    assert slurm.jobs[a].held
    rec2, _ = _reconciler(slurm, tmp_path)
    report = rec2.cycle()
    assert [o.status for o in report.recovered] == ["done"]
    assert not slurm.jobs[a].held and slurm.jobs[a].restarts == 1


def test_a_crash_between_the_shrink_and_its_journal_row_is_not_requeued_on_recovery(tmp_path, monkeypatch):
    slurm, a, ckpt = _shared(tmp_path)
    _says_it_keeps_ranks(ckpt, a)
    rec, _ = _reconciler(slurm, tmp_path)
    _rigid_arrives(slurm, rec)
    keep = slurm.keep_nodes

    def shrink_then_die(job_id, nodes):
        keep(job_id, nodes)
        raise Crash
    monkeypatch.setattr(slurm, "keep_nodes", shrink_then_die)
    with pytest.raises(Crash):
        rec.cycle()
    monkeypatch.setattr(slurm, "keep_nodes", keep)
    assert slurm.jobs[a].nodes == ("n1",)
    rec2, _ = _reconciler(slurm, tmp_path)
    report = rec2.cycle()
    assert [o.status for o in report.recovered] == ["done"]
    assert slurm.jobs[a].restarts == 0 and "signal" not in [v for v, j in slurm.calls if j == a]


def test_only_a_job_that_can_give_up_nodes_in_place_now_is_priced_a_shrink_in_place(tmp_path):
    from slurm_elastic.cluster.model import NodeFlag
    slurm, a, ckpt = _shared(tmp_path)
    rec, clock = _reconciler(slurm, tmp_path)

    def request():
        return next(r for r in rec.decide(slurm.snapshot(), clock()).problem.jobs if r.key == str(a))

    assert request().in_place_cost_s is None             # no word from its batch script: every resize relaunches
    _says_it_keeps_ranks(ckpt, a)
    req = request()
    assert req.in_place_cost_s is not None and 0 < req.in_place_cost_s < req.restart_cost_s
    assert req.batch_node == "n1"
    # A node of its drained: the plan relaunches it without that node whatever the solve says.
    slurm.nodes["n2"] = dataclasses.replace(slurm.nodes["n2"], flags=frozenset({NodeFlag.DRAIN}))
    assert slurm.jobs[a].state is JobState.RUNNING and request().in_place_cost_s is None
