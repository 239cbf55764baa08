"""Requeue an elastic job that Slurm ended with a kill meant for its previous incarnation.

Seen live on 26.05.5 (CI's sid chroot, a node flapping, 3 runs of 3): Slurm requeues a job off
a node that failed and queues the kill of that incarnation for the dead node. The node comes
back, Slurm starts the job there again at once, and the queued kill arrives after the launch:
slurmd ends the new incarnation (`CANCELLED ... DUE TO NODE FAILURE` in its log, under the old
SLUID), slurmctld records `_job_complete: WTERMSIG 15` for a job it never killed, and the job
ends FAILED. Nothing requeues it, and the training stops with its checkpoints whole.

The signature, all of it in Slurm's record of the job: elastic and requeueable, FAILED with
SIGTERM as the batch script's end, requeued at least once before, ended within `window_s` of
its start. A crashing trainer ends the script with an exit code, scancel gives CANCELLED, a
time limit TIMEOUT: none of those is requeued. Each incarnation (job, restart count) is
requeued once at most, claimed in the journal before the requeue, so a job that keeps dying
this way, or a controller restarted in between, cannot loop.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

from slurm_elastic.cluster.backend import Backend
from slurm_elastic.cluster.model import ClusterState, Job, JobState
from slurm_elastic.control.journal import Journal
from slurm_elastic.errors import SlurmError

log = logging.getLogger(__name__)

STALE_KILL_WINDOW_S = 60.0   # the queued kill arrives as the node registers; the launch came just before


@dataclass(frozen=True, slots=True)
class Revival:
    job_id: int
    restarts: int
    ran_s: float


def stale_kill_victims(state: ClusterState, *, window_s: float = STALE_KILL_WINDOW_S) -> list[Revival]:
    """Jobs of `state` (scoped: only the elastic jobs this controller may act on) that bear the signature."""
    return [Revival(j.job_id, j.restarts, j.end_time - j.start_time) for j in state.jobs
            if _bears_signature(j) and j.end_time is not None and j.start_time is not None
            and 0 <= j.end_time - j.start_time <= window_s]


def _bears_signature(job: Job) -> bool:
    return (job.spec is not None and job.requeue and job.state is JobState.FAILED
            and job.exit_signal == signal.SIGTERM and job.restarts >= 1)


def revive(backend: Backend, journal: Journal, state: ClusterState, now: float,
           *, window_s: float = STALE_KILL_WINDOW_S) -> tuple[int, ...]:
    """Requeue each victim once; the job ids requeued."""
    revived = []
    for victim in stale_kill_victims(state, window_s=window_s):
        if not journal.claim_revival(victim.job_id, victim.restarts, now=now):
            continue
        try:
            backend.requeue(victim.job_id)
        except SlurmError as exc:
            log.error("job %d: ended FAILED by SIGTERM %.0f s after its restart %d (a kill meant for its previous "
                      "incarnation); requeueing it failed: %s", victim.job_id, victim.ran_s, victim.restarts, exc)
            continue
        log.warning("job %d: ended FAILED by SIGTERM %.0f s after its restart %d, a kill Slurm had queued for its "
                    "previous incarnation on a node that failed; requeued it", victim.job_id, victim.ran_s,
                    victim.restarts)
        revived.append(victim.job_id)
    return tuple(revived)
