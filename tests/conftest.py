"""Shared pytest fixtures: the live Slurm cluster (`slurm_cluster`) and the `--long` option.

Live tests are marked `@pytest.mark.slurm` and take the session fixture::

    @pytest.mark.slurm
    def test_something(slurm_cluster, tmp_path):
        job = slurm_cluster.sbatch("#!/bin/bash\\nsrun hostname\\n", "-N2", "--gres=gpu:2", "--mem=1G",
                                   cwd=tmp_path)
        slurm_cluster.wait_for(lambda: slurm_cluster.job(job)["JobState"] == "COMPLETED", 30)
        subprocess.run(["squeue"], env=slurm_cluster.env)   # or rely on os.environ["SLURM_CONF"]

Which cluster:

- `SLURM_ELASTIC_TEST_CLUSTER=/path/slurm.conf` set: that existing cluster
  (a site's test partition, another Slurm version). It must offer nodes with
  GPUs. `.local` is None there unless that slurm.conf belongs to a running
  `slurm-elastic cluster`, and tests that break nodes call
  `slurm_cluster.require_local()`, which skips them.
- otherwise the embedded local cluster in the default state directory
  (`$SLURM_ELASTIC_CLUSTER_DIR` or `$XDG_STATE_HOME/slurm-elastic/cluster`):
  reused if it is up (then never torn down by the tests), else brought up
  once for the session and stopped at its end. Several pytest sessions may
  share it: the last one to finish stops it.
- Slurm not installed, or not root (the local cluster needs root): every
  test using the fixture is skipped with that reason.

For the whole session `os.environ["SLURM_CONF"]` points at the cluster, so
Backend code and subprocesses find it without passing `env`.

Tests that break the cluster restore it: `slurm_cluster.restore()` restarts
stopped nodes, retires started spares and waits until the usual nodes serve.

SlurmdTimeout: the local cluster the tests start runs with 300 s, so a loaded
machine cannot make Slurm call a healthy node DOWN (with 10 s it did: running
jobs requeued, nodes drained). A test that kills a node and leaves the
detection to Slurm (`slurm_cluster.local.node_down(name)` without mark_down)
asks for the short one by doing so: SlurmdTimeout is 10 s from that call to
the end of the test (one such test at a time across sessions).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from slurm_elastic.devcluster import LocalCluster, layout, node_state_serving, processes
from slurm_elastic.devcluster.layout import DEFAULT_PORT_BASE
from slurm_elastic.devcluster.status import parse_scontrol_nodes, parse_scontrol_record
from slurm_elastic.devcluster.version import INSTALL_HINT, find_program
from slurm_elastic.errors import ElasticError

import ports  # tests/ports.py: tests/ is on sys.path here, as for users.py (a suite loaded by path has it too)

T = TypeVar("T")

TEST_CLUSTER_ENV = "SLURM_ELASTIC_TEST_CLUSTER"
TEST_SLURMD_TIMEOUT_S = 300          # the shared cluster's: load cannot trip it
# While a test waits for Slurm to notice a node it killed. Below Slurm's own margin: slurmctld applies a
# ping round's answers only once the round ends, and a round with the dead node in it ends ~13 s later
# (24.11.5, debug2 log: n1-n3 answered at :42.011, applied at :55), so healthy nodes can pass the 10 s
# and be set DOWN for a second (seen 1 run in 3 in the trixie chroot). Tests must allow for that.
NODE_FAILURE_SLURMD_TIMEOUT_S = 10


# root's tools (runuser, useradd, slurmctld, mount helpers) live in the sbin directories, which a minimal
# environment (`env -i PATH=/usr/bin:/bin ...`, as a fresh CI machine may give) leaves out.
_SBIN = [d for d in ("/usr/local/sbin", "/usr/sbin", "/sbin") if d not in os.environ.get("PATH", "").split(":")]
if _SBIN:
    os.environ["PATH"] = ":".join([os.environ.get("PATH", ""), *_SBIN]).lstrip(":")


_WORKER_CLUSTER_ENV = "ELASTIC_TESTS_CLUSTER_OF_WORKER"


def _one_cluster_per_worker() -> None:
    """Under pytest-xdist each worker brings up a local cluster of its own (state directory and ports).

    Live tests mostly wait on Slurm, not the CPU, so they wait side by side; a worker never shares nodes
    another worker's test breaks. An external cluster (SLURM_ELASTIC_TEST_CLUSTER) is not split: its
    workers take turns (pytest_xdist_auto_num_workers gives it one).
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit() or os.environ.get(TEST_CLUSTER_ENV):
        return
    if os.environ.get(_WORKER_CLUSTER_ENV) == worker:   # a pytest a test starts inherits its worker's cluster
        return
    os.environ[_WORKER_CLUSTER_ENV] = worker
    index = int(worker[2:])
    base = layout.default_state_dir()
    os.environ[layout.CLUSTER_DIR_ENV] = str(base.with_name(f"{base.name}-{worker}"))
    # Each worker searches its own window of ports (tests/ports.py), so two workers never pick the same ones.
    start = processes.port_search_start() + 100 + ports.WORKER_WINDOW * index
    os.environ[processes.PORT_SEARCH_START_ENV] = str(start)


_one_cluster_per_worker()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: four workers (live tests wait on Slurm, not on the 2 cores); one on an external cluster."""
    return 1 if os.environ.get(TEST_CLUSTER_ENV) else 4


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--heavy-last",
        action="store_true",
        default=False,
        help="run tests marked `heavy` after the others (a suite beside another on one host)",
    )
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="also run long reliability variants (tests marked `long`)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--heavy-last"):
        # A suite beside the host's (.ci/run): its heavy tests wait for the host's on HEAVY_LOCK, so
        # it does its other tests first, while the host's heavy ones run.
        items.sort(key=lambda item: item.get_closest_marker("heavy") is not None)
    if config.getoption("--long"):
        return
    skip_long = pytest.mark.skip(reason="long variant: run with --long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip_long)


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """When a live test fails, keep its private cluster's logs and show their tails in the report.

    CI's chroot clusters are removed at teardown, and CI keeps only what pytest printed: without
    this, a failure seen once on one Slurm version could not be explained afterwards.
    """
    outcome = yield
    report = outcome.get_result()
    if not report.failed or call.when == "setup":
        return
    if call.when == "call":
        item.stash[_CALL_FAILED] = True
    for name in ("elastic_cluster", "slurm_cluster"):
        local = getattr(getattr(item, "funcargs", {}).get(name), "local", None)
        if local is not None and local.exists():
            _keep_cluster_logs(item, report, local)
            return


def _keep_cluster_logs(item: pytest.Item, report: pytest.TestReport, local: LocalCluster) -> None:
    log_dir = local.layout.log_dir
    keep = item.config._tmp_path_factory.getbasetemp() / "failed-cluster-logs" / item.name[:80]  # type: ignore[attr-defined]
    keep.mkdir(parents=True, exist_ok=True)
    tails = []
    for log in sorted(log_dir.glob("*.log")):
        text = log.read_text(errors="replace")
        (keep / log.name).write_text(text)
        lines = text.splitlines()
        if log.name.startswith("slurmctld"):   # what Slurm did with each job, not the teardown's noise
            jobs = [line for line in lines if "JobId=" in line]
            tails.append(f"--- {log.name}: its last 150 lines naming a job ---\n" + "\n".join(jobs[-150:]))
        elif log.name.startswith("slurmd-"):
            tails.append(f"--- {log.name}: last 25 lines ---\n" + "\n".join(lines[-25:]))
    report.sections.append(("cluster logs (all kept in " + str(keep) + ")", "\n".join(tails)))


@dataclass
class SlurmTestCluster:
    """The cluster a live test talks to; see the module docstring.

    slurm_conf: its slurm.conf. env: os.environ plus SLURM_CONF, for subprocesses.
    local: the LocalCluster (node-down/up, spares) or None for an external cluster.
    nodes: the GPU nodes serving at session start (e.g. n1..n4); spares: nodes
    a test may start as "gained" (empty on an external cluster).
    gpus_per_node: GPUs of the smallest of `nodes`. slurm_version: e.g. "22.05.8".
    """

    slurm_conf: Path
    env: dict[str, str]
    local: LocalCluster | None
    nodes: tuple[str, ...]
    spares: tuple[str, ...]
    gpus_per_node: int
    slurm_version: str
    partition: str | None

    def run(self, *argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command (`run("squeue", "-h")`) against this cluster; text output."""
        result = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def sbatch(self, script: str, *args: str, cwd: Path) -> int:
        """Submit `script` (its text) with sbatch args from directory cwd; return the job id."""
        cwd.mkdir(parents=True, exist_ok=True)
        path = cwd / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        chosen = any(a.startswith(("-p", "--partition")) for a in args)
        partition = ("-p", self.partition) if self.partition and not chosen else ()
        out = self.run("sbatch", "--parsable", *partition, *args, str(path), timeout=30).stdout.strip()
        return int(out.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol -o show job` as {key: value} (JobState, NodeList, Restarts, Reason, ...); {} once purged."""
        result = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        line = result.stdout.strip()
        if result.returncode != 0 or not line:
            return {}
        return parse_scontrol_record(line)

    def cancel(self, *job_ids: int) -> None:
        if job_ids:
            self.run("scancel", *map(str, job_ids), check=False)

    def node_states(self) -> dict[str, str]:
        """{node: Slurm State} for every node, e.g. {"n1": "IDLE", "n2": "DOWN+NOT_RESPONDING"}."""
        parsed = parse_scontrol_nodes(self.run("scontrol", "-o", "show", "node").stdout)
        return {name: fields.get("State", "UNKNOWN") for name, fields in parsed.items()}

    def node_state(self, name: str) -> str:
        return self.node_states().get(name, "UNKNOWN")

    @staticmethod
    def wait_for(predicate: Callable[[], T], timeout: float, interval: float = 0.25, what: str = "") -> T:
        """Poll predicate until it returns something truthy (returned); fail the test after timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what or predicate}")
            time.sleep(interval)

    def require_local(self) -> LocalCluster:
        """The LocalCluster, or skip: breaking nodes is only done on a cluster we started."""
        if self.local is None:
            pytest.skip(f"needs a `slurm-elastic cluster` (node-down/up); {TEST_CLUSTER_ENV} points at another cluster")
        return self.local

    def restore(self, timeout: float = 30.0) -> None:
        """Bring the local cluster back to its session-start shape (no-op on an external cluster)."""
        if self.local is None:
            return
        status = self.local.status()
        for node in status.nodes:
            if node.spare and (node.started or "DOWN" not in node.state):
                self.local.retire_spare(node.name)
            elif not node.spare and not node.started:
                self.local.node_up(node.name, wait=False)
            elif not node.spare and ("DRAIN" in node.state or node.state.startswith("DOWN")):
                # Running but drained or set DOWN by a test: what an administrator would resume.
                self.run("scontrol", "update", f"NodeName={node.name}", "State=RESUME", check=False)
        self.local.wait_for_nodes(self.nodes, node_state_serving, timeout=timeout, what="back in service")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _live_users(users_dir: Path) -> list[int]:
    alive = []
    for entry in users_dir.glob("*"):
        if entry.name.isdigit() and Path(f"/proc/{entry.name}").exists():
            alive.append(int(entry.name))
        else:
            entry.unlink(missing_ok=True)  # a session that died without teardown
    return alive


def _describe(conf: Path, local: LocalCluster | None) -> SlurmTestCluster:
    env = {**os.environ, "SLURM_CONF": str(conf)}
    parsed = parse_scontrol_nodes(
        subprocess.run(["scontrol", "-o", "show", "node"], env=env, capture_output=True, text=True, timeout=30).stdout
    )
    partition = None
    if local is not None:
        layout = local.layout
        nodes = tuple(n for n in layout.node_names if n not in layout.spare_names)
        spares = layout.spare_names
        gpus = layout.gpus_per_node
        version = layout.slurm_version
        partition = layout.partition
    else:
        def gpu_count(fields: dict[str, str]) -> int:
            for item in fields.get("Gres", "").split(","):
                parts = item.split("(")[0].split(":")
                if parts[0] == "gpu" and parts[-1].isdigit():
                    return int(parts[-1])
            return 0

        serving = {n: f for n, f in parsed.items() if gpu_count(f) > 0 and node_state_serving(f.get("State", ""))}
        if not serving:
            pytest.fail(f"{TEST_CLUSTER_ENV}={conf}: the cluster has no serving nodes with GPUs (Gres=gpu:N)")
        nodes = tuple(sorted(serving))
        spares = ()
        gpus = min(gpu_count(f) for f in serving.values())
        out = subprocess.run(["sinfo", "-V"], env=env, capture_output=True, text=True, timeout=30).stdout
        version = out.split()[-1] if out.strip() else "unknown"
    return SlurmTestCluster(
        slurm_conf=conf,
        env=env,
        local=local,
        nodes=nodes,
        spares=spares,
        gpus_per_node=gpus,
        slurm_version=version,
        partition=partition,
    )


class _SharedLocalCluster(LocalCluster):
    """The LocalCluster the live tests share: a node killed for Slurm to notice gets the short SlurmdTimeout."""

    _retiring = False

    def node_down(self, name: str, **kwargs: object) -> int:
        if not kwargs.get("mark_down") and not self._retiring:
            _shorten_slurmd_timeout(self)
        return super().node_down(name, **kwargs)  # type: ignore[arg-type]

    def retire_spare(self, name: str) -> None:
        # retire_spare marks the node DOWN itself: Slurm need not notice anything.
        self._retiring = True
        try:
            super().retire_spare(name)
        finally:
            self._retiring = False


# state dir -> (cluster, SlurmdTimeout to go back to, the lock held meanwhile)
_SHORTENED: dict[Path, tuple[LocalCluster, int, object]] = {}


def _shorten_slurmd_timeout(local: LocalCluster) -> None:
    if local.state_dir in _SHORTENED:
        return
    handle = (local.state_dir / "slurmd-timeout.lock").open("a")
    fcntl.flock(handle, fcntl.LOCK_EX)   # another session's node-failure test finishes first
    try:
        old = _reconfigured(local, NODE_FAILURE_SLURMD_TIMEOUT_S)
    except BaseException:
        handle.close()
        raise
    _SHORTENED[local.state_dir] = (local, old, handle)


def _reconfigured(local: LocalCluster, seconds: int) -> int:
    """set_slurmd_timeout, keeping the started-by-tests marker on slurmctld (23.11+ gives it a new pid)."""
    marker = local.state_dir / "started-by-tests"
    before = local.status().controller_pid
    old = local.set_slurmd_timeout(seconds)
    try:
        if int(marker.read_text().strip()) == before:
            marker.write_text(f"{local.status().controller_pid}\n")
    except (OSError, ValueError):
        pass   # not started by tests: nothing to keep
    return old


def _restart_if_gone(local: LocalCluster, slurmd_timeout: int) -> None:
    """Seen once on 24.11.5 (CI's trixie chroot): the reconfigure that sets SlurmdTimeout back handed over to
    no new slurmctld, and every later test found no cluster. Start it again in the same shape, so that
    one failed hand-over costs one warning, not the rest of the session."""
    import warnings

    if local.is_up():
        return
    layout = local.layout
    try:
        local.down()
        local.up(nodes=layout.nodes, spares=layout.spares, gpus_per_node=layout.gpus_per_node,
                 cpus_per_node=layout.cpus_per_node, memory_mb=layout.memory_mb, port_base=layout.port_base,
                 slurmd_timeout=slurmd_timeout)
        (local.state_dir / "started-by-tests").write_text(f"{local.status().controller_pid}\n")
        warnings.warn(f"the local cluster was gone after a failed reconfigure; started it again ({local.state_dir})")
    except ElasticError as exc:
        warnings.warn(f"the local cluster is gone and could not be started again: {exc}")


# Shared by the suites that run at once on one host (.ci/other-slurms bind-mounts /tmp into its chroots).
HEAVY_LOCK = Path("/tmp/slurm-elastic-heavy-tests.lock")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Tests marked `heavy` (many torch ranks at once) run one at a time per host, across suites.

    CI runs three live suites at once (one per Slurm version); three demos at once took the load of
    this 2-core machine to 40 and the host's demo from 142 s to 486 s. Uncontended, this costs nothing.
    The lock is taken outside pytest-timeout's timer (this wrapper runs first): a test's time limit is
    for the test, and a wait behind the other suites' heavy tests once took all of it (CI, 22.05).
    """
    if item.get_closest_marker("heavy") is None:
        yield
        return
    fd = os.open(HEAVY_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if os.fstat(fd).st_uid != os.geteuid():  # /tmp is everyone's: a lock someone else made could be held forever
            raise pytest.UsageError(f"{HEAVY_LOCK} belongs to uid {os.fstat(fd).st_uid}, not to us; remove it")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # closing releases the flock


@pytest.fixture(autouse=True)
def _shared_cluster_back_after_a_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """A live test that failed with a node down or drained (its own restore not reached) gets the shared
    cluster restored after it: in CI one such failure once took n2 from the six tests after it on its worker."""
    yield
    if not request.node.stash.get(_CALL_FAILED, False) or "slurm_cluster" not in request.fixturenames:
        return
    cluster = request.getfixturevalue("slurm_cluster")
    try:
        cluster.restore(timeout=60)
    except (ElasticError, AssertionError, subprocess.SubprocessError) as exc:
        import warnings

        warnings.warn(f"could not restore the shared cluster after {request.node.name} failed: {exc}")


@pytest.fixture(autouse=True)
def _slurmd_timeout_back_after_each_test() -> Iterator[None]:
    """A shortened SlurmdTimeout lasts one test (cheap when nothing was shortened)."""
    yield
    for state_dir, (local, old, handle) in list(_SHORTENED.items()):
        try:
            if local.is_up():
                _reconfigured(local, old)
        except ElasticError as exc:
            import warnings

            warnings.warn(f"could not set SlurmdTimeout back to {old} s: {exc}")
            _restart_if_gone(local, old)
        finally:
            handle.close()   # closing releases the flock
            del _SHORTENED[state_dir]


def _local_owning(conf: Path) -> LocalCluster | None:
    """The running LocalCluster whose slurm.conf is conf, if any (<state>/etc/slurm.conf)."""
    local = _SharedLocalCluster(conf.resolve().parent.parent)
    return local if local.exists() and local.slurm_conf == conf.resolve() and local.is_up() else None


def _port_base() -> int:
    """Slurm's usual ports, or free ones if another cluster (another state directory) holds them."""
    count = 4 + 2 + 4  # slurmctld, the gap before n1, 4 nodes and 2 spares
    if os.environ.get(processes.PORT_SEARCH_START_ENV):  # a suite beside others (.ci/other-slurms)
        return ports.free_port_base(count)
    if all(processes.port_free(port) for port in range(DEFAULT_PORT_BASE, DEFAULT_PORT_BASE + count)):
        return DEFAULT_PORT_BASE
    return ports.free_port_base(count)


def _started_by_tests(local: LocalCluster, marker: Path) -> bool:
    try:
        recorded = int(marker.read_text().strip())
    except (OSError, ValueError):
        return False
    return local.is_up() and local.status().controller_pid == recorded


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmTestCluster]:
    """The live Slurm cluster for tests marked `slurm` (see the module docstring)."""
    previous = os.environ.get("SLURM_CONF")
    external = os.environ.get(TEST_CLUSTER_ENV)
    local: LocalCluster | None
    stop_at_end = False
    if external:
        conf = Path(external).expanduser()
        if not conf.is_file():
            pytest.fail(f"{TEST_CLUSTER_ENV}={external}: no such slurm.conf")
        if find_program("sinfo") is None:
            pytest.skip(f"Slurm client commands are not installed; {INSTALL_HINT}")
        local = _local_owning(conf)
        cluster = _describe(conf, local)
    else:
        if find_program("slurmctld") is None or find_program("slurmd") is None or find_program("sinfo") is None:
            pytest.skip(f"Slurm is not installed (slurmctld/slurmd/sinfo not found); {INSTALL_HINT}")
        if os.geteuid() != 0:
            pytest.skip(f"the local Slurm cluster needs root (or set {TEST_CLUSTER_ENV}=/path/slurm.conf)")
        local = _SharedLocalCluster()
        users = local.state_dir / "test-sessions"
        users.mkdir(parents=True, exist_ok=True)
        marker = local.state_dir / "started-by-tests"
        with _locked(local.state_dir / "test-sessions.lock"):
            others = [pid for pid in _live_users(users) if pid != os.getpid()]
            (users / str(os.getpid())).touch()
            if not others and _started_by_tests(local, marker):   # (which holds only while it is up)
                # Left up by a test session that was killed: its jobs may still hold nodes, a node may
                # still be down and SlurmdTimeout still the short one. No live session uses it: start afresh.
                import warnings

                warnings.warn(f"the local cluster was left up by a test session that ended without its teardown; "
                              f"starting it afresh ({local.state_dir})")
                local.down()
                marker.unlink(missing_ok=True)
            if not local.is_up():
                try:
                    local.up(port_base=_port_base(), slurmd_timeout=TEST_SLURMD_TIMEOUT_S)
                except ElasticError as exc:
                    (users / str(os.getpid())).unlink(missing_ok=True)
                    pytest.fail(f"cannot start the local Slurm cluster: {exc}")
                # Remember which slurmctld the tests started: a cluster that a
                # person started (or restarted since) is never stopped by tests.
                marker.write_text(f"{local.status().controller_pid}\n")
            stop_at_end = _started_by_tests(local, marker)
        conf = local.slurm_conf
        cluster = _describe(conf, local)
    os.environ["SLURM_CONF"] = str(conf)
    try:
        yield cluster
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        if local is not None and not external:
            users = local.state_dir / "test-sessions"
            with _locked(local.state_dir / "test-sessions.lock"):
                (users / str(os.getpid())).unlink(missing_ok=True)
                if stop_at_end and _started_by_tests(local, marker) and not _live_users(users):
                    local.down()
                    marker.unlink(missing_ok=True)


@pytest.fixture
def short_cluster_dir() -> Iterator[Path]:
    """A private cluster's state directory short enough for slurmstepd's sockets (ClusterLayout refuses a
    longer one): pytest's tmp_path under xdist, and more so under the chroots' basetemp, is not."""
    root = Path(tempfile.mkdtemp(prefix="se-c-", dir="/tmp"))
    try:
        yield root / "cluster"
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- acting as real unprivileged users ----------------------------------------------------------------------
INSTALLED_CLI = Path(sys.executable).parent / "slurm-elastic"   # the entry point of the venv running the tests


@pytest.fixture(scope="session")
def user_pythons() -> Iterator[Callable[[str], "UserPython"]]:
    """`user_pythons(name)`: that real user (created if missing) and an interpreter it can run; see tests/users.py."""
    from users import UserPython, runnable_as_user, user_python

    why = runnable_as_user()
    made: dict[str, UserPython] = {}

    def get(name: str) -> UserPython:
        if why:
            pytest.skip(why)
        if name not in made:
            try:
                made[name] = user_python(name)
            except RuntimeError as exc:
                pytest.fail(f"cannot run tests as {name}: {exc}")
        return made[name]

    try:
        yield get
    finally:
        for entry in made.values():
            entry.close()
