"""User mode (`slurm-elastic watch`): rebalance one user's own elastic jobs in the foreground."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from slurm_elastic.cluster.backend import Backend
from slurm_elastic.cluster.model import ClusterState
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.protocol import RequeueProtocol
from slurm_elastic.control.reconcile import ControllerConfig, CycleReport, Reconciler
from slurm_elastic.control.state_dir import JOURNAL_FILE, USER_DIR_MODE, Heartbeat, InstanceLock, read_heartbeat
from slurm_elastic.errors import ElasticError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WatchResult:
    cycles: int
    deferred_cycles: int
    reason: str


def own_active_jobs(state: ClusterState, user: str, job_ids: frozenset[int] | None) -> list[int]:
    return [j.job_id for j in state.elastic_jobs
            if j.user == user and (job_ids is None or j.job_id in job_ids)]


def daemon_alive(daemon_dir: Path) -> Heartbeat | None:
    """The admin daemon's heartbeat when it is believable and fresh (see state_dir.read_heartbeat)."""
    beat = read_heartbeat(daemon_dir)
    return beat if beat is not None and beat.fresh() else None


def run_watch(backend: Backend, user: str, *, state_dir: Path, daemon_dir: Path, config: ControllerConfig,
              interval_s: float = 10.0, job_ids: frozenset[int] | None = None,
              stop: threading.Event | None = None,
              on_cycle: Callable[[CycleReport], None] | None = None) -> WatchResult:
    """Until the user's elastic jobs (or `job_ids`) have all ended; defers while the admin daemon beats.

    One watch per user: the per-user lock beside the per-user journal refuses a second one.
    The daemon's heartbeat is read before every cycle and again before the watch signals or
    holds a job, so a daemon that starts (or is mid-plan) while a cycle runs is not raced.
    """
    stop = stop or threading.Event()
    lock = InstanceLock(state_dir, f"slurm-elastic watch of user {user}", mode=USER_DIR_MODE)
    lock.acquire()
    try:
        journal = Journal(state_dir / JOURNAL_FILE)
    except BaseException:
        lock.release()
        raise

    def daemon_took_over() -> str | None:
        beat = daemon_alive(daemon_dir)
        return None if beat is None else f"the admin daemon (pid {beat.pid} on {beat.host}) is running"

    protocol = RequeueProtocol(backend, journal, config.protocol, may_act=daemon_took_over)
    reconciler = Reconciler(backend, journal, replace(config, user=user), protocol=protocol)
    cycles = deferred = 0
    announced_defer = False
    try:
        while not stop.is_set():
            beat = daemon_alive(daemon_dir)
            try:
                if beat is not None:
                    if not announced_defer:
                        log.warning("the admin daemon (pid %d on %s) is running: deferring to it", beat.pid,
                                    beat.host)
                        announced_defer = True
                    state = backend.snapshot()
                    if journal.open_plans():
                        reconciler.protocol.recover(state)  # our own open plans are still ours to finish
                    deferred += 1
                    remaining = own_active_jobs(state, user, job_ids)
                else:
                    if announced_defer:
                        log.warning("the admin daemon stopped beating: rebalancing %s's jobs again", user)
                        announced_defer = False
                    report = reconciler.cycle()
                    if on_cycle is not None:
                        on_cycle(report)
                    # In user mode the report's elastic jobs are exactly this user's.
                    remaining = [j for j in report.job_states if job_ids is None or j in job_ids]
                cycles += 1
                if not remaining:
                    log.info("no elastic jobs of %s left: watch ends", user)
                    return WatchResult(cycles, deferred, "jobs ended")
            except ElasticError as exc:
                log.error("watch cycle failed: %s (trying again)", exc)
            stop.wait(interval_s)
        return WatchResult(cycles, deferred, "stopped")
    finally:
        journal.close()
        lock.release()
