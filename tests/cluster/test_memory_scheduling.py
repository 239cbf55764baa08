"""The in-memory Slurm starts pending jobs as Slurm does: priority order, partitions, backfill behind a reservation."""

from __future__ import annotations

from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.model import JobState


def _busy_cluster(limit_s: float = 1000.0) -> InMemorySlurm:
    """Two 4-GPU nodes, each filled by a rigid job with a time limit (n1 ends first)."""
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    slurm.add_job(None, nodes=1, gpus_per_node=4, time_limit_s=limit_s)
    slurm.now += 100
    slurm.add_job(None, nodes=1, gpus_per_node=4, time_limit_s=limit_s)
    return slurm


def test_default_priority_follows_submission_order_as_priority_basic_numbers_it():
    slurm = InMemorySlurm(nodes=1)
    first = slurm.add_job(None, nodes=1, gpus_per_node=1)
    second = slurm.add_job(None, nodes=1, gpus_per_node=1)
    assert slurm.jobs[first].priority == 4294901759
    assert slurm.jobs[first].priority > slurm.jobs[second].priority


def test_a_higher_priority_job_starts_before_an_older_one():
    slurm = _busy_cluster()
    old = slurm.add_job(None, nodes=1, gpus_per_node=4, priority=10)
    urgent = slurm.add_job(None, nodes=1, gpus_per_node=4, priority=50)
    slurm.finish(101)
    assert slurm.jobs[urgent].state is JobState.RUNNING and slurm.jobs[urgent].nodes == ("n1",)
    assert slurm.jobs[old].state is JobState.PENDING and slurm.jobs[old].reason == "Resources"


def test_a_small_job_does_not_jump_a_waiting_large_one_unless_it_ends_before_the_reservation():
    slurm = _busy_cluster()
    big = slurm.add_job(None, nodes=2, gpus_per_node=4, priority=100)
    slurm.finish(101)                                     # n1 is free; the big job also needs n2 (ends at +1100)
    assert slurm.reservation is not None and slurm.reservation.job_id == big
    assert slurm.reservation.start == slurm.jobs[102].expected_end
    assert slurm.reservation.nodes == {"n1", "n2"}
    long = slurm.add_job(None, nodes=1, gpus_per_node=2, priority=50, time_limit_s=5000)
    unlimited = slurm.add_job(None, nodes=1, gpus_per_node=2, priority=50)
    assert slurm.jobs[long].state is JobState.PENDING and slurm.jobs[long].reason == "Priority"
    assert slurm.jobs[unlimited].state is JobState.PENDING
    short = slurm.add_job(None, nodes=1, gpus_per_node=2, priority=1, time_limit_s=500)
    assert slurm.jobs[short].state is JobState.RUNNING     # backfilled: ends before the big job could start
    assert slurm.jobs[big].state is JobState.PENDING


def test_backfill_uses_nodes_outside_the_reservation_whatever_its_length():
    slurm = InMemorySlurm(nodes=4, gpus_per_node=4)
    slurm.add_job(None, nodes=1, gpus_per_node=4, time_limit_s=1000)       # n1
    slurm.add_job(None, nodes=1, gpus_per_node=4)                          # n2, no time limit
    slurm.add_job(None, nodes=1, gpus_per_node=2)                          # n3, half of it
    big = slurm.add_job(None, nodes=3, gpus_per_node=4, priority=FIRST + 1)
    assert slurm.jobs[big].state is JobState.PENDING
    # At the latest every job has ended (no time limit: never before); the first nodes that fit then.
    assert slurm.reservation is not None and slurm.reservation.nodes == {"n1", "n2", "n4"}
    assert slurm.reservation.start == float("inf")
    whole = slurm.add_job(None, nodes=1, gpus_per_node=4)
    assert slurm.jobs[whole].state is JobState.PENDING        # n4 is free, but it is the big job's
    half = slurm.add_job(None, nodes=1, gpus_per_node=2)
    assert slurm.jobs[half].nodes == ("n3",)                  # outside the reservation: no time limit needed


def test_a_job_runs_only_on_nodes_of_its_partition():
    slurm = InMemorySlurm(nodes=1, gpus_per_node=4)
    slurm.add_node("big1", gpus=8, cpus=64, mem_mb=512000, partitions=("big",))
    j = slurm.add_job(None, nodes=1, gpus_per_node=2, partition="big")
    assert slurm.jobs[j].nodes == ("big1",)
    k = slurm.add_job(None, nodes=1, gpus_per_node=8)          # partition gpu: n1 has 4 GPUs
    assert slurm.jobs[k].state is JobState.PENDING


FIRST = 4294901759


def test_behind_a_reservation_no_running_job_ends_for_a_job_with_a_time_limit_still_backfills():
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    slurm.add_job(None, nodes=1, gpus_per_node=2)                            # n1, no time limit
    big = slurm.add_job(None, nodes=2, gpus_per_node=4, priority=FIRST + 1)
    assert slurm.reservation is not None and slurm.reservation.start == float("inf")
    unlimited = slurm.add_job(None, nodes=1, gpus_per_node=2)
    limited = slurm.add_job(None, nodes=1, gpus_per_node=2, time_limit_s=3600)
    assert slurm.jobs[unlimited].state is JobState.PENDING
    assert slurm.jobs[limited].state is JobState.RUNNING and slurm.jobs[big].state is JobState.PENDING
