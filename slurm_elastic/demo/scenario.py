"""The demo's script: cluster, three elastic jobs, the controller, a node lost, a node gained, cleanup, report.

Every wait has a deadline; whatever this run started (controller, jobs,
cluster, a killed node, a started spare) is stopped or restored on any exit,
including Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from slurm_elastic import settings
from slurm_elastic.cluster.cli_backend import CliBackend
from slurm_elastic.cluster.model import ClusterState, JobState
from slurm_elastic.control.state_dir import daemon_dir, read_heartbeat
from slurm_elastic.demo.live import DemoState
from slurm_elastic.demo.recorder import TimelineRecorder
from slurm_elastic.demo.report import ReportFiles, write_report
from slurm_elastic.demo.summary import DemoSummary, Run, runs_of, summarize
from slurm_elastic.demo.timeline import NODE_GAINED, NODE_LOST, JobInfo, JobSeen, NodeSeen, Timeline
from slurm_elastic.devcluster import LocalCluster
from slurm_elastic.errors import ElasticError, SlurmError

log = logging.getLogger(__name__)

MARKER = ".slurm-elastic-demo"       # marks a directory as a demo report (safe to clear run/)
_CKPT_OK = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._/+@-")


class DemoError(ElasticError):
    """The demo could not go on; the message says which step, why, and where the logs are."""


class DemoInterrupted(DemoError):
    """Ctrl-C or SIGTERM: the demo stopped early (and cleaned up)."""


@dataclass(frozen=True, slots=True)
class DemoJob:
    """One of the demo's elastic jobs: a name and its GPU range."""

    name: str
    min_gpus: int
    max_gpus: int
    gpu_step: int = 2
    weight: float = 1.0


# Submitted one after another, each gets what the allocator gives it on the GPUs
# free then: 8 + 4 + 4 fill the 16 GPUs of n1-n4. When a node of digits-a is
# lost, the L1 restart cost keeps b and c as they are and a shrinks; when a
# node is gained, a grows back.
DEFAULT_JOBS = (DemoJob("digits-a", 4, 8, gpu_step=4), DemoJob("digits-b", 2, 4), DemoJob("digits-c", 2, 4))


@dataclass(frozen=True, slots=True)
class DemoOptions:
    report_dir: Path
    state_dir: Path | None = None          # the local cluster's state directory (default: its usual one)
    keep: bool = False                     # leave a cluster this run started up afterwards
    port_base: int | None = None           # only when this run starts the cluster
    jobs: tuple[DemoJob, ...] = DEFAULT_JOBS
    interval_s: float = 2.0                # controller cycle
    hysteresis_s: float = 10.0             # the controller resizes a job at most this often (unless it lost a node)
    ack_timeout_s: float = 30.0            # how long the controller waits for a signalled checkpoint
    poll_s: float = 1.0                    # how often the demo observes Slurm and the job files
    settle_s: float = 6.0                  # no job change for this long: the controller is done acting
    min_steps: int = 5                     # steps a run must make to count as training
    every_steps: int = 10                  # periodic checkpoints (what an unsignalled restart falls back to)
    step_sleep_s: float = 0.1              # per training step: keeps 16 ranks from saturating 2 cores
    cpus_per_gpu: int = 2
    mem_per_gpu: str = "1000M"
    node: str | None = None                # the node to lose (default: one that runs two jobs, else any busy one)
    spare: str | None = None               # the node to gain (default: the first spare)
    mark_down: bool = False                # also mark the lost node DOWN at once (skips Slurm's ~30 s timeout)
    start_timeout_s: float = 150.0
    recover_timeout_s: float = 150.0
    grow_timeout_s: float = 150.0
    cluster_timeout_s: float = 90.0


@dataclass(frozen=True, slots=True)
class DemoResult:
    timeline: Timeline
    summary: DemoSummary
    files: ReportFiles
    error: str | None = None               # set when the demo stopped early (the report shows what happened)


@dataclass
class _Started:
    """What this run changed, so that cleanup undoes exactly that."""

    cluster: bool = False
    daemon: subprocess.Popen[bytes] | None = None
    jobs: list[str] = field(default_factory=list)
    killed: str | None = None
    spare: str | None = None


class Demo:
    """Runs the demo once; `on_update(state, told)` is called after every observation (the live view)."""

    def __init__(self, options: DemoOptions, *, on_update: Callable[[DemoState, list[str]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self.on_update = on_update or (lambda state, told: None)
        self._clock = clock
        self.report_dir = options.report_dir.expanduser().resolve()
        self.run_dir = self.report_dir / "run"
        self.ckpt_root = self.run_dir / "ckpt"
        self.log_dir = self.run_dir / "logs"
        self.daemon_dir = self.run_dir / "controller"
        self.daemon_log = self.log_dir / "controller.log"
        self.cluster = LocalCluster(options.state_dir)
        self.started = _Started()
        self.state = DemoState()
        self.recorder = TimelineRecorder(time.time(), ckpt_root=self.ckpt_root, controller_log=self.daemon_log)
        self.phases: dict[str, float] = {}
        self.restart_phases: list[dict[str, object]] = []   # the controller's restarts, phase by phase
        self._t0 = clock()
        self._last_change = clock()
        self._backend: CliBackend | None = None

    # -- the script ------------------------------------------------------------------------------------
    def run(self) -> DemoResult:
        """Run the script, clean up, write the report; `DemoResult.error` says why it stopped early, if it did."""
        prepare_report_dir(self.report_dir)
        check_prerequisites()
        job_template("ddp.sbatch")
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        for sub in (self.ckpt_root, self.log_dir, self.daemon_dir):
            sub.mkdir(parents=True, exist_ok=True)
        error: str | None = None
        # Ctrl-C, SIGTERM and a closed terminal (SIGHUP) all stop the demo through the cleanup (SIGINT
        # too, since a shell may have started us with it ignored).
        stoppers = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, _raise_interrupt) for sig in stoppers}
        try:
            self._script()
        except KeyboardInterrupt:
            error = f"interrupted (Ctrl-C, SIGTERM or SIGHUP) during '{self.state.phase}'"
        except ElasticError as exc:
            error = str(exc)
        finally:
            self._cleanup()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.recorder.action("stop", text="demo finished" if error is None else f"demo stopped early: {error}")
        return self._report(error)

    def _script(self) -> None:
        self._phase("starting the local cluster", self._ensure_cluster)
        self._phase("starting the controller", self._start_daemon)
        self._phase("submitting three elastic jobs", self._submit_jobs)
        self._wait("waiting for the three jobs to train", self._all_training, self.options.start_timeout_s)
        self._phase("taking a node down", self._lose_node)
        self._wait("waiting for the re-solve and resumed training", self._recovered, self.options.recover_timeout_s)
        self._note_restart_phases()
        self._phase("starting a spare node", self._gain_node)
        self._wait("waiting for the jobs to grow", self._grown, self.options.grow_timeout_s)
        self._note_restart_phases()

    def _note_restart_phases(self) -> None:
        """Each job's latest controller restart, phase by phase (control/phases.py), read now: the next
        incarnation replaces the job's files those phases are read from."""
        from slurm_elastic.control.journal import Journal
        from slurm_elastic.control.phases import last_restart
        from slurm_elastic.control.state_dir import JOURNAL_FILE

        path = self.daemon_dir / JOURNAL_FILE
        if self._backend is None or not path.exists():
            return
        journal = Journal(path)
        try:
            state = self._backend.snapshot()
            seen = {p["plan_id"] for p in self.restart_phases}
            for info in self.state.jobs.values():
                job = next((j for j in state.jobs if str(j.job_id) == info.job), None)
                restart = None if job is None else last_restart(job, journal, owner_uid=os.geteuid())
                if restart is None or restart.plan_id in seen:
                    continue
                self.restart_phases.append({"job": info.name, **restart.to_json(), "line": restart.line()})
                self.recorder.action("phases", subject=info.job, text=f"{info.name}: {restart.line()}")
        finally:
            journal.close()

    # -- phases ---------------------------------------------------------------------------------------
    def _phase(self, name: str, action: Callable[[], None]) -> None:
        self.state.phase = name
        self._tick(observe=self._backend is not None)
        t = self._clock()
        action()
        self.phases[name] = self._clock() - t

    def _wait(self, name: str, done: Callable[[], str | None], timeout_s: float) -> None:
        """Poll until `done()` returns None (it returns what is still missing); DemoError after timeout_s."""
        self.state.phase = name
        start = self._clock()
        deadline = start + timeout_s
        while True:
            self._tick()
            missing = done()
            if missing is None:
                self.phases[name] = self._clock() - start
                return
            self._check_daemon()
            if self._clock() >= deadline:
                raise DemoError(f"{name}: not done after {timeout_s:.0f} s ({missing}); "
                                f"see {self._log_hint()}")
            time.sleep(self.options.poll_s)

    def _tick(self, *, observe: bool = True) -> None:
        self.state.elapsed = self._clock() - self._t0
        if observe and self._backend is not None:
            try:
                self.recorder.observe(self._backend.snapshot())
            except SlurmError as exc:
                log.warning("snapshot failed: %s", exc)
        self.recorder.read_files()
        events = self.recorder.take_new()
        if any(isinstance(e, JobSeen) for e in events):
            self._last_change = self._clock()
        self.on_update(self.state, self.state.apply(events))

    # -- the cluster ----------------------------------------------------------------------------------
    def _ensure_cluster(self) -> None:
        if self.cluster.is_up():
            self.recorder.action("cluster", text=f"using the local cluster that is up ({self.cluster.slurm_conf})")
        else:
            self.recorder.action("cluster", text="starting the local Slurm cluster (4 nodes x 4 GPUs, 2 spares)")
            kwargs = {"port_base": self.options.port_base} if self.options.port_base else {}
            # `up` stops whatever it started when it fails, so the cluster is ours to stop only once it is up.
            self.cluster.up(timeout=self.options.cluster_timeout_s, **kwargs)
            self.started.cluster = True
        env = {**os.environ, **self.cluster.env()}
        self._env = env
        self._backend = CliBackend(env=env, timeout_s=30.0)
        layout = self.cluster.layout
        status = self.cluster.status()
        serving = [n.name for n in status.nodes if n.serving]
        spares = [n.name for n in status.nodes if n.spare and not n.started]
        if self.options.spare is None and not spares:
            raise DemoError(f"the local cluster in {self.cluster.state_dir} has no stopped spare node to add; "
                            "restart it with `slurm-elastic cluster down` and let the demo start it")
        if self.options.spare is not None and self.options.spare not in layout.node_names:
            raise DemoError(f"--spare {self.options.spare}: no such node ({', '.join(layout.node_names)})")
        other = read_heartbeat(daemon_dir())
        if other is not None and other.fresh():
            log.warning("a controller daemon (pid %d on %s, %s) is running; it acts on the demo's jobs too",
                        other.pid, other.host, daemon_dir())
            self.recorder.action("note", text=f"note: another controller daemon (pid {other.pid}) is running")
        busy = [j for j in self._backend.snapshot().jobs if not j.state.finished]
        if busy:
            log.warning("the cluster already runs %d job(s); the demo's jobs share what is left", len(busy))
            self.recorder.action("note", text=f"note: {len(busy)} other job(s) on the cluster share its GPUs")
        self.recorder.action("cluster", text=f"cluster ready: {', '.join(serving)} serving, spare(s) "
                                             f"{', '.join(spares) or '-'}")
        self._tick()

    # -- the controller -----------------------------------------------------------------------------------
    def _start_daemon(self) -> None:
        self.daemon_dir.mkdir(parents=True, exist_ok=True)
        env = {**self._env, settings.DAEMON_DIR.env: str(self.daemon_dir), "PYTHONUNBUFFERED": "1"}
        argv = [*_cli(), "-v", "admin", "daemon", *daemon_args(self.options)]
        log_file = self.daemon_log.open("ab")
        try:
            self.started.daemon = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log_file.close()
        self.recorder.action("daemon", text=f"controller started: `slurm-elastic admin daemon --interval "
                                            f"{self.options.interval_s:g}` (pid {self.started.daemon.pid})")

    def _check_daemon(self) -> None:
        daemon = self.started.daemon
        if daemon is not None and daemon.poll() is not None:
            raise DemoError(f"the controller exited with status {daemon.returncode}; see {self.daemon_log}")

    # -- the jobs ---------------------------------------------------------------------------------------
    def _submit_jobs(self) -> None:
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        for job in self.options.jobs:
            jid = self._submit(job)
            self.started.jobs.append(jid)
            info = JobInfo(job=jid, name=job.name, min_gpus=job.min_gpus, max_gpus=job.max_gpus)
            self.recorder.add_job(info)
            self.state.add_job(info)
            self.recorder.action("submit", subject=jid, text=f"submitted {job.name} as job {jid}: "
                                                             f"{job.min_gpus}-{job.max_gpus} GPUs")
            # The next job's initial size is chosen on the GPUs free then: wait until this one holds its own.
            self._wait(f"waiting for {job.name} to start", lambda jid=jid: self._running(jid),
                       self.options.start_timeout_s)

    def _submit(self, job: DemoJob) -> str:
        argv = [*_cli(), "sbatch", "--parsable", *submit_args(job, self.options, ckpt_root=self.ckpt_root,
                                                              log_dir=self.log_dir)]
        # The job inherits this environment (sbatch exports it): this Python first on PATH, and the
        # rendezvous on 127.0.0.1, since the local cluster's node names (n1, ...) are not resolvable hosts.
        env = {**self._env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{self._env.get('PATH', '')}",
               "MASTER_ADDR": "127.0.0.1"}
        try:
            result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=self.run_dir,
                                    check=False)
        except subprocess.TimeoutExpired:
            raise DemoError(f"`slurm-elastic sbatch` for {job.name} did not return within 60 s") from None
        if result.returncode != 0:
            raise DemoError(f"`slurm-elastic sbatch` for {job.name} failed ({result.returncode}): "
                            f"{(result.stderr or result.stdout).strip()[-500:]}")
        text = result.stdout.strip().splitlines()
        jid = text[-1].split(";")[0].strip() if text else ""
        if not jid.isdigit():
            raise DemoError(f"`slurm-elastic sbatch` printed no job id for {job.name}: {result.stdout!r}")
        return jid

    # -- node events -----------------------------------------------------------------------------------
    def _lose_node(self) -> None:
        node = self.options.node or self._busiest_node()
        self.started.killed = node
        at = self.recorder.now()   # recovery counts from the kill, not from when node_down returns
        self.cluster.node_down(node, mark_down=self.options.mark_down)
        how = " and marked it DOWN" if self.options.mark_down else "; Slurm notices once its SlurmdTimeout (10 s) is up"
        self.recorder.action(NODE_LOST, subject=node, text=f"node {node} lost: killed its slurmd and "
                                                           f"training processes{how}", t=at)

    def _busiest_node(self) -> str:
        """The last node of the largest running demo job (its batch shell on the first node sees the loss)."""
        running = [j for j in self._snapshot().jobs
                   if str(j.job_id) in self.recorder.jobs and j.state is JobState.RUNNING and j.nodes]
        if not running:
            raise DemoError("no demo job is running on any node; nothing to lose")
        largest = max(running, key=lambda j: (j.gpus, -j.job_id))
        return sorted(largest.nodes)[-1]

    def _gain_node(self) -> None:
        spare = self.options.spare or next(n.name for n in self.cluster.status().nodes if n.spare and not n.started)
        self.started.spare = spare
        self.cluster.node_up(spare, wait=False)
        self.recorder.action(NODE_GAINED, subject=spare, text=f"node {spare} gained: started the spare's slurmd")

    # -- wait conditions (None = done, else what is missing) ------------------------------------------
    def _timeline(self) -> Timeline:
        return self.recorder.timeline()

    def _settled(self) -> str | None:
        quiet = self._clock() - self._last_change
        if quiet < self.options.settle_s:
            return f"jobs changed {quiet:.0f} s ago, waiting {self.options.settle_s:g} s for the controller to settle"
        return None

    def _training_since(self, timeline: Timeline, since: float) -> str | None:
        """Every job runs and its current run made min_steps steps after `since`."""
        for info in timeline.jobs:
            latest = [e for e in timeline.of(JobSeen) if e.job == info.job]
            if not latest or latest[-1].state != "RUNNING":
                if not latest:
                    return f"{info.name} is not in Slurm's queue yet"
                why = f" ({latest[-1].reason})" if latest[-1].reason and latest[-1].reason != "None" else ""
                return f"{info.name} is {latest[-1].state}{why}"
            runs = runs_of(timeline, info.job)
            run: Run | None = runs[-1] if runs else None
            rows = [r for r in run.rows if r.t >= since] if run else []
            if len(rows) < self.options.min_steps:
                return f"{info.name} made {len(rows)} of {self.options.min_steps} steps in its current run"
        return None

    def _running(self, jid: str) -> str | None:
        seen = [e for e in self._timeline().of(JobSeen) if e.job == jid]
        if seen and seen[-1].state == "RUNNING":
            return None
        return f"job {jid} is {seen[-1].state if seen else 'not in squeue yet'}"

    def _all_training(self) -> str | None:
        return self._training_since(self._timeline(), 0.0) or self._settled()

    def _event_time(self, timeline: Timeline, action: str) -> float:
        return next(e.t for e in timeline.events if getattr(e, "action", None) == action)

    def _recovered(self) -> str | None:
        timeline = self._timeline()
        lost_at = self._event_time(timeline, NODE_LOST)
        node = self.started.killed
        seen = [e for e in timeline.of(NodeSeen) if e.node == node and e.t >= lost_at]
        if not seen or seen[-1].available:
            return f"Slurm still shows {node} available"
        on_lost = [info.name for info in timeline.jobs if node in _nodes_now(timeline, info.job)]
        if on_lost:
            return f"{', '.join(on_lost)} still on {node}"
        return self._training_since(timeline, lost_at) or self._settled()

    def _grown(self) -> str | None:
        timeline = self._timeline()
        gained_at = self._event_time(timeline, NODE_GAINED)
        spare = self.started.spare
        seen = [e for e in timeline.of(NodeSeen) if e.node == spare and e.t >= gained_at]
        if not seen or not seen[-1].available:
            return f"Slurm does not show {spare} serving yet"
        before = sum(_gpus_at(timeline, info.job, gained_at) for info in timeline.jobs)
        now = sum(_gpus_at(timeline, info.job, None) for info in timeline.jobs)
        if now <= before:
            return f"the jobs hold {now} GPUs, as before the node was gained ({before})"
        return self._training_since(timeline, gained_at) or self._settled()

    # -- cleanup -------------------------------------------------------------------------------------------
    def _cleanup(self) -> None:
        """Undo what this run started, in reverse; never raises, never waits without a bound."""
        # A second Ctrl-C (or a SIGTERM, or the terminal closing) must not leave things half-stopped.
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            self.state.phase = "stopping the controller and the jobs"
            self._tick_quietly()
            self._stop_daemon()
            self._cancel_jobs()
            if self.started.cluster and not self.options.keep:
                self.state.phase = "stopping the local cluster"
                self._tick_quietly(observe=False)
                self._quietly(self.cluster.down, "stopping the local cluster")
            elif self.cluster.exists() and self.cluster.is_up():
                self._restore_nodes()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _tick_quietly(self, *, observe: bool = True) -> None:
        try:
            self._tick(observe=observe)
        except Exception as exc:  # cleanup goes on whatever the view or Slurm says
            log.warning("observing during cleanup: %s", exc)

    def _stop_daemon(self) -> None:
        daemon = self.started.daemon
        if daemon is None or daemon.poll() is not None:
            return
        daemon.terminate()
        try:
            daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            log.warning("the controller (pid %d) did not stop on SIGTERM; killing it", daemon.pid)
            daemon.kill()
            daemon.wait(timeout=5)
        self.recorder.action("daemon", text=f"controller stopped (exit {daemon.returncode})")

    def _cancel_jobs(self) -> None:
        if not self.started.jobs or self._backend is None:
            return
        self._quietly(lambda: self.cluster.slurm("scancel", *self.started.jobs, check=False), "cancelling the jobs")
        deadline = self._clock() + 30
        while self._clock() < deadline:
            try:
                alive = [j for j in self._snapshot().jobs
                         if str(j.job_id) in self.started.jobs and not j.state.finished]
            except ElasticError:
                break
            if not alive:
                break
            time.sleep(0.5)
        self.recorder.action("stop", text=f"cancelled jobs {', '.join(self.started.jobs)}")

    def _restore_nodes(self) -> None:
        """A cluster this run did not stop: give back the node it killed and retire the spare it started."""
        status = self._quietly(self.cluster.status, "reading the cluster status")
        if status is None:
            return
        if self.started.killed and not status.node(self.started.killed).started:
            self._quietly(lambda: self.cluster.node_up(self.started.killed or "", wait=True, timeout=30),
                          f"restarting {self.started.killed}")
        if self.started.spare and status.node(self.started.spare).spare:
            self._quietly(lambda: self.cluster.retire_spare(self.started.spare or ""),
                          f"retiring spare {self.started.spare}")

    @staticmethod
    def _quietly(action: Callable[[], object], what: str) -> object:
        try:
            return action()
        except (ElasticError, OSError, subprocess.SubprocessError, KeyError) as exc:
            log.error("%s failed: %s", what, exc)
            return None

    # -- report ---------------------------------------------------------------------------------------------
    def _report(self, error: str | None) -> DemoResult:
        timeline = self.recorder.timeline(ended=True)
        summary = summarize(timeline, phases=self.phases, restart_phases=tuple(self.restart_phases))
        files = write_report(self.report_dir, timeline, summary)
        return DemoResult(timeline=timeline, summary=summary, files=files, error=error)

    # -- plumbing -------------------------------------------------------------------------------------------
    def _snapshot(self) -> ClusterState:
        assert self._backend is not None
        return self._backend.snapshot()

    def _log_hint(self) -> str:
        layout_logs = ""
        if self.cluster.exists():
            layout = self.cluster.layout
            layout_logs = f", Slurm logs in {layout.log_dir}"
        return f"the controller log {self.daemon_log}, job logs in {self.log_dir}{layout_logs}"


def prepare_report_dir(d: Path) -> None:
    """Create (or reuse) a report directory; refuse one that holds anything but an earlier demo report."""
    if not set(str(d)) <= _CKPT_OK:
        raise DemoError(f"--report-dir {d}: the checkpoints live under it, so its path may use only letters, "
                        "digits and ._/+@- ; choose another directory")
    if d.exists() and (not d.is_dir() or (any(d.iterdir()) and not (d / MARKER).exists())):
        raise DemoError(f"--report-dir {d} exists and is not a demo report directory; choose a new or empty one")
    d.mkdir(parents=True, exist_ok=True)
    (d / MARKER).write_text("written by slurm-elastic demo; the next demo run may replace this directory's files\n")


def submit_args(job: DemoJob, options: DemoOptions, *, ckpt_root: Path, log_dir: Path) -> list[str]:
    """`slurm-elastic sbatch` arguments for one demo job: its range, resources, the template and trainer flags."""
    return [
        "--gpus", f"{job.min_gpus}-{job.max_gpus}", "--gpu-step", str(job.gpu_step),
        "--cpus-per-gpu", str(options.cpus_per_gpu), "--mem-per-gpu", options.mem_per_gpu,
        "--weight", f"{job.weight:g}", "--ckpt-dir", str(ckpt_root),
        "--job-name", job.name, "--output", str(log_dir / f"{job.name}-%j.out"),
        str(job_template("ddp.sbatch")),
        sys.executable, "-m", "slurm_elastic.train.examples.digits",
        "--steps", "1000000", "--global-batch", "48", "--micro-batch", "2",
        "--every-steps", str(options.every_steps), "--step-sleep", f"{options.step_sleep_s:g}", "--timeout-s", "30",
    ]


def daemon_args(options: DemoOptions) -> list[str]:
    """`slurm-elastic admin daemon` options: a short cycle, and a hysteresis short enough for a five-minute demo."""
    # --speed linear: the local cluster's GPUs are device files on a machine of a few CPU cores, where more
    # "GPUs" (ranks) train slower; measured speeds would rightly keep every job small.
    return ["--interval", f"{options.interval_s:g}", "--hysteresis", f"{options.hysteresis_s:g}",
            "--ack-timeout", f"{options.ack_timeout_s:g}", "--speed", "linear"]


def job_template(name: str) -> Path:
    """A template from job_templates/: in the source tree next to the package (editable install), where a
    copy install puts it (`<prefix>/share/slurm-elastic/job_templates`), or in the current directory."""
    package = Path(__file__).resolve().parent.parent
    roots = (package.parent, Path(sys.prefix) / "share" / "slurm-elastic", Path.cwd())
    for root in roots:
        if (root / "job_templates" / name).is_file():
            return root / "job_templates" / name
    raise DemoError(f"job template job_templates/{name} not found in {', '.join(str(r) for r in roots)}; "
                    "run the demo from the source checkout")


def check_prerequisites() -> None:
    """What the demo's jobs and report import, checked before anything starts."""
    import importlib.util

    missing = [mod for mod in ("torch", "sklearn", "matplotlib", "rich") if importlib.util.find_spec(mod) is None]
    if missing:
        names = {"sklearn": "scikit-learn"}
        raise DemoError(f"the demo needs {', '.join(names.get(m, m) for m in missing)} in {sys.executable}'s "
                        f"environment: {sys.executable} -m pip install {' '.join(names.get(m, m) for m in missing)}")
    if os.geteuid() != 0:
        raise DemoError("the demo runs a local Slurm cluster, whose slurmd must run as root: use sudo")


def _cli() -> list[str]:
    """The `slurm-elastic` command of this very installation."""
    script = Path(sys.executable).parent / "slurm-elastic"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-c", "import sys; from slurm_elastic.cli import main; sys.exit(main())"]


def _nodes_now(timeline: Timeline, job: str) -> tuple[str, ...]:
    seen = [e for e in timeline.of(JobSeen) if e.job == job]
    return seen[-1].nodes if seen and seen[-1].state == "RUNNING" else ()


def _gpus_at(timeline: Timeline, job: str, t: float | None) -> int:
    """GPUs the job held at demo time t (None: now)."""
    seen = [e for e in timeline.of(JobSeen) if e.job == job and (t is None or e.t <= t)]
    return seen[-1].gpus if seen and seen[-1].state == "RUNNING" else 0


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
