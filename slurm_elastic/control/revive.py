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
time limit TIMEOUT: none of those is requeued.

An owner's `scancel --full --signal=TERM` leaves exactly that record on every version (22.05,
24.11, 26.05: FAILED, ExitCode 0:15, no reason of its own), so Slurm's record cannot tell the
two apart. What can: a stale kill exists only because a node of the job failed. So a job is
revived only when this controller itself saw one of the job's nodes (any node when Slurm no
longer lists them) unavailable within `node_failure_s` before the job ended. Otherwise the end
is its owner's (or an admin's) signal and final, said once. A controller started after the
node came back has not seen the failure and revives nothing: a missed revival costs a manual
requeue, a wrong one overrides the owner.

A job is requeued this way at most `per_hour` times an hour (claims in the journal, taken
before the requeue, so a restarted controller counts them too): something that kills a job
each time it starts is not fought for ever.
"""

from __future__ import annotations

import logging
import math
import signal
from dataclasses import dataclass

from slurm_elastic.cluster.backend import Backend
from slurm_elastic.cluster.model import ClusterState, Job, JobState
from slurm_elastic.control.journal import Journal
from slurm_elastic.errors import SlurmError

log = logging.getLogger(__name__)

STALE_KILL_WINDOW_S = 60.0   # the queued kill arrives as the node registers; the launch came just before
# A failed node stays DOWN until it registers again (up to SlurmdTimeout, 300 s by default, later),
# the job starts there at once and dies within STALE_KILL_WINDOW_S: the failure was seen at most
# this long before the end, with a cycle interval of slack.
NODE_FAILURE_S = 600.0
REVIVALS_PER_HOUR = 3


@dataclass(frozen=True, slots=True)
class Revival:
    """A job bearing the signature: its id, restart count (which incarnation died) and how long it ran."""

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


class Reviver:
    """Requeues the victims in each cycle's state; says once per incarnation why one was not."""

    def __init__(self, backend: Backend, journal: Journal, *, window_s: float = STALE_KILL_WINDOW_S,
                 per_hour: int = REVIVALS_PER_HOUR, node_failure_s: float = NODE_FAILURE_S) -> None:
        self.backend = backend
        self.journal = journal
        self.window_s = window_s
        self.per_hour = per_hour
        self.node_failure_s = node_failure_s
        self._refused: set[tuple[int, int]] = set()
        self._unavailable_at: dict[str, float] = {}   # node -> when this controller last saw it unavailable

    def observe(self, state: ClusterState, now: float) -> None:
        """Note the nodes unavailable in `state` (every snapshot a cycle takes): the only evidence of a
        stale kill that an owner's signal cannot leave."""
        for node in state.nodes:
            if not node.available:
                self._unavailable_at[node.name] = now
        horizon = now - self.node_failure_s
        self._unavailable_at = {n: t for n, t in self._unavailable_at.items() if t >= horizon}

    def _node_failed_under(self, job: Job, now: float) -> bool:
        ended = job.end_time if job.end_time is not None else now
        names = job.nodes or tuple(self._unavailable_at)
        return any(ended - self.node_failure_s <= self._unavailable_at.get(n, -math.inf) for n in names)

    def revive(self, state: ClusterState, now: float) -> tuple[int, ...]:
        """Requeue each victim of `state` the limits allow; the job ids requeued."""
        revived = []
        for v in stale_kill_victims(state, window_s=self.window_s):
            what = (f"job {v.job_id}: ended FAILED by SIGTERM {v.ran_s:.0f} s after its restart {v.restarts}, "
                    "like a kill Slurm had queued for its previous incarnation on a node that failed")
            if not self._node_failed_under(state.job(v.job_id), now):
                if (v.job_id, v.restarts) not in self._refused:
                    self._refused.add((v.job_id, v.restarts))
                    log.info("job %d: ended by SIGTERM %.0f s after its restart %d, but no node of it was seen "
                             "failing: its owner's (or an admin's) signal, final; not requeued",
                             v.job_id, v.ran_s, v.restarts)
                continue
            if not self.journal.claim_revival(v.job_id, v.restarts, per_hour=self.per_hour, now=now):
                if (v.job_id, v.restarts) not in self._refused:
                    self._refused.add((v.job_id, v.restarts))
                    log.error("%s; not requeued: it was already requeued for this, or %d times in the last hour",
                              what, self.per_hour)
                continue
            try:
                self.backend.requeue(v.job_id)
            except SlurmError as exc:
                self.journal.release_revival(v.job_id, v.restarts)
                log.error("%s; requeueing it failed (tried again next cycle): %s", what, exc)
                continue
            log.warning("%s; requeued it", what)
            revived.append(v.job_id)
        return tuple(revived)
