"""Through a Reconciler cycle on the in-memory Slurm: when the must-run jobs need more GPUs than exist, no job
started within the hysteresis is requeued; the starving job's commitment, the lowest, is the one that yields.
"""

from __future__ import annotations

import getpass

from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.model import JobState
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.protocol import ProtocolSettings
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler
from slurm_elastic.spec import ElasticSpec

ME = getpass.getuser()


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_a_starving_job_does_not_requeue_jobs_held_by_the_hysteresis(tmp_path):
    clock = Clock()
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4, clock=clock)
    ckpt = str(tmp_path / "ckpt")
    held = [slurm.add_job(ElasticSpec(1, 4, ckpt_dir=ckpt), nodes=1, gpus_per_node=4, user=ME) for _ in range(2)]
    # worth ten times either running job, and it has waited past the starvation limit by the second cycle
    starving = slurm.add_job(ElasticSpec(4, 4, weight=10.0, ckpt_dir=ckpt), nodes=1, gpus_per_node=4, user=ME)
    assert [slurm.jobs[j].state for j in (*held, starving)] == [JobState.RUNNING] * 2 + [JobState.PENDING]
    config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=5.0, settle_timeout_s=5.0), node_confirm_s=0,
                              min_resize_interval_s=7200.0)
    rec = Reconciler(slurm, Journal(str(tmp_path / "j.sqlite")), config, clock=clock, sleep=clock.sleep)
    assert rec.cycle().plans == ()                # both just started: held; the pending job starts waiting
    clock.t += 1900.0                             # past the starvation limit, within the hysteresis
    report = rec.cycle()
    assert report.allocation is not None
    # The held jobs are kept where they run and solved around; the starving job finds no room and waits
    # (the solver's give-up order itself: tests/allocate/test_commitments.py).
    assert slurm.jobs[starving].state is JobState.PENDING
    assert [p.job_id for p in report.plans if p.job_id in held] == []
    for job_id in held:
        assert slurm.jobs[job_id].state is JobState.RUNNING and slurm.jobs[job_id].gpus == 4
        assert slurm.jobs[job_id].restarts == 0
