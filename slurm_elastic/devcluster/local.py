"""LocalCluster: start, inspect, break and stop a real multi-node Slurm on 127.0.0.1."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from slurm_elastic.devcluster import processes
from slurm_elastic.devcluster.layout import (
    DEFAULT_GRACE_TIME_S,
    DEFAULT_PORT_BASE,
    DEFAULT_SLURMD_TIMEOUT_S,
    ClusterLayout,
    check_state_dir,
    default_state_dir,
)
from slurm_elastic.devcluster.processes import Identity
from slurm_elastic.devcluster.status import (
    ClusterStatus,
    NodeStatus,
    node_state_serving,
    parse_scontrol_nodes,
)
from slurm_elastic.devcluster.slurmconf import (
    SPARE_REASON,
    render_cgroup_conf,
    render_gres_conf,
    render_slurm_conf,
)
from slurm_elastic.devcluster.version import SlurmVersion, detect_version, require_program
from slurm_elastic.errors import ClusterSetupError

log = logging.getLogger(__name__)

# NVIDIA's character-device major number; nothing ever opens these files, but
# Slurm only exports CUDA_VISIBLE_DEVICES for GRES files that are devices.
_GPU_DEVICE_MAJOR = 195


class ClusterAlreadyUp(ClusterSetupError):
    """`up` found the cluster of this state directory already running."""


class UnknownNode(ClusterSetupError):
    """A node name that this cluster does not have (bad input)."""


class LocalCluster:
    """A real Slurm (one slurmctld, one `slurmd -N nX` per node, a private munged) in one state directory.

    Every process it signals is found by its pid file and checked against
    /proc/<pid>/cmdline first, so nothing outside this cluster is touched.
    """

    def __init__(self, state_dir: Path | str | None = None) -> None:
        self.state_dir = Path(state_dir).expanduser().resolve() if state_dir else default_state_dir().resolve()

    # -- what is there -----------------------------------------------------
    @property
    def layout(self) -> ClusterLayout:
        return ClusterLayout.load(self.state_dir)

    @property
    def slurm_conf(self) -> Path:
        return self.state_dir / "etc" / "slurm.conf"

    def exists(self) -> bool:
        """True if `up` ran here at least once (there is a cluster.json)."""
        try:
            return (self.state_dir / "cluster.json").is_file()
        except PermissionError:
            raise ClusterSetupError(f"cannot read the local cluster in {self.state_dir}: permission denied "
                                    "(it is another user's; pass --state-dir, or use sudo)") from None

    def env(self) -> dict[str, str]:
        """The variables a Slurm client needs to talk to this cluster (to merge into os.environ)."""
        return {"SLURM_CONF": str(self.slurm_conf)}

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env())
        return env

    def is_up(self) -> bool:
        """slurmctld of this state directory is running."""
        return self.exists() and self._ctld_pid(self.layout) is not None

    # -- identities and pids -----------------------------------------------
    @staticmethod
    def _ctld_identity(layout: ClusterLayout) -> Identity:
        return Identity("slurmctld", (str(layout.slurm_conf),))

    @staticmethod
    def _slurmd_identity(layout: ClusterLayout, node: str) -> Identity:
        return Identity("slurmd", (str(layout.slurm_conf), f"-N\0{node}"))

    @staticmethod
    def _munged_identity(layout: ClusterLayout) -> Identity:
        return Identity("munged", (f"--socket={layout.munge_socket}",))

    def _ctld_pid(self, layout: ClusterLayout) -> int | None:
        return processes.verified_pid(layout.ctld_pid, self._ctld_identity(layout))

    def _slurmd_pid(self, layout: ClusterLayout, node: str) -> int | None:
        return processes.verified_pid(layout.slurmd_pid(node), self._slurmd_identity(layout, node))

    def _munged_pid(self, layout: ClusterLayout) -> int | None:
        return processes.verified_pid(layout.munge_pid, self._munged_identity(layout))

    def _paths(self) -> ClusterLayout:
        """The saved layout, or (cluster.json garbled) one with the default shape in this state directory.

        Every file's place depends on the state directory alone, so this finds and stops
        what runs here even when cluster.json cannot be read; only node names beyond the
        default ones are missed there, and the daemons are found by their configuration.
        """
        try:
            return self.layout
        except ClusterSetupError as exc:
            log.warning("%s; looking for its processes by the state directory alone", exc)
            return ClusterLayout(state_dir=self.state_dir, slurm_version="unknown")

    def leftover_processes(self) -> list[int]:
        """Every live process of this cluster: daemons (by their arguments), job step daemons (by log file)
        and their processes, and the sruns run against it that outlived their batch script."""
        layout = self._paths()
        pids = set(processes.processes_mentioning(str(layout.slurm_conf), ("slurmctld", "slurmd")))
        pids.update(processes.clients_of(str(layout.slurm_conf)))
        pids.update(processes.processes_mentioning(f"--socket={layout.munge_socket}", ("munged",)))
        stepds = processes.stepds_writing(layout.slurmd_log(n) for n in layout.node_names)
        pids.update(stepds)
        pids.update(processes.descendants(stepds))
        return sorted(pids)

    # -- Slurm commands ----------------------------------------------------
    def slurm(self, *args: str, timeout: float = 20.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (scontrol, sinfo, ...) against this cluster."""
        program = require_program(args[0])
        try:
            result = subprocess.run(
                [program, *args[1:]], env=self._env(), capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise ClusterSetupError(f"`{' '.join(args)}` did not answer within {timeout:.0f} s") from None
        if check and result.returncode != 0:
            raise ClusterSetupError(f"`{' '.join(args)}` failed: {(result.stderr or result.stdout).strip()}")
        return result

    def node_states(self) -> dict[str, dict[str, str]]:
        """Slurm's view of every node (`scontrol -o show node`), keyed by node name."""
        return parse_scontrol_nodes(self.slurm("scontrol", "-o", "show", "node").stdout)

    # -- status --------------------------------------------------------------
    def status(self) -> ClusterStatus:
        layout = self.layout
        ctld = self._ctld_pid(layout)
        slurm_view: dict[str, dict[str, str]] = {}
        if ctld is not None:
            try:
                slurm_view = self.node_states()
            except ClusterSetupError as exc:
                log.warning("slurmctld pid %d is alive but does not answer: %s", ctld, exc)
        nodes = []
        for spec in layout.node_specs:
            fields = slurm_view.get(spec.name, {})
            state = fields.get("State") or ("UNKNOWN" if ctld is not None else "STOPPED")
            pid = self._slurmd_pid(layout, spec.name)
            nodes.append(
                NodeStatus(
                    name=spec.name,
                    state=state,
                    gpus=spec.gpus,
                    cpus=spec.cpus,
                    memory_mb=spec.memory_mb,
                    port=spec.port,
                    spare=spec.spare,
                    started=pid is not None,
                    slurmd_pid=pid,
                    reason=fields.get("Reason") or None,
                )
            )
        return ClusterStatus(
            state_dir=layout.state_dir,
            slurm_conf=layout.slurm_conf,
            slurm_version=layout.slurm_version,
            running=ctld is not None,
            controller_pid=ctld,
            controller_port=layout.ctld_port,
            munged_pid=self._munged_pid(layout),
            env_file=layout.env_file,
            nodes=tuple(nodes),
        )

    # -- up ------------------------------------------------------------------
    def up(
        self,
        *,
        nodes: int = 4,
        spares: int = 2,
        gpus_per_node: int = 4,
        cpus_per_node: int = 8,
        memory_mb: int = 16000,
        port_base: int = DEFAULT_PORT_BASE,
        job_submit_lua: Path | str | None = None,
        timeout: float = 60.0,
        slurmd_timeout: int = DEFAULT_SLURMD_TIMEOUT_S,
        expedited_requeue: bool = False,
        preempt_mode: str = "",
        grace_time_s: int = DEFAULT_GRACE_TIME_S,
    ) -> ClusterStatus:
        """Write the configuration, start munged, slurmctld and one slurmd per non-spare node; wait until IDLE.

        slurmd_timeout: seconds before Slurm calls a silent node DOWN (SlurmdTimeout).
        expedited_requeue: let jobs use `--requeue=expedite` (Slurm 25.11 on; refused before).
        preempt_mode: "REQUEUE" or "CANCEL": jobs of the `urgent` partition preempt the default
            partition's, which get `grace_time_s` (GraceTime) and their own --signal first; "": none.
        """
        check_state_dir(self.state_dir)
        require_root("up", "slurmd runs jobs as their users")
        for program in ("munged", "slurmctld", "slurmd", "scontrol", "sinfo", "squeue", "scancel"):
            require_program(program)
        if self.exists():
            left = self.leftover_processes()
            if left:
                what = "is already up" if self._ctld_pid(self._paths()) is not None else "is partly running"
                raise ClusterAlreadyUp(
                    f"the local cluster in {self.state_dir} {what} (pids {', '.join(map(str, left))}); "
                    "use it, or stop it first with `slurm-elastic cluster down`"
                )
        lua_source = Path(job_submit_lua).expanduser() if job_submit_lua else None
        if lua_source is not None and not lua_source.is_file():
            raise ClusterSetupError(f"--job-submit-lua {lua_source}: no such file")
        version = detect_version()
        if expedited_requeue and version < SlurmVersion(25, 11):
            raise ClusterSetupError(f"--expedited-requeue needs Slurm 25.11 or later; this is Slurm {version}")
        layout = ClusterLayout(
            state_dir=self.state_dir,
            slurm_version=str(version),
            nodes=nodes,
            spares=spares,
            gpus_per_node=gpus_per_node,
            cpus_per_node=cpus_per_node,
            memory_mb=memory_mb,
            port_base=port_base,
            job_submit_lua=lua_source is not None,
            slurmd_timeout=slurmd_timeout,
            expedited_requeue=expedited_requeue,
            preempt_mode=preempt_mode,
            grace_time_s=grace_time_s,
        )
        layout.check_step_sockets()
        self._check_ports(layout)
        self._write_files(layout, version, lua_source)
        started = time.monotonic()
        try:
            self._start_munged(layout)
            self._start_ctld(layout, timeout)
            recovered = self._forget_the_last_run(layout)
            self._mark_spares_down(layout)
            serving = [spec.name for spec in layout.node_specs if not spec.spare]
            for name in serving:
                self._start_slurmd(layout, name)
            self._resume_drained(serving, timeout)
            self.wait_for_nodes(serving, node_state_serving, timeout=timeout, what="IDLE")
            self._wait_until_gone(recovered, timeout)
        except BaseException:
            # Never leave half a cluster behind: stop whatever this call started.
            try:
                self._stop_everything(layout)
            except ClusterSetupError as exc:
                log.error("cleanup after a failed start: %s", exc)
            raise
        log.info("local cluster up in %.2f s (%s)", time.monotonic() - started, layout.slurm_conf)
        return self.status()

    def _check_ports(self, layout: ClusterLayout) -> None:
        owners = {layout.ctld_port: "slurmctld", **{spec.port: f"{spec.name}'s slurmd" for spec in layout.node_specs}}
        busy = [f"{port} ({owner})" for port, owner in owners.items() if not processes.port_free(port)]
        if busy:
            raise ClusterSetupError(
                f"port(s) on 127.0.0.1 already in use: {', '.join(busy)}; "
                f"choose free ones with --port-base (now {layout.port_base})"
            )

    def _write_files(self, layout: ClusterLayout, version: SlurmVersion, lua_source: Path | None) -> None:
        for directory in (
            layout.etc_dir,
            layout.dev_dir,
            layout.run_dir,
            layout.log_dir,
            layout.ctld_state_dir,
            layout.spool_root,
            *(layout.slurmd_spool(name) for name in layout.node_names),
        ):
            directory.mkdir(parents=True, exist_ok=True)
        # munged wants its key readable only by its user and its socket
        # directory (see ClusterLayout.runtime_dir) executable by all.
        layout.munge_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for directory in (layout.runtime_dir.parent, layout.runtime_dir):
            directory.mkdir(mode=0o755, exist_ok=True)
            os.chmod(directory, 0o755)
        if not layout.munge_key.is_file():
            fd = os.open(layout.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as key:
                key.write(os.urandom(128))  # what `mungekey -b 1024` writes
        for name in layout.node_names:
            for index, path in enumerate(layout.gpu_files(name)):
                self._make_gpu_file(path, index)
        _write_text(layout.slurm_conf, render_slurm_conf(layout, version))
        _write_text(layout.gres_conf, render_gres_conf(layout))
        cgroup = render_cgroup_conf(version)
        if cgroup is not None:
            _write_text(layout.cgroup_conf, cgroup)
        elif layout.cgroup_conf.exists():
            layout.cgroup_conf.unlink()
        if lua_source is not None:
            shutil.copyfile(lua_source, layout.job_submit_lua_path)
        elif layout.job_submit_lua_path.exists():
            layout.job_submit_lua_path.unlink()
        _write_text(layout.layout_file, layout.to_json())
        _write_text(layout.env_file, f"export SLURM_CONF={layout.slurm_conf}\n")

    @staticmethod
    def _make_gpu_file(path: Path, index: int) -> None:
        try:
            if stat.S_ISCHR(path.lstat().st_mode):
                return
            path.unlink()
        except FileNotFoundError:
            pass
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(_GPU_DEVICE_MAJOR, index))
        except PermissionError:
            # Some containers forbid mknod; Slurm then sets only SLURM_GPUS_ON_NODE.
            log.warning("cannot create character device %s; using a plain file (no CUDA_VISIBLE_DEVICES)", path)
            path.touch()

    def _start_munged(self, layout: ClusterLayout) -> None:
        argv = [
            require_program("munged"),
            f"--socket={layout.munge_socket}",
            f"--key-file={layout.munge_key}",
            f"--pid-file={layout.munge_pid}",
            f"--log-file={layout.munge_log}",
            f"--seed-file={layout.munge_seed}",
        ]
        processes.run_daemon(argv, env=self._env(), startup_log=layout.log_dir / "munged.start.log")
        _wait_until(
            layout.munge_socket.exists, 10.0, f"munged did not create {layout.munge_socket}; see {layout.munge_log}"
        )

    def _start_ctld(self, layout: ClusterLayout, timeout: float) -> None:
        # A pid file left by a killed slurmctld would read as "started, then died".
        layout.ctld_pid.unlink(missing_ok=True)
        argv = [require_program("slurmctld"), "-f", str(layout.slurm_conf)]
        processes.run_daemon(argv, env=self._env(), startup_log=layout.log_dir / "slurmctld.start.log")

        def answering() -> bool:
            # The daemon creates its pid file empty and writes its pid a moment later: only a pid that is
            # gone means it exited. (Taking the empty file for an exit made `up` stop, with SIGTERM, a
            # slurmctld that was starting: seen on 22.05 here and on 26.05 in CI, "Terminate signal" 1 ms after
            # "Running as primary controller".)
            if _exited(layout.ctld_pid):
                raise ClusterSetupError(f"slurmctld exited during start; see {layout.ctld_log}")
            result = self.slurm("scontrol", "ping", timeout=10.0, check=False)
            return result.returncode == 0 and "UP" in result.stdout

        _wait_until(answering, timeout, f"slurmctld did not answer within {timeout:.0f} s; see {layout.ctld_log}")

    def _forget_the_last_run(self, layout: ClusterLayout) -> list[str]:
        """Cancel the jobs that slurmctld recovered from this directory's last run.

        After an unclean stop (daemons killed, the machine gone) slurmctld recovers the jobs it had and
        requeues them: a CI run on this machine once found the jobs of a killed earlier run holding every
        node, and each of its own jobs waited for a timeout. `up` promises an empty cluster, so they are
        cancelled here, before any slurmd serves, where no recovered job can start.
        """
        jobs = sorted(self._job_ids(), key=lambda job: (len(job), job))
        if jobs:
            self.slurm("scancel", *jobs, check=False)
            log.warning("cancelled %d job(s) recovered from the last run of %s (stopped uncleanly): %s",
                        len(jobs), self.state_dir, " ".join(jobs))
        return jobs

    def _wait_until_gone(self, jobs: list[str], timeout: float) -> None:
        """Wait until the cancelled recovered jobs have left the queue.

        A cancelled job that was running stays COMPLETING until its node's slurmd registers and confirms it
        ended: a session that ran squeue right after `up` saw the killed run's job (seen in CI, 24.11).
        """
        deadline = time.monotonic() + timeout
        while left := sorted(set(jobs) & set(self._job_ids()), key=lambda job: (len(job), job)):
            if time.monotonic() >= deadline:
                raise ClusterSetupError(f"job(s) recovered from the last run and cancelled are still listed after "
                                        f"{timeout:.0f} s: {' '.join(left)}; see {self.layout.ctld_log}")
            time.sleep(0.1)

    def _resume_drained(self, names: list[str], timeout: float) -> None:
        """Resume those of names that a state recovered from the last run left drained.

        ReturnToService=2 brings a DOWN node back when its slurmd registers; a drained one stays drained,
        and Slurm refuses to resume it until then (UNKNOWN+DRAIN).
        """
        states = self.node_states()
        drained = [n for n in names if "DRAIN" in states.get(n, {}).get("State", "")]
        if not drained:
            return
        self.wait_for_nodes(drained, lambda state: not state.startswith("UNKNOWN"), timeout=timeout,
                            what="registered")
        self.slurm("scontrol", "update", f"NodeName={','.join(drained)}", "State=RESUME")
        log.warning("resumed node(s) drained in the last run of %s: %s", self.state_dir, " ".join(drained))

    def _job_ids(self) -> list[str]:
        return self.slurm("squeue", "-h", "-o", "%i", check=False).stdout.split()

    def _mark_spares_down(self, layout: ClusterLayout) -> None:
        """Spares are configured DOWN, but a state recovered from an earlier run may say otherwise."""
        if not layout.spare_names:
            return
        states = self.node_states()
        not_down = [n for n in layout.spare_names if "DOWN" not in states.get(n, {}).get("State", "DOWN")]
        if not_down:
            self.slurm("scontrol", "update", f"NodeName={','.join(not_down)}", "State=DOWN", f"Reason={SPARE_REASON}")

    def _start_slurmd(self, layout: ClusterLayout, name: str) -> int:
        """Start one node's slurmd and return its pid once its pid file names it."""
        layout.slurmd_pid(name).unlink(missing_ok=True)  # left by a SIGKILLed slurmd
        argv = [require_program("slurmd"), "-f", str(layout.slurm_conf), "-N", name]
        processes.run_daemon(argv, env=self._env(), startup_log=layout.log_dir / f"slurmd-{name}.start.log")
        pid_file = layout.slurmd_pid(name)
        _wait_until(
            lambda: pid_file.exists() and (self._slurmd_pid(layout, name) is not None or _exited(pid_file)),
            10.0,
            f"slurmd of {name} wrote no pid file within 10 s; see {layout.slurmd_log(name)}",
        )
        pid = self._slurmd_pid(layout, name)
        if pid is None:
            raise ClusterSetupError(f"slurmd of {name} exited right after starting; see {layout.slurmd_log(name)}")
        return pid

    # -- waiting ---------------------------------------------------------------
    def wait_for_nodes(
        self,
        names: Iterable[str],
        predicate: Callable[[str], bool],
        *,
        timeout: float,
        what: str = "ready",
    ) -> dict[str, str]:
        """Poll `scontrol show node` until predicate(State) holds for every node in names; return their states."""
        names = list(names)
        layout = self.layout
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while True:
            view = self.node_states()
            states = {name: view.get(name, {}).get("State", "UNKNOWN") for name in names}
            if all(predicate(state) for state in states.values()):
                return states
            if time.monotonic() >= deadline:
                waiting = ", ".join(f"{n}={s}" for n, s in states.items() if not predicate(s))
                logs = ", ".join(str(layout.slurmd_log(n)) for n in names if not predicate(states[n]))
                raise ClusterSetupError(
                    f"nodes not {what} after {timeout:.0f} s: {waiting}; see {logs} and {layout.ctld_log}"
                )
            time.sleep(0.1)

    # -- breaking and mending nodes ------------------------------------------
    def _known(self, layout: ClusterLayout, name: str) -> None:
        if name not in layout.node_names:
            raise UnknownNode(f"unknown node {name!r}; this cluster has {', '.join(layout.node_names)}")

    def node_down(self, name: str, *, mark_down: bool = False, freeze: bool = False,
                  reason: str = "slurm-elastic cluster node-down") -> int:
        """SIGKILL the node's slurmd and everything it runs (a real node failure); return the slurmd pid.

        Slurm notices by itself: the node becomes DOWN+NOT_RESPONDING 13-30 s
        later (SlurmdTimeout=10, then a ping round) and its `--requeue` jobs go back to PENDING.
        With mark_down, also set it DOWN at once (`scontrol update State=DOWN`),
        as an administrator would; Slurm then requeues its jobs immediately.
        With freeze, SIGSTOP them instead (a hung node: its connections stay open and nothing
        answers on them); `node-down` again kills them, and then `node-up` starts the node again.
        """
        require_root("node-down", "its daemons are root's")
        layout = self.layout
        self._known(layout, name)
        pid = self._slurmd_pid(layout, name)
        if pid is None:
            raise ClusterSetupError(f"node {name} is not running (its slurmd is not up); nothing to kill")
        stepds = processes.stepds_writing([layout.slurmd_log(name)])

        def running_here() -> list[int]:
            # The slurmd's own children too: one it forked that is not a slurmstepd yet holds its listening
            # socket, and outliving the slurmd it would keep the node's port from the next node-up.
            return sorted({*stepds, *processes.descendants(stepds), *processes.descendants([pid])})
        # A real node's processes end in the same instant. Killed one by one here, one that outlives another
        # by a moment acts on its end: srun's shepherd (its forked child) answers srun's end by cancelling
        # the step, and Slurm SIGKILLs its tasks on every node, the survivors on the others too (seen on 22.05
        # under load: the survivor gone before its just-in-time commit). So all are stopped first, then
        # killed children before parents: a stopped process whose parent dies is sent SIGHUP and SIGCONT by
        # the kernel (its process group orphaned), and would run on, while one already sent SIGKILL cannot.
        processes.send(pid, signal.SIGSTOP)
        victims: list[int] = []
        while new := [other for other in running_here() if other not in victims]:   # forked before its stop
            for victim in new:
                processes.send(victim, signal.SIGSTOP)
            victims += new
        if freeze:
            log.info("node %s frozen: stopped slurmd %d and %d job processes", name, pid, len(victims))
            return pid
        for victim in processes.children_first([pid, *victims]):
            processes.send(victim, signal.SIGKILL)
        left = processes.wait_gone([pid, *victims], 5.0)
        if left:
            raise ClusterSetupError(f"node {name}: pids {left} survived SIGKILL")
        log.info("node %s down: killed slurmd %d and %d job processes", name, pid, len(victims))
        if mark_down:
            self._mark_down(name, reason)
        return pid

    def _mark_down(self, name: str, reason: str, *, watch_s: float = 4.0) -> None:
        """State=DOWN, and again if Slurm puts the dead node back in service within watch_s.

        Seen on 26.05.5 (CI's sid chroot): a reply the node had sent just before it died reached
        slurmctld's agent after the DOWN, `node_did_resp: node n1 returned to service` (ReturnToService=2)
        followed 0.7 s later, and the next job was started on the dead node and never finished.
        """
        update = ("scontrol", "update", f"NodeName={name}", "State=DOWN", f"Reason={reason}")
        self.slurm(*update)
        deadline = time.monotonic() + watch_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
            state = self.node_states().get(name, {}).get("State", "")
            if "DOWN" not in state.split("+"):
                log.warning("node %s came back as %s after State=DOWN with its slurmd dead; marking it DOWN again",
                            name, state)
                self.slurm(*update)

    def retire_spare(self, name: str) -> None:
        """Put a started spare back to its initial state: slurmd stopped, DOWN with the spare reason."""
        require_root("retire a spare", "its daemons are root's")
        layout = self.layout
        self._known(layout, name)
        if name not in layout.spare_names:
            raise ClusterSetupError(f"{name} is not a spare node (spares: {', '.join(layout.spare_names) or 'none'})")
        if self._slurmd_pid(layout, name) is not None:
            # As node-down --mark-down: a reply its slurmd sent just before dying can put it back in service.
            self.node_down(name, mark_down=True, reason=SPARE_REASON)
        else:
            self.slurm("scontrol", "update", f"NodeName={name}", "State=DOWN", f"Reason={SPARE_REASON}")

    def node_up(self, name: str, *, wait: bool = True, timeout: float = 30.0) -> int:
        """Start the node's slurmd again (or a spare's for the first time); return its pid.

        With wait, return once Slurm shows the node serving (IDLE or running jobs).
        """
        require_root("node-up", "slurmd runs jobs as their users")
        layout = self.layout
        self._known(layout, name)
        if self._ctld_pid(layout) is None:
            raise ClusterSetupError(f"the local cluster in {self.state_dir} is not up; run `slurm-elastic cluster up`")
        running = self._slurmd_pid(layout, name)
        if running is not None:
            raise ClusterSetupError(f"node {name} is already up (slurmd pid {running})")
        port = layout.node(name).port
        # processes just killed (a frozen node's) can hold the port a moment after they are reaped: seen on
        # 24.11 in CI right after `node-down` of a frozen node; something holding it for 10 s is an error
        _wait_until(lambda: processes.port_free(port), 10.0,
                    f"port {port} for {name}'s slurmd is in use on 127.0.0.1")
        pid = self._start_slurmd(layout, name)
        if wait:
            self.wait_for_nodes([name], node_state_serving, timeout=timeout, what="back in service")
        return pid

    def set_slurmd_timeout(self, seconds: int) -> int:
        """Change SlurmdTimeout of the running cluster (rewrite slurm.conf, `scontrol reconfigure`); return the old one.

        For tests that kill nodes on a cluster that otherwise runs with a long timeout:
        the change is read back from slurmctld, so a reconfigure that did not take is an error.
        """
        require_root("change SlurmdTimeout", "slurm.conf is root's")
        layout = self.layout
        if self._ctld_pid(layout) is None:
            raise ClusterSetupError(f"the local cluster in {self.state_dir} is not up; run `slurm-elastic cluster up`")
        old = layout.slurmd_timeout
        if seconds == old:
            return old
        changed = replace(layout, slurmd_timeout=seconds)
        version = detect_version()
        _write_text(changed.slurm_conf, render_slurm_conf(changed, version))
        _write_text(changed.layout_file, changed.to_json())
        before = {name: self._slurmd_pid(layout, name) for name in layout.node_names}
        before_ctld = self._ctld_pid(layout)
        self.slurm("scontrol", "reconfigure", timeout=60.0)
        if version.reconfigure_replaces_daemons:
            # The old processes hand over to new ones, which write their pid files a moment later: until
            # then a node-down by pid file would kill a process that is already leaving. Under load the
            # pid files were seen missing after the handover (24.11, 26.05), so each successor is found
            # by its argv once it is the only one left, and its pid file written if need be.
            daemons = [(layout.ctld_pid, self._ctld_identity(layout), before_ctld)]
            daemons += [(layout.slurmd_pid(name), self._slurmd_identity(layout, name), old_pid)
                        for name, old_pid in before.items() if old_pid is not None]
            for pid_file, identity, old_pid in daemons:
                _adopt_successor(pid_file, identity, old_pid, 60.0,
                                 f"{identity.program} did not come back under a new pid after `scontrol reconfigure` "
                                 f"(Slurm {version}); see {layout.ctld_log}")
        _wait_until(lambda: self.slurmd_timeout_in_effect() == seconds, 60.0,
                    f"slurmctld did not take SlurmdTimeout={seconds} after reconfigure; see {layout.ctld_log}")
        log.info("SlurmdTimeout %d s -> %d s", old, seconds)
        return old

    def slurmd_timeout_in_effect(self) -> int | None:
        """SlurmdTimeout as slurmctld reports it (`scontrol show config`), in seconds."""
        for line in self.slurm("scontrol", "show", "config", timeout=60.0).stdout.splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "SlurmdTimeout":
                number = value.strip().split()[0] if value.strip() else ""
                return int(number) if number.isdigit() else None
        return None

    # -- down ------------------------------------------------------------------
    def down(self, *, grace: float = 1.5) -> list[int]:
        """Cancel every job, stop all daemons, and prove that no process of the cluster is left.

        Returns the pids that were running before. Raises if any survived.
        """
        require_root("down", "its daemons are root's")
        try:
            layout = self.layout
        except ClusterSetupError:
            if not self.leftover_processes():
                raise
            layout = self._paths()   # a garbled cluster.json must not keep its daemons running
        before = self.leftover_processes()
        if self._ctld_pid(layout) is not None:
            self._cancel_all_jobs(grace)
        self._stop_everything(layout)
        return before

    def _cancel_all_jobs(self, grace: float) -> None:
        jobs = self._job_ids()
        if not jobs:
            return
        self.slurm("scancel", *jobs, check=False)

        def nodes_released() -> bool:
            # A cancelled job stays COMPLETING on its nodes until their slurmd
            # reports it done; stopping slurmctld before that makes it wait
            # seconds for the hung RPC.
            states = [fields.get("State", "") for fields in self.node_states().values()]
            return all(s.split("+")[0] in ("IDLE", "DOWN") and "COMPLETING" not in s for s in states)

        # Give jobs a moment to end cleanly; what is left is SIGKILLed with its step daemon.
        _wait_until(nodes_released, grace, None)

    def _stop_everything(self, layout: ClusterLayout) -> None:
        # slurmctld first, while the slurmds still answer: it saves its state
        # and exits in a fraction of a second. (With the slurmds gone it waits
        # up to 3 s for RPCs to them; those are worth nothing here.)
        ctld = self._ctld_pid(layout)
        if ctld is not None:
            processes.stop([ctld], grace=1.5)
        # Then every job process, and the slurmds: they keep no state worth
        # saving, and one busy with a dying job takes seconds over SIGTERM.
        stepds = processes.stepds_writing(layout.slurmd_log(n) for n in layout.node_names)
        slurmds = [pid for n in layout.node_names if (pid := self._slurmd_pid(layout, n)) is not None]
        victims = [*stepds, *processes.descendants(stepds), *slurmds]
        for pid in victims:
            processes.send(pid, signal.SIGKILL)
        processes.wait_gone(victims, 5.0)
        munged = self._munged_pid(layout)
        if munged is not None:
            processes.stop([munged], grace=5.0)
        # Anything still alive that carries our configuration (e.g. a daemon
        # whose pid file was lost) is ours too: stop it as well, then verify.
        stray = self.leftover_processes()
        if stray:
            processes.stop(stray, grace=2.0)
        left = self.leftover_processes()
        if left:
            raise ClusterSetupError(f"processes of the local cluster still running after down: {left}")
        try:
            layout.runtime_dir.rmdir()  # munged removed its socket on exit
        except OSError:
            pass


def require_root(action: str, why: str) -> None:
    """Refuse, in one line, a cluster command that changes root's daemons when not run as root."""
    if os.geteuid() != 0:
        raise ClusterSetupError(f"`slurm-elastic cluster {action}` must run as root ({why}); use sudo")


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _adopt_successor(pid_file: Path, identity: processes.Identity, old_pid: int | None, timeout: float,
                     error: str) -> int:
    """The one live process that is `identity` and not old_pid; the pid file is made to name it."""
    found: list[int] = []

    def handed_over() -> bool:
        found[:] = processes.matching(identity)
        return len(found) == 1 and found[0] != old_pid

    _wait_until(handed_over, timeout, error)
    if processes.read_pid(pid_file) != found[0]:
        log.info("%s is pid %d; its pid file %s said %s: rewritten", identity.program, found[0], pid_file,
                 processes.read_pid(pid_file))
        _write_text(pid_file, f"{found[0]}\n")
    return found[0]


def _exited(pid_file: Path) -> bool:
    """The pid file names a process that is gone (the daemon died after writing it)."""
    pid = processes.read_pid(pid_file)
    return pid is not None and not processes.is_alive(pid)


def _wait_until(predicate: Callable[[], bool], timeout: float, error: str | None) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            if error is None:
                return False
            raise ClusterSetupError(error)
        time.sleep(0.05)
