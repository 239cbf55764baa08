"""A cycle gives what elastic jobs borrowed back to a pending rigid job, and Slurm starts the rigid job there."""

from __future__ import annotations

import time

from slurm_elastic.allocate.from_state import RigidPolicy
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.model import JobState
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.protocol import ProtocolSettings
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler
from slurm_elastic.spec import ElasticSpec


class Clock:
    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.time() + self.skipped

    def sleep(self, s: float) -> None:
        self.skipped += s


def _filled(tmp_path, rules: RigidPolicy = RigidPolicy()) -> tuple[InMemorySlurm, Reconciler, int]:
    """Two 4-GPU nodes, all 8 GPUs held by one elastic job of minimum 2."""
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    elastic = slurm.add_job(ElasticSpec(2, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=2, gpus_per_node=4)
    clock = Clock()
    config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.5, settle_timeout_s=1.0), node_confirm_s=0,
                              min_resize_interval_s=0, rigid=rules)
    return slurm, Reconciler(slurm, Journal(tmp_path / "j.sqlite"), config, clock=clock, sleep=clock.sleep), elastic


def test_a_rigid_job_needing_a_whole_node_starts_once_the_elastic_job_shrinks(tmp_path):
    slurm, rec, elastic = _filled(tmp_path)
    rigid = slurm.add_job(None, nodes=1, gpus_per_node=4)
    assert slurm.jobs[rigid].state is JobState.PENDING
    report = rec.cycle()
    assert report.waits[rigid].startswith(f"gave 4 GPUs back to job {rigid} (rigid, priority ")
    assert report.target(elastic) == 4
    rec.cycle()                                      # the elastic job's requeue has completed: Slurm started both
    assert slurm.jobs[rigid].state is JobState.RUNNING
    assert slurm.jobs[elastic].state is JobState.RUNNING and slurm.jobs[elastic].gpus == 4
    assert not set(slurm.jobs[rigid].nodes) & set(slurm.jobs[elastic].nodes)


def test_a_rigid_job_that_would_need_an_elastic_minimum_waits_and_says_why(tmp_path):
    slurm, rec, elastic = _filled(tmp_path)
    rigid = slurm.add_job(None, nodes=2, gpus_per_node=4)
    report = rec.cycle()
    assert report.target(elastic) == 8
    assert report.waits[rigid] == f"rigid job {rigid} waits: elastic jobs' minimums (2 GPUs) are protected from it"
    assert slurm.jobs[rigid].state is JobState.PENDING


def test_elastic_jobs_keep_what_they_borrowed_from_a_partition_the_site_did_not_list(tmp_path):
    slurm, rec, elastic = _filled(tmp_path, RigidPolicy(partitions=("debug",)))
    rigid = slurm.add_job(None, nodes=1, gpus_per_node=4)
    report = rec.cycle()
    assert report.target(elastic) == 8 and rigid not in report.waits


def test_a_rigid_job_does_not_wait_for_an_elastic_jobs_hysteresis(tmp_path):
    """The hold after a start guards against churn; GPUs a rigid job is waiting for go back at once."""
    clock = Clock()
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4, clock=clock)
    elastic = slurm.add_job(ElasticSpec(2, 8, ckpt_dir=str(tmp_path / "ckpt")), nodes=2, gpus_per_node=4)
    config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.5, settle_timeout_s=1.0), node_confirm_s=0,
                              min_resize_interval_s=300.0)
    rec = Reconciler(slurm, Journal(tmp_path / "j.sqlite"), config, clock=clock, sleep=clock.sleep)
    assert rec.cycle(dry_run=True).waits[elastic].startswith("hysteresis: started")   # inside its hold
    rigid = slurm.add_job(None, nodes=1, gpus_per_node=4)
    report = rec.cycle()
    assert report.target(elastic) == 4, report.waits
    rec.cycle()
    assert slurm.jobs[rigid].state is JobState.RUNNING


def test_elastic_jobs_just_started_still_yield_to_a_rigid_job_down_to_their_minimums(tmp_path):
    """Seen live: hysteresis and measure-first kept one job at 8, so the other went back to the queue (8 -> 0)
    though both minimums fit beside the rigid job. A rigid job's claim is above the rules among elastic jobs."""
    slurm = InMemorySlurm(nodes=4, gpus_per_node=4)
    ids = [slurm.add_job(ElasticSpec(4, 8, gpu_step=4, ckpt_dir=str(tmp_path / "ckpt")), nodes=2, gpus_per_node=4)
           for _ in range(2)]

    def sleep(s: float) -> None:
        slurm.now += s
    config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.5, settle_timeout_s=1.0), node_confirm_s=0,
                              min_resize_interval_s=300)
    rec = Reconciler(slurm, Journal(tmp_path / "j.sqlite"), config, clock=lambda: slurm.now, sleep=sleep)
    first = rec.cycle()
    assert {first.target(j) for j in ids} == {8} and set(first.pinned) == set(ids)   # just started: kept
    rigid = slurm.add_job(None, nodes=2, gpus_per_node=4)
    report = rec.cycle()
    assert [report.target(j) for j in ids] == [4, 4], report.waits
    rec.cycle()
    assert slurm.jobs[rigid].state is JobState.RUNNING
    assert all(slurm.jobs[j].state is JobState.RUNNING and slurm.jobs[j].gpus == 4 for j in ids)


def test_a_protected_minimum_is_not_met_by_sending_a_lighter_job_back_to_the_queue(tmp_path):
    """Seen live: with unequal weights the solver met the rigid job's claim by taking one job 8 -> 0 (one
    restart) rather than both 8 -> 4; that gave the rigid job the first job's protected minimum."""
    slurm = InMemorySlurm(nodes=4, gpus_per_node=4)
    ids = [slurm.add_job(ElasticSpec(4, 8, gpu_step=4, weight=w, ckpt_dir=str(tmp_path / "ckpt")), nodes=2,
                         gpus_per_node=4) for w in (1.0, 10.0)]
    config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.5, settle_timeout_s=1.0), node_confirm_s=0,
                              min_resize_interval_s=0)
    rec = Reconciler(slurm, Journal(tmp_path / "j.sqlite"), config, clock=lambda: slurm.now)
    slurm.add_job(None, nodes=2, gpus_per_node=4)
    report = rec.cycle(dry_run=True)
    assert [report.target(j) for j in ids] == [4, 4], [p.describe() for p in report.plans]


def test_the_metrics_count_the_gpus_given_back_and_the_rigid_jobs_that_wait(tmp_path):
    from prometheus_client import generate_latest

    from slurm_elastic.control.metrics import ControllerMetrics

    slurm, rec, _ = _filled(tmp_path)
    metrics = ControllerMetrics()
    slurm.add_job(None, nodes=1, gpus_per_node=4)
    metrics.observe(rec.cycle(dry_run=True))
    text = generate_latest(metrics.registry).decode()
    assert "slurm_elastic_rigid_gpus_given_back 4.0" in text
    assert 'slurm_elastic_rigid_jobs{status="given"} 1.0' in text
    assert 'slurm_elastic_rigid_jobs{status="waiting"} 0.0' in text

    slurm, rec, _ = _filled(tmp_path / "protected")
    slurm.add_job(None, nodes=2, gpus_per_node=4)          # would need the elastic job's protected minimum
    metrics.observe(rec.cycle(dry_run=True))
    text = generate_latest(metrics.registry).decode()
    assert "slurm_elastic_rigid_gpus_given_back 0.0" in text
    assert 'slurm_elastic_rigid_jobs{status="given"} 0.0' in text
    assert 'slurm_elastic_rigid_jobs{status="waiting"} 1.0' in text


def test_an_elastic_job_moves_off_the_node_a_rigid_job_needs_when_its_size_stays(tmp_path):
    """The solve keeps the elastic job at 2 GPUs but not where it runs: it gave the rigid job that node's GPUs.
    A plan that only compared GPU counts left it there and the rigid job waited for good (seen live,
    benchmarks/controller_recovery.py)."""
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    slurm.add_job(None, nodes=1, gpus_per_node=3)                   # n1: 3 of 4 GPUs
    elastic = slurm.add_job(ElasticSpec(1, 2, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=2)
    assert slurm.jobs[elastic].state is JobState.RUNNING
    held = set(slurm.jobs[elastic].nodes)
    rigid = slurm.add_job(None, nodes=1, gpus_per_node=3)           # fits only where the elastic job runs
    assert slurm.jobs[rigid].state is JobState.PENDING
    clock = Clock()
    config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.5, settle_timeout_s=1.0), node_confirm_s=0,
                              min_resize_interval_s=0)
    rec = Reconciler(slurm, Journal(tmp_path / "j.sqlite"), config, clock=clock, sleep=clock.sleep)
    report = rec.cycle()
    assert [p.job_id for p in report.plans] == [elastic], report.plans
    rec.cycle()
    assert slurm.jobs[rigid].state is JobState.RUNNING, slurm.jobs[rigid]
    assert set(slurm.jobs[rigid].nodes) == held
    assert slurm.jobs[elastic].state is JobState.RUNNING and slurm.jobs[elastic].gpus == 2    # 1 + 1 beside it


def test_with_a_submitted_guarantee_a_later_rigid_job_gets_only_what_the_elastic_job_grew_into(tmp_path):
    """With `--elastic-guarantee submitted` an elastic job keeps the size it was submitted at (8 here; Slurm
    started it there, the controller grew it to 12, the journal says from what) from rigid jobs submitted
    later, as Slurm would have for a rigid job of 8: a rigid job of one node starts, one of two waits."""
    def run(rules: RigidPolicy, rigid_nodes: int) -> tuple[InMemorySlurm, int, int, dict[int, str]]:
        slurm = InMemorySlurm(nodes=3, gpus_per_node=4)
        elastic = slurm.add_job(ElasticSpec(1, 12, ckpt_dir=str(tmp_path / "ckpt")), nodes=2, gpus_per_node=4)
        assert slurm.jobs[elastic].state is JobState.RUNNING        # started at once: never seen pending
        clock = Clock()
        config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.5, settle_timeout_s=1.0),
                                  node_confirm_s=0, min_resize_interval_s=0, rigid=rules)
        rec = Reconciler(slurm, Journal(tmp_path / f"j-{rules.guarantee}-{rigid_nodes}.sqlite"), config,
                         clock=clock, sleep=clock.sleep)
        rec.cycle()                                   # grown to 12
        rec.cycle()
        assert slurm.jobs[elastic].state is JobState.RUNNING and slurm.jobs[elastic].gpus == 12
        rigid = slurm.add_job(None, nodes=rigid_nodes, gpus_per_node=4)
        waits = rec.cycle().waits
        rec.cycle()
        return slurm, elastic, rigid, waits

    guaranteed = RigidPolicy(guarantee="submitted")
    slurm, elastic, rigid, waits = run(guaranteed, 2)
    assert waits[rigid] == f"rigid job {rigid} waits: elastic jobs' guarantees (8 GPUs) are protected from it"
    assert slurm.jobs[rigid].state is JobState.PENDING and slurm.jobs[elastic].gpus == 12
    slurm, elastic, rigid, _ = run(guaranteed, 1)
    assert slurm.jobs[rigid].state is JobState.RUNNING and slurm.jobs[elastic].gpus == 8
    slurm, elastic, rigid, _ = run(RigidPolicy(), 2)          # the default keeps only the minimum
    assert slurm.jobs[rigid].state is JobState.RUNNING and slurm.jobs[elastic].gpus == 4
