"""The admin daemon: the reconcile loop, woken early by node events, with a heartbeat and metrics."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from slurm_elastic.control.job_notes import write_notes
from slurm_elastic.control.metrics import ControllerMetrics
from slurm_elastic.control.reconcile import CycleReport, Reconciler
from slurm_elastic.control.state_dir import HEARTBEAT_EVERY_S, StateDirError, clear_heartbeat, write_heartbeat
from slurm_elastic.errors import ElasticError

log = logging.getLogger(__name__)


class Loop:
    """Runs `reconciler.cycle()` every `interval_s` until `stop` is set; `wake` starts a cycle at once."""

    def __init__(self, reconciler: Reconciler, *, interval_s: float, heartbeat_dir: Path | None = None,
                 metrics: ControllerMetrics | None = None,
                 on_cycle: Callable[[CycleReport], None] | None = None) -> None:
        self.reconciler = reconciler
        self.interval_s = interval_s
        self.heartbeat_dir = heartbeat_dir
        self.metrics = metrics
        self.on_cycle = on_cycle
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.cycles = 0
        # The heartbeat is written by its own thread, not between cycles: a cycle can wait minutes
        # for checkpoint ACKs, and a user's watch must keep deferring while it does.
        self.beat_every_s = min(interval_s, HEARTBEAT_EVERY_S)

    def run(self, max_cycles: int | None = None) -> None:
        log.info("reconcile loop started (interval %gs)", self.interval_s)
        beating = threading.Event()
        beat_thread = self._start_heartbeat(beating) if self.heartbeat_dir is not None else None
        try:
            while not self.stop.is_set():
                self.wake.clear()
                self.run_once()
                if max_cycles is not None and self.cycles >= max_cycles:
                    break
                self.wake.wait(self.interval_s)
        finally:
            if beat_thread is not None and self.heartbeat_dir is not None:
                beating.set()
                beat_thread.join()
                clear_heartbeat(self.heartbeat_dir)
            log.info("reconcile loop stopped after %d cycles", self.cycles)

    def _start_heartbeat(self, done: threading.Event) -> threading.Thread:
        """Beat once now (a state dir that cannot be written ends the start with one line), then every
        `beat_every_s` until `done`, through every wait of every cycle."""
        assert self.heartbeat_dir is not None
        directory = self.heartbeat_dir
        # What this daemon decides with, so that status and dry runs elsewhere decide alike.
        settings = self.reconciler.config.settings()
        try:
            write_heartbeat(directory, self.interval_s, every_s=self.beat_every_s, settings=settings)
        except OSError as exc:
            raise StateDirError(f"cannot write the daemon heartbeat in {directory}: {exc.strerror}") from None

        def beat() -> None:
            failing = False
            while not done.wait(self.beat_every_s):
                try:
                    write_heartbeat(directory, self.interval_s, every_s=self.beat_every_s, settings=settings)
                    failing = False
                except OSError as exc:
                    if not failing:   # once per outage, not every few seconds
                        log.warning("cannot write the heartbeat in %s: %s", directory, exc.strerror)
                    failing = True

        thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        thread.start()
        return thread

    def run_once(self) -> CycleReport | None:
        report = None
        try:
            report = self.reconciler.cycle()
            self._write_notes(report)
            if self.metrics is not None:
                self.metrics.observe(report)
            if self.on_cycle is not None:
                self.on_cycle(report)
            if report.plans:
                log.info("cycle: %d plans, %s", len(report.plans),
                         ", ".join(f"job {o.job_id} {o.status}" for o in report.outcomes))
        except ElasticError as exc:
            # Slurm restarting or briefly unreachable must not end the daemon: try again next cycle.
            log.error("cycle failed: %s", exc)
            if self.metrics is not None:
                self.metrics.cycle_errors.inc()
        except Exception:
            # Anything else is a defect, not a reason to stop the root daemon: every job would lose its
            # controller. The traceback goes to the log once per cycle; the next cycle starts afresh.
            log.exception("cycle failed with an internal error; trying again next cycle")
            if self.metrics is not None:
                self.metrics.cycle_errors.inc()
        self.cycles += 1
        return report

    def _write_notes(self, report: CycleReport) -> None:
        """Each user's jobs' notes, for their `status` (control/job_notes.py)."""
        if self.heartbeat_dir is None:
            return
        by_user: dict[str, dict[int, str]] = {}
        for job_id, user in report.owners.items():
            by_user.setdefault(user, {})[job_id] = report.waits.get(job_id, "")
        try:
            write_notes(self.heartbeat_dir, by_user, time.time())
        except OSError as exc:
            log.warning("cannot write the jobs' notes in %s: %s", self.heartbeat_dir, exc.strerror)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop after the current cycle, a second one at once; SIGHUP wakes a cycle now.

        A cycle can wait a minute for checkpoint ACKs, and one stalled on something else ends only with
        it: a second signal exits now, as a crash would. Every protocol step is journaled before it is
        taken, so the next start finishes what was open (a job held meanwhile stays held until then)."""
        def stop(signum: int, frame: object) -> None:
            if self.stop.is_set():
                log.warning("signal %d again: exiting now; open plans are finished at the next start", signum)
                logging.shutdown()
                os._exit(128 + signum)
            log.info("signal %d: stopping after this cycle (again: at once)", signum)
            self.stop.set()
            self.wake.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGHUP, lambda s, f: self.wake.set())

    def start_node_watch(self, poll: Callable[[], bool], every_s: float = 2.0) -> threading.Thread:
        """Wake the loop when `poll()` says the nodes changed (a cheap check between full cycles)."""
        def watch() -> None:
            while not self.stop.is_set():
                try:
                    if poll():
                        log.info("node change seen: waking the reconcile loop")
                        self.wake.set()
                except ElasticError as exc:
                    log.debug("node watch: %s", exc)
                self.stop.wait(every_s)

        thread = threading.Thread(target=watch, name="node-watch", daemon=True)
        thread.start()
        return thread
