"""A plan starts its job on the nodes the solve chose (ReqNodeList), so jobs released in one cycle do not
take each other's nodes: Slurm's first fit, in priority order, put a higher-priority job released beside a
grow on the grow's nodes, and the grown job waited a cycle with no GPUs, then shrank."""

from __future__ import annotations

import dataclasses

from slurm_elastic.allocate.from_state import away_from_lost_nodes, job_request
from slurm_elastic.allocate.problem import Allocation
from slurm_elastic.cluster.cli_backend import update_args
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.model import ClusterState, JobState
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.cluster.slurm_values import SlurmVersion
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.plan import Plan, PlanEntry, make_plans
from slurm_elastic.control.protocol import ProtocolSettings, RequeueProtocol
from slurm_elastic.spec import ElasticSpec
from tests.control.test_protocol import FakeClock


def _running(slurm: InMemorySlurm, job_id: int, nodes: tuple[str, ...]) -> None:
    job = slurm.jobs[job_id]
    slurm.jobs[job_id] = dataclasses.replace(job, state=JobState.RUNNING, nodes=nodes, num_nodes=len(nodes),
                                             reason="None", start_time=slurm.now)
    slurm._recount()


def _fragmented(tmp_path) -> tuple[InMemorySlurm, int, int]:
    """n1: job A (2 GPUs, the higher priority); n2: job B (4); n3: a rigid job's 2 GPUs; n4: a rigid job's 4."""
    slurm = InMemorySlurm(nodes=4, gpus_per_node=4)
    a = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=2, run=False)
    b = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4, run=False)
    r2 = slurm.add_job(None, nodes=1, gpus_per_node=2, run=False)
    r4 = slurm.add_job(None, nodes=1, gpus_per_node=4, run=False)
    for job, nodes in ((a, ("n1",)), (b, ("n2",)), (r2, ("n3",)), (r4, ("n4",))):
        _running(slurm, job, nodes)
    return slurm, a, b


def _plan(slurm: InMemorySlurm, job_id: int, shape: RequestShape, place: tuple[str, ...], reason: str) -> Plan:
    job = slurm.jobs[job_id]
    return Plan(job_id=job_id, from_gpus=job.gpus, to_gpus=shape.gpus, shape=shape, entry=PlanEntry.RUNNING,
                reason=reason, user=job.user, place=place)


def test_jobs_released_in_one_cycle_start_on_the_nodes_their_plans_name(tmp_path):
    slurm, a, b = _fragmented(tmp_path)
    plans = [_plan(slurm, a, RequestShape(1, 2, 1, 1024), ("n3",), "move"),
             _plan(slurm, b, RequestShape(2, 4, 1, 1024), ("n1", "n2"), "grow")]
    clock = FakeClock()
    protocol = RequeueProtocol(slurm, Journal(tmp_path / "j.sqlite"),
                               ProtocolSettings(ack_timeout_s=1.0, settle_timeout_s=1.0), clock=clock,
                               sleep=clock.sleep)
    outcomes = protocol.execute(plans, slurm.snapshot())
    assert [o.status for o in outcomes] == ["done", "done"]
    # A is released first (plans go in job order) and has the higher priority: on Slurm's first fit it
    # took n1, and B found one node with 4 free GPUs where it needed two.
    assert slurm.jobs[a].state is JobState.RUNNING and slurm.jobs[a].nodes == ("n3",)
    assert slurm.jobs[b].state is JobState.RUNNING and set(slurm.jobs[b].nodes) == {"n1", "n2"}
    assert slurm.jobs[b].required_nodes == ("n1", "n2")


def test_a_plan_names_the_nodes_of_its_placement_and_none_where_they_are_not_its_shape(tmp_path):
    slurm, a, b = _fragmented(tmp_path)
    state = slurm.snapshot()
    allocation = _allocation({str(a): 2, str(b): 8}, {str(a): {"n3": 2}, str(b): {"n1": 4, "n2": 4}})
    by_job = {p.job_id: p for p in make_plans(state, allocation, _shape)}
    assert by_job[a].place == ("n3",) and set(by_job[b].place) == {"n1", "n2"}
    constrained = dataclasses.replace(state.job(b), constraint="a100")
    state = dataclasses.replace(state, jobs=tuple(constrained if j.job_id == b else j for j in state.jobs))
    assert {p.job_id: p.place for p in make_plans(state, allocation, _shape)}[b] == ()   # features not modelled
    uneven = _allocation({str(b): 6}, {str(b): {"n1": 4, "n2": 2}})
    [plan] = make_plans(state, uneven, _shape, job_ids=frozenset({b}))
    assert plan.place == ()   # 6 GPUs as 2 x 3 is not the solve's 4 + 2: Slurm chooses, as before


def test_a_queued_job_is_placed_where_the_solve_put_it_until_slurm_starts_it_there(tmp_path):
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    for _ in range(2):
        slurm.add_job(None, nodes=1, gpus_per_node=4)       # both nodes busy: it stays queued
    job = slurm.add_job(ElasticSpec(1, 4, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4)
    allocation = _allocation({str(job): 4}, {str(job): {"n2": 4}})
    [plan] = make_plans(slurm.snapshot(), allocation, _shape)
    assert plan.entry is PlanEntry.PENDING and plan.place == ("n2",) and "placed on n2" in plan.reason
    # an earlier plan's nodes that are no longer where the solve puts it: placed again
    slurm.jobs[job] = dataclasses.replace(slurm.jobs[job], required_nodes=("n1",))
    [plan] = make_plans(slurm.snapshot(), allocation, _shape)
    assert plan.place == ("n2",)
    # already required there: nothing to do
    slurm.jobs[job] = dataclasses.replace(slurm.jobs[job], required_nodes=("n2",))
    assert make_plans(slurm.snapshot(), allocation, _shape) == ()


def test_a_queued_job_the_solve_leaves_waiting_has_an_earlier_plans_nodes_cleared_at_its_size(tmp_path):
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    for _ in range(2):
        slurm.add_job(None, nodes=1, gpus_per_node=4)
    job = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4)
    slurm.jobs[job] = dataclasses.replace(slurm.jobs[job], required_nodes=("n1",))
    [plan] = make_plans(slurm.snapshot(), _allocation({str(job): 0}, {}), _shape)
    assert plan.entry is PlanEntry.PENDING and plan.place == () and plan.shape.gpus == 4
    assert "cleared" in plan.reason
    slurm.jobs[job] = dataclasses.replace(slurm.jobs[job], required_nodes=())
    assert make_plans(slurm.snapshot(), _allocation({str(job): 0}, {}), _shape) == ()


def test_in_a_cycle_that_keeps_nodes_for_a_rigid_job_slurm_chooses_every_plans_nodes(tmp_path):
    slurm, a, b = _fragmented(tmp_path)
    allocation = _allocation({str(a): 2, str(b): 8}, {str(a): {"n3": 2}, str(b): {"n1": 4, "n2": 4}})
    plans = make_plans(slurm.snapshot(), allocation, _shape, given_to_rigid=frozenset({"n4"}))
    assert [p.place for p in plans] == [(), ()]


def test_a_job_a_plan_leaves_queued_is_released_after_the_jobs_placed_beside_it(tmp_path):
    """A is sent back to the queue (no nodes named) and B grows onto A's nodes: released first, A (the higher
    priority) restarted on the first GPUs free and B waited for its named nodes."""
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    spec = ElasticSpec(1, 8, ckpt_dir=str(tmp_path / "ckpt"))
    a = slurm.add_job(spec, nodes=1, gpus_per_node=4, run=False)
    b = slurm.add_job(spec, nodes=1, gpus_per_node=4, run=False)
    _running(slurm, a, ("n1",))
    _running(slurm, b, ("n2",))
    allocation = _allocation({str(a): 0, str(b): 8}, {str(a): {}, str(b): {"n1": 4, "n2": 4}})
    plans = make_plans(slurm.snapshot(), allocation, _shape)
    assert [(p.job_id, p.leaves_queued) for p in plans] == [(b, False), (a, True)]
    clock = FakeClock()
    protocol = RequeueProtocol(slurm, Journal(tmp_path / "j.sqlite"),
                               ProtocolSettings(ack_timeout_s=1.0, settle_timeout_s=1.0), clock=clock,
                               sleep=clock.sleep)
    assert [o.status for o in protocol.execute(plans, slurm.snapshot())] == ["done", "done"]
    assert set(slurm.jobs[b].nodes) == {"n1", "n2"} and slurm.jobs[a].state is JobState.PENDING


def test_slurm_starts_a_job_only_on_all_its_required_nodes_and_never_on_excluded_ones():
    slurm = InMemorySlurm(nodes=3, gpus_per_node=4)
    busy = slurm.add_job(None, nodes=1, gpus_per_node=4)
    assert slurm.jobs[busy].nodes == ("n1",)
    wants = slurm.add_job(None, nodes=2, gpus_per_node=4, run=False)
    slurm.jobs[wants] = dataclasses.replace(slurm.jobs[wants], required_nodes=("n1", "n3"))
    slurm.schedule()
    assert slurm.jobs[wants].state is JobState.PENDING          # n2 and n3 are free, but n1 is not
    slurm.cancel(wants)   # (its backfill reservation holds n1 and n3)
    avoids = slurm.add_job(None, nodes=1, gpus_per_node=4, run=False)
    slurm.jobs[avoids] = dataclasses.replace(slurm.jobs[avoids], excluded_nodes=("n2",))
    slurm.schedule()
    assert slurm.jobs[avoids].nodes == ("n3",)


def test_the_resize_sets_the_required_nodes_and_an_empty_list_clears_them():
    shape = RequestShape(2, 4, 8, 4096)
    assert "ReqNodeList=n1,n2" in update_args(SlurmVersion.parse("22.05.8"), 7, shape, nodes=("n1", "n2"))
    assert "ReqNodeList=" in update_args(SlurmVersion.parse("24.11.5"), 7, shape, nodes=())
    assert not any(a.startswith("ReqNodeList") for a in update_args(SlurmVersion.parse("24.11.5"), 7, shape))


def test_the_solve_keeps_a_job_off_the_nodes_it_excludes_but_where_it_runs(tmp_path):
    slurm = InMemorySlurm(nodes=3, gpus_per_node=4)
    job = slurm.add_job(ElasticSpec(1, 12, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4)
    slurm.jobs[job] = dataclasses.replace(slurm.jobs[job], excluded_nodes=("n1", "n3"))   # it runs on n1
    state = slurm.snapshot()
    [request] = away_from_lost_nodes((job_request(state.job(job)),), state, {})
    assert request.allowed_nodes == frozenset({"n1", "n2"})
    # n3 was excluded by an earlier plan as lost and has come back: the job's next resize readmits it
    [request] = away_from_lost_nodes((job_request(state.job(job)),), state, {}, back={job: frozenset({"n3"})})
    assert request.allowed_nodes is None or request.allowed_nodes == frozenset({"n1", "n2", "n3"})


def _allocation(gpus, placement) -> Allocation:
    return Allocation(gpus=gpus, placement=placement, status="optimal", method="milp", objective=0.0, mip_gap=0.0,
                      bound=0.0, solve_s=0.0)


def _shape(spec: ElasticSpec, gpus: int, placement) -> RequestShape:
    used = [g for g in placement.values() if g > 0]
    if used and all(g == used[0] for g in used) and used[0] * len(used) == gpus:
        return RequestShape(len(used), used[0], spec.cpus_per_gpu or 1, spec.mem_per_gpu_mb or 1024)
    return RequestShape(1, gpus, spec.cpus_per_gpu or 1, spec.mem_per_gpu_mb or 1024)


def test_a_plans_nodes_are_journaled_and_read_back(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    plan = Plan(job_id=7, from_gpus=4, to_gpus=8, shape=RequestShape(2, 4, 1, 1024), entry=PlanEntry.RUNNING,
                reason="grow", user="alice", place=("n2", "n3"))
    plan_id = journal.open_plan(plan, restarts=0)
    [record] = [r for r in journal.plans(limit=10) if r.plan_id == plan_id]
    assert record.plan.place == ("n2", "n3") and record.to_json()["place"] == ["n2", "n3"]


def test_slurms_node_lists_are_read_as_names_from_json_and_text():
    from tests.cluster.captures import load
    from slurm_elastic.cluster.parse_json import parse_jobs
    from slurm_elastic.cluster.parse_text import jobs_from_text
    doc = load("24.11", "squeue.json")
    rec = dict(doc["jobs"][0], required_nodes="n[1-2],n4", excluded_nodes="n3", features="a100")
    [job] = parse_jobs(dict(doc, jobs=[rec]))
    assert job.required_nodes == ("n1", "n2", "n4") and job.excluded_nodes == ("n3",) and job.constraint == "a100"
    text = ("JobId=5 JobName=x UserId=alice(1000) JobState=PENDING Reason=Priority NumNodes=2 NumCPUs=2 "
            "Priority=10 Restarts=0 Requeue=1 Partition=gpu ReqNodeList=n[01-02] ExcNodeList=(null) "
            "Features=(null) TresPerNode=gres:gpu:1")
    [job] = jobs_from_text(text)
    assert job.required_nodes == ("n01", "n02") and job.excluded_nodes == () and job.constraint == ""


def test_the_queued_jobs_a_cycle_leaves_waiting_are_kept_queued_whatever_their_priority(tmp_path):
    """make_plans adds a hold-only plan for each queued elastic job the solve leaves waiting that Slurm would
    start on free GPUs, ahead of the job the cycle resizes in Slurm's queue or behind it (held for its
    resize, that job has priority 0: a live probe's jobs submitted after it took its GPUs); none in a cycle
    that starts nothing, none for a job waiting on a dependency or held by its user."""
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    spec = ElasticSpec(1, 4, ckpt_dir=str(tmp_path / "ckpt"))
    grown = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4, run=False)
    _running(slurm, grown, ("n1",))
    top = slurm.jobs[grown].priority
    ahead = slurm.add_job(spec, nodes=1, gpus_per_node=4, priority=top + 5, run=False)
    waiting = slurm.add_job(spec, nodes=1, gpus_per_node=4, priority=top + 4, run=False)
    behind = slurm.add_job(spec, nodes=1, gpus_per_node=4, priority=top - 5, run=False)
    held = slurm.add_job(spec, nodes=1, gpus_per_node=4, priority=top + 3, held=True, run=False)
    rigid = slurm.add_job(None, nodes=1, gpus_per_node=4, priority=top + 2, run=False)
    slurm.jobs[waiting] = dataclasses.replace(slurm.jobs[waiting], reason="Dependency")
    # as Slurm shows it (a snapshot of the in-memory Slurm would start them: it models no dependency)
    state = ClusterState(nodes=tuple(slurm.nodes.values()), jobs=tuple(slurm.jobs.values()), taken_at=slurm.now)
    others = {str(j): 0 for j in (ahead, waiting, behind, held)}
    plans = make_plans(state, _allocation({str(grown): 8, **others}, {str(grown): {"n1": 4, "n2": 4}}), _shape)
    kept = [p for p in plans if p.keeps_queued]
    assert [p.job_id for p in kept] == [ahead, behind] and rigid not in {p.job_id for p in plans}
    assert kept[0].to_gpus == kept[0].from_gpus == 4 and kept[0].place == () and plans[-1].keeps_queued
    # a cycle that starts or resizes nothing holds nothing
    assert make_plans(state, _allocation({str(grown): 4, **others}, {str(grown): {"n1": 4}}), _shape) == ()


def test_a_queued_job_that_cannot_fit_on_what_the_cycle_could_free_is_not_held(tmp_path):
    """A hold and its release are Slurm calls for each waiting job: one whose shape does not fit on the GPUs
    free now plus every GPU of the jobs the cycle plans for cannot take anything, and is left alone."""
    slurm = InMemorySlurm(nodes=3, gpus_per_node=4)
    grown = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4, run=False)
    _running(slurm, grown, ("n1",))
    rigid = slurm.add_job(None, nodes=1, gpus_per_node=4, run=False)
    _running(slurm, rigid, ("n3",))
    spec = ElasticSpec(4, 12, ckpt_dir=str(tmp_path / "ckpt"))
    two = slurm.add_job(spec, nodes=2, gpus_per_node=4, run=False)      # n1 (freed by the grow) and n2
    three = slurm.add_job(spec, nodes=3, gpus_per_node=4, run=False)    # would need n3 too, which stays busy
    state = ClusterState(nodes=tuple(slurm.nodes.values()), jobs=tuple(slurm.jobs.values()), taken_at=slurm.now)
    plans = make_plans(state, _allocation({str(grown): 8, str(two): 0, str(three): 0},
                                          {str(grown): {"n1": 4, "n2": 4}}), _shape)
    assert [p.job_id for p in plans if p.keeps_queued] == [two]


def test_a_queued_job_kept_back_still_says_why_it_waits(tmp_path):
    """Its hold is not a resize: `status` and the daemon's notes keep telling its user why it is not started
    (before, a job with any plan had no reason, so each cycle that started another job blanked it)."""
    from slurm_elastic.control.reconcile import Reconciler

    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    grown = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4, run=False)
    _running(slurm, grown, ("n1",))
    queued = slurm.add_job(ElasticSpec(4, 4, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4, run=False)
    state = ClusterState(nodes=tuple(slurm.nodes.values()), jobs=tuple(slurm.jobs.values()), taken_at=slurm.now)
    allocation = _allocation({str(grown): 8, str(queued): 0}, {str(grown): {"n1": 4, "n2": 4}})
    plans = make_plans(state, allocation, _shape)
    assert [p.job_id for p in plans if p.keeps_queued] == [queued]
    waits = Reconciler(slurm, Journal(tmp_path / "j.sqlite"))._waits(state, allocation, plans, {}, {}, {}, slurm.now)
    assert waits[queued].startswith("not placeable: its minimum of 4 GPUs does not fit beside the others now")
    assert grown not in waits
