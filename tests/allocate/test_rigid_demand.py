"""Pending rigid jobs take back the GPUs elastic jobs borrowed: whole nodes kept from elastic capacity."""

from __future__ import annotations

import dataclasses

import pytest

from slurm_elastic.allocate.from_state import RigidPolicy, capacity_from_state, reserve_for_rigid
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.model import Job, JobState
from slurm_elastic.spec import ElasticSpec


def _filled() -> tuple[InMemorySlurm, int, int]:
    """Three 4-GPU nodes: elastic job A holds n1+n2 (min 2), elastic job B 2 GPUs of n3 (min 1)."""
    slurm = InMemorySlurm(nodes=3, gpus_per_node=4)
    a = slurm.add_job(ElasticSpec(2, 8), nodes=2, gpus_per_node=4)
    b = slurm.add_job(ElasticSpec(1, 4), nodes=1, gpus_per_node=2)
    return slurm, a, b


def _demand(slurm: InMemorySlurm, rules: RigidPolicy = RigidPolicy(), keeps_ranks=None):
    state = slurm.snapshot()
    return reserve_for_rigid(state, capacity_from_state(state), rules, keeps_ranks=keeps_ranks)


def test_a_pending_rigid_job_gets_the_nodes_that_need_the_fewest_elastic_gpus_to_leave():
    slurm, _, _ = _filled()
    rigid = slurm.add_job(None, nodes=1, gpus_per_node=4)
    assert slurm.jobs[rigid].reason == "Resources"
    demand = _demand(slurm)
    assert [(r.job_id, r.nodes, r.gpus_reclaimed) for r in demand.reserved] == [(rigid, ("n3",), 2)]
    left = {c.name: c.gpus for c in demand.capacity}
    assert left == {"n1": 4, "n2": 4, "n3": 0}
    assert "gave 2 GPUs back to job" in demand.reserved[0].describe()


def test_where_the_gpus_to_take_back_tie_a_rigid_job_gets_nodes_the_elastic_jobs_can_give_up_in_place():
    """Two elastic jobs on two whole nodes each whose ranks go on in their processes: a rigid job for two nodes
    takes the one each job does not run its batch script on, so both shrink keeping their ranks (Slurm never
    takes a running job's batch host). Jobs without that word requeue wherever they shrink: names decide."""
    slurm = InMemorySlurm(nodes=4, gpus_per_node=4)
    a = slurm.add_job(ElasticSpec(4, 8), nodes=2, gpus_per_node=4)
    b = slurm.add_job(ElasticSpec(4, 8), nodes=2, gpus_per_node=4)
    slurm.jobs[b] = dataclasses.replace(slurm.jobs[b], batch_host="n4")
    assert slurm.jobs[a].nodes == ("n1", "n2") and slurm.jobs[b].nodes == ("n3", "n4")
    rigid = slurm.add_job(None, nodes=2, gpus_per_node=4)
    demand = _demand(slurm, keeps_ranks=lambda job: True)
    assert [(r.job_id, r.nodes, r.gpus_reclaimed) for r in demand.reserved] == [(rigid, ("n2", "n3"), 8)]
    # Only toward a job's own nodes: with a's word alone, a's other node first, then the names decide
    # (a word, true or false, never draws the rigid job onto another job's nodes).
    assert [r.nodes for r in _demand(slurm, keeps_ranks=lambda job: job.job_id == a).reserved] == [("n2", "n1")]
    assert [r.nodes for r in _demand(slurm, keeps_ranks=lambda job: job.job_id == b).reserved] == [("n3", "n1")]
    assert [r.nodes for r in _demand(slurm).reserved] == [("n1", "n2")]


def test_without_rigid_demand_capacity_is_what_running_rigid_jobs_leave():
    slurm, _, _ = _filled()
    demand = _demand(slurm)
    assert demand.reserved == () and demand.capacity == capacity_from_state(slurm.snapshot())


def test_elastic_minimums_are_protected_from_a_rigid_job_by_default():
    slurm, a, b = _filled()
    rigid = slurm.add_job(None, nodes=3, gpus_per_node=4, priority=slurm.jobs[a].priority + 1)
    demand = _demand(slurm)
    assert demand.reserved == ()
    assert demand.waiting and demand.waiting[0][0] == rigid and "minimums (3 GPUs) are protected" in demand.waiting[0][1]
    # Not protected: a rigid job of higher priority than both takes their minimums too ...
    demand = _demand(slurm, RigidPolicy(protect_minimum=False))
    assert [r.job_id for r in demand.reserved] == [rigid] and sum(c.gpus for c in demand.capacity) == 0
    # ... but one of lower priority than theirs does not.
    slurm.jobs[rigid] = dataclasses.replace(slurm.jobs[rigid], priority=1)
    assert _demand(slurm, RigidPolicy(protect_minimum=False)).reserved == ()


def test_site_rules_choose_which_rigid_jobs_elastic_jobs_yield_to():
    slurm, _, _ = _filled()
    slurm.add_job(None, nodes=1, gpus_per_node=4)
    assert _demand(slurm, RigidPolicy(partitions=("other",))).reserved == ()
    assert _demand(slurm, RigidPolicy(yield_after_s=600)).reserved == ()
    slurm.now += 600
    assert len(_demand(slurm, RigidPolicy(yield_after_s=600)).reserved) == 1


def test_held_or_not_yet_eligible_rigid_jobs_take_nothing():
    slurm, _, _ = _filled()
    slurm.add_job(None, nodes=1, gpus_per_node=4, held=True, run=False)
    assert _demand(slurm).reserved == ()


def test_it_stops_at_the_first_rigid_job_that_cannot_fit_even_without_elastic_jobs():
    slurm, _, _ = _filled()
    slurm.add_job(None, nodes=4, gpus_per_node=4)        # more nodes than the cluster has
    second = slurm.add_job(None, nodes=1, gpus_per_node=4)   # would fit once n3's elastic job left
    assert slurm.jobs[second].state.name == "PENDING"
    demand = _demand(slurm)
    assert demand.reserved == () and "does not fit" in demand.waiting[0][1]


def test_elastic_jobs_do_not_grow_onto_nodes_slurm_holds_for_a_rigid_job_that_waits_for_rigid_ones():
    slurm = InMemorySlurm(nodes=3, gpus_per_node=4)
    slurm.add_job(None, nodes=1, gpus_per_node=4, time_limit_s=1000)         # n1, rigid
    slurm.add_job(ElasticSpec(1, 8), nodes=1, gpus_per_node=2)              # n2, elastic, 2 of 4
    big = slurm.add_job(None, nodes=3, gpus_per_node=4)
    assert slurm.reservation is not None and slurm.reservation.nodes == {"n1", "n2", "n3"}
    demand = _demand(slurm)
    assert demand.reserved == () and demand.waiting[0][0] == big
    # n3 is idle, but an elastic job started there could not run before the big job: Slurm holds it.
    assert {c.name: c.gpus for c in demand.capacity} == {"n1": 0, "n2": 2, "n3": 0}


def test_a_pending_elastic_job_of_higher_priority_starts_before_a_rigid_job_at_its_minimum():
    """Slurm would start the earlier elastic job first: a rigid job behind it keeps no nodes it needs."""
    slurm = InMemorySlurm(nodes=3, gpus_per_node=4)
    slurm.add_job(ElasticSpec(1, 8), nodes=2, gpus_per_node=4)          # n1+n2, 7 GPUs above its minimum
    slurm.add_job(None, nodes=1, gpus_per_node=4)                       # n3, rigid
    first = slurm.add_job(ElasticSpec(4, 8), nodes=1, gpus_per_node=4)
    rigid = slurm.add_job(None, nodes=1, gpus_per_node=4)
    assert slurm.jobs[first].state is JobState.PENDING and slurm.jobs[rigid].state is JobState.PENDING
    demand = _demand(slurm)
    assert demand.reserved == ()
    assert demand.waiting == ((rigid, "pending elastic jobs of higher priority start first (4 GPUs at their minimums)"),)
    # Of lower priority than the rigid job, it waits behind it, as Slurm would make it.
    slurm.jobs[first] = dataclasses.replace(slurm.jobs[first], priority=slurm.jobs[rigid].priority - 1)
    assert [r.job_id for r in _demand(slurm).reserved] == [rigid]


def test_an_elastic_job_whose_plan_is_open_is_never_taken_for_a_rigid_one():
    """The controller sees a job with an open plan without its spec (it counts as usage of what it holds);
    queued, it was taken for a rigid job: GPUs were kept for it and `rebalance --explain` said "rigid job 8
    waits: elastic jobs' minimums ... are protected from it" of an elastic job (found by a probe)."""
    slurm, _, _ = _filled()
    queued = slurm.add_job(ElasticSpec(2, 16), nodes=1, gpus_per_node=4)
    state = slurm.snapshot()
    masked = dataclasses.replace(state, jobs=tuple(dataclasses.replace(j, spec=None) if j.job_id == queued else j
                                                   for j in state.jobs))
    seen = reserve_for_rigid(masked, capacity_from_state(masked), RigidPolicy())
    assert [r.job_id for r in seen.reserved] == [queued]            # taken for rigid without the word
    demand = reserve_for_rigid(masked, capacity_from_state(masked), RigidPolicy(), planned=frozenset({queued}))
    assert demand.reserved == () and demand.waiting == ()


def test_a_submitted_guarantee_keeps_what_a_rigid_job_of_that_size_would_from_rigid_jobs_of_lower_priority():
    """An elastic job submitted at 8 GPUs and grown to 12 borrowed 4: a later rigid job (lower priority) gets
    those 4, not the 8 a rigid job submitted at 8 would have kept; one of higher priority gets all but the
    minimum. Without the guarantee both get all but the minimum."""
    slurm = InMemorySlurm(nodes=3, gpus_per_node=4)
    elastic = slurm.add_job(ElasticSpec(1, 12), nodes=3, gpus_per_node=4)
    later = slurm.add_job(None, nodes=2, gpus_per_node=4)
    assert slurm.jobs[later].priority < slurm.jobs[elastic].priority
    state = slurm.snapshot()
    guaranteed = RigidPolicy(guarantee="submitted")

    def submitted(job: Job) -> int | None:
        return 8

    def demand(rules: RigidPolicy, sizes=None):
        return reserve_for_rigid(state, capacity_from_state(state), rules, submitted=sizes)

    assert [r.job_id for r in demand(RigidPolicy(), submitted).reserved] == [later]       # the minimum only
    kept = demand(guaranteed, submitted)
    assert kept.reserved == ()
    assert kept.waiting == ((later, "elastic jobs' guarantees (8 GPUs) are protected from it"),)
    # Submitted at 4, it keeps 4; with no size known, its minimum.
    assert [r.job_id for r in demand(guaranteed, lambda job: 4).reserved] == [later]
    assert [r.job_id for r in demand(guaranteed, lambda job: None).reserved] == [later]
    assert [r.job_id for r in demand(guaranteed).reserved] == [later]
    # A rigid job of one node fits beside the 8 kept.
    slurm.jobs[later] = dataclasses.replace(slurm.jobs[later], num_nodes=1)
    state = slurm.snapshot()
    assert [r.job_id for r in demand(guaranteed, submitted).reserved] == [later]
    # Of higher priority than the elastic job's, a rigid job is owed all but the minimum.
    slurm.jobs[later] = dataclasses.replace(slurm.jobs[later], num_nodes=2,
                                            priority=slurm.jobs[elastic].priority + 1)
    state = slurm.snapshot()
    assert [r.job_id for r in demand(guaranteed, submitted).reserved] == [later]


def test_a_guarantee_is_the_minimum_or_the_submitted_size():
    with pytest.raises(ValueError):
        RigidPolicy(guarantee="everything")
