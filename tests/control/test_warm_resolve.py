"""The controller answers a lost node on a large cluster by the warm path: only the jobs the loss touched
change (allocate/repair.py); its full solve still runs first and on its period."""

from __future__ import annotations

import json

from slurm_elastic.allocate.problem import REPAIRED
from slurm_elastic.allocate.repair import RepairingSolver
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.model import JobState
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.protocol import ProtocolSettings
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler, solve
from slurm_elastic.spec import ElasticSpec
from tests.control.test_rigid_neighbours import Clock


def test_a_lost_node_between_full_solves_changes_only_the_job_that_ran_there(tmp_path):
    slurm = InMemorySlurm(nodes=6, gpus_per_node=4)
    jobs = [slurm.add_job(ElasticSpec(2, 4, ckpt_dir=str(tmp_path / f"c{i}")), nodes=1, gpus_per_node=4)
            for i in range(5)]
    wide = slurm.add_job(ElasticSpec(2, 8, ckpt_dir=str(tmp_path / "wide")), nodes=1, gpus_per_node=4)
    clock = Clock()
    config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.5, settle_timeout_s=1.0), node_confirm_s=0,
                              min_resize_interval_s=0)
    # min_pairs=1: this 6-node cluster stands for a large one, where the warm path is used
    solver = RepairingSolver(min_pairs=1, period_s=3600, clock=clock, full=solve)
    rec = Reconciler(slurm, Journal(tmp_path / "j.sqlite"), config, clock=clock, sleep=clock.sleep,
                     allocator=solver)
    first = rec.cycle()
    assert first.allocation is not None and first.allocation.status != REPAIRED   # the first cycle: in full
    assert all(slurm.jobs[j].state is JobState.RUNNING and slurm.jobs[j].gpus == 4 for j in (*jobs, wide))
    where = {j: tuple(slurm.jobs[j].nodes) for j in (*jobs, wide)}
    victim = jobs[1]
    slurm.node_down(where[victim][0])                       # Slurm requeues the job that ran there
    report = rec.cycle()
    assert report.allocation is not None and report.allocation.status == REPAIRED
    assert {p.job_id for p in report.plans} <= {victim}
    for j in (*jobs, wide):
        if j != victim:
            assert report.target(j) == 4 and tuple(slurm.jobs[j].nodes) == where[j], j
    # a full solve would weigh the requeued job against the others; the warm path leaves them be
    assert report.target(victim) == 0
    # `admin rebalance --json` shows the path; a score it did not compute is null, not NaN
    solver = json.loads(json.dumps(report.to_json(), allow_nan=False, default=str))["solver"]
    assert solver["status"] == REPAIRED and solver["objective"] is None and solver["bound"] is None
