"""A recorded-style demo timeline built by hand, so the summary and report are tested without Slurm.

Three jobs on n1-n4 (4 GPUs each): a=8 GPUs on n1,n2; b=4 on n3; c=4 on n4.
At t=40 n2 is killed (Slurm shows it DOWN at 70): job a dies with it, is
requeued by Slurm and resumes at 4 GPUs from its periodic checkpoint (step 50,
having reached 58); b and c keep training. At t=120 spare n5 starts (IDLE at
123): the controller signals b, which commits step 230 (its last) and resumes at 8 GPUs.
"""

from __future__ import annotations

from slurm_elastic.demo.timeline import (NODE_GAINED, NODE_LOST, Acked, DemoAction, JobInfo, JobSeen, NodeSeen,
                                         Progress, Timeline)

JOBS = (JobInfo("11", "digits-a", 2, 8), JobInfo("12", "digits-b", 2, 8), JobInfo("13", "digits-c", 2, 8))


def rows(job: str, t0: float, t1: float, first_step: int, gpus: int, rate: float = 2.0) -> list[Progress]:
    """One metrics row per step from t0 (first_step) to t1, like the shim writes them."""
    out = []
    step, t = first_step, t0
    while t <= t1:
        out.append(Progress(t=round(t, 3), job=job, step=step, gpus=gpus, steps_per_s=rate))
        step += 1
        t += 1.0 / rate
    return out


def demo_timeline(*, b_signalled: bool = True, b_resume_gap: int = 0, a_resumes: bool = True) -> Timeline:
    ev: list = []
    for i, n in enumerate(("n1", "n2", "n3", "n4", "n5", "n6"), 1):
        spare = i > 4
        ev.append(NodeSeen(t=0.5, node=n, state="down" if spare else "idle", available=not spare, gpus=4))
    for info in JOBS:
        ev.append(DemoAction(t=1.0, action="submit", subject=info.job, text=info.name))
    ev.append(JobSeen(t=2.0, job="11", state="RUNNING", gpus=8, nodes=("n1", "n2"), restarts=0, start=2.0))
    ev.append(JobSeen(t=2.0, job="12", state="RUNNING", gpus=4, nodes=("n3",), restarts=0, start=2.0))
    ev.append(JobSeen(t=2.0, job="13", state="RUNNING", gpus=4, nodes=("n4",), restarts=0, start=2.0))
    # Training starts at t=10 (import time) at 2 steps/s; a reaches step 58 by t=38.5 and dies at 40.
    ev += rows("11", 10.0, 38.5, 1, 8)
    ev += rows("12", 10.0, 124.5, 1, 4)
    ev += rows("13", 10.0, 180.0, 1, 4)
    ev.append(DemoAction(t=40.0, action=NODE_LOST, subject="n2", text="killed slurmd of n2"))
    ev.append(NodeSeen(t=70.0, node="n2", state="down+not_responding", available=False, gpus=4))
    ev.append(JobSeen(t=70.0, job="11", state="PENDING", gpus=8, restarts=1, reason="BeginTime"))
    ev.append(JobSeen(t=72.0, job="11", state="RUNNING", gpus=4, nodes=("n1",), restarts=1, start=72.0))
    if a_resumes:
        # Resumed from the periodic checkpoint at step 50: the first row after the restart is step 51.
        ev += rows("11", 80.0, 180.0, 51, 4)
    ev.append(DemoAction(t=120.0, action=NODE_GAINED, subject="n5", text="started spare n5"))
    ev.append(NodeSeen(t=123.0, node="n5", state="idle", available=True, gpus=4))
    # b: signalled after its row at 124.5 (step 230), commits step 230, requeued and grown to 8.
    if b_signalled:
        ev.append(Acked(t=125.0, job="12", restart=0, step=230))
    ev.append(JobSeen(t=126.0, job="12", state="PENDING", gpus=4, restarts=1, held=True, reason="JobHeldUser"))
    ev.append(JobSeen(t=127.0, job="12", state="RUNNING", gpus=8, nodes=("n3", "n5"), restarts=1, start=127.0))
    ev += rows("12", 135.0, 180.0, 231 - b_resume_gap, 8)
    ev.append(DemoAction(t=181.0, action="stop", text="stopping"))
    return Timeline(started_at=1_700_000_000.0, jobs=JOBS, events=tuple(sorted(ev, key=lambda e: e.t)),
                    ended_at=182.0)
