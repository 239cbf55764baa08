"""A second, private cluster: up with options, a job running, then down leaves no process behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from slurm_elastic.devcluster import LocalCluster, processes
from slurm_elastic.devcluster.version import find_program
from slurm_elastic.errors import ClusterSetupError
from tests import ports

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(find_program("slurmctld") is None, reason="Slurm is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the local cluster needs root"),
]


def _free_port_base(count: int) -> int:
    """A port base with count free ports after it (the fixture's cluster uses the defaults)."""
    return ports.free_port_base(count, ports.LIFECYCLE)


@pytest.fixture
def short_dir(short_cluster_dir: Path) -> Path:
    return short_cluster_dir


def test_up_with_options_runs_a_job_and_down_leaves_nothing(short_dir: Path, tmp_path: Path) -> None:
    base = _free_port_base(8)
    local = LocalCluster(short_dir)
    status = local.up(nodes=2, spares=1, gpus_per_node=2, cpus_per_node=4, memory_mb=4000, port_base=base)
    try:
        assert status.running
        assert [n.name for n in status.nodes] == ["n1", "n2", "n3"]
        assert [n.serving for n in status.nodes] == [True, True, False]
        assert {n.gpus for n in status.nodes} == {2}
        assert status.controller_port == base and status.nodes[0].port == base + 4
        env = {**os.environ, **local.env()}
        job = subprocess.run(
            ["sbatch", "--parsable", "-N1", "--gres=gpu:2", "--mem=1G", "-o", str(tmp_path / "o"),
             "--wrap", "sleep 600"],
            env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()
        deadline = time.monotonic() + 30
        while subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True,
                             text=True).stdout.strip() != "RUNNING":
            assert time.monotonic() < deadline, "job never started"
            time.sleep(0.2)
        # RUNNING is set at allocation; the step daemon starts the script a moment later.
        deadline = time.monotonic() + 15
        while not any((processes.cmdline(p) or [""])[0] == "sleep" for p in local.leftover_processes()):
            assert time.monotonic() < deadline, "the job's `sleep` is never counted as the cluster's"
            time.sleep(0.1)
        running = local.leftover_processes()
        # A second `up` on the same directory is refused and changes nothing.
        with pytest.raises(ClusterSetupError, match="already up"):
            local.up(port_base=base)
    finally:
        stopped = local.down()
    assert set(running) <= set(stopped)
    assert local.leftover_processes() == []
    for pid in running:
        assert not processes.is_alive(pid), pid  # a zombie awaiting its reaper counts as gone
    assert not local.is_up()
    assert local.status().nodes[0].state == "STOPPED"


def test_up_refuses_busy_ports(short_dir: Path) -> None:
    base = _free_port_base(8)
    with socket.socket() as sock:
        # As free_port_base judged the port: connections of an earlier cluster may linger in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", base + 5))  # n2's port
        sock.listen()
        with pytest.raises(ClusterSetupError, match=rf"{base + 5} \(n2's slurmd\)"):
            LocalCluster(short_dir).up(nodes=2, spares=0, port_base=base)
    assert not LocalCluster(short_dir).exists(), "a refused `up` writes nothing"


def test_a_failed_up_leaves_no_half_cluster(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = _free_port_base(8)
    original = LocalCluster._start_slurmd

    def failing(self: LocalCluster, layout, name: str) -> None:  # type: ignore[no-untyped-def]
        if name == "n2":
            raise ClusterSetupError("slurmd of n2 would not start (injected)")
        original(self, layout, name)

    monkeypatch.setattr(LocalCluster, "_start_slurmd", failing)
    local = LocalCluster(short_dir)
    with pytest.raises(ClusterSetupError, match="injected"):
        local.up(nodes=3, spares=0, port_base=base)
    # munged, slurmctld and n1's slurmd had started; all are gone again.
    assert local.leftover_processes() == []
    assert not local.is_up()


def test_up_after_an_unclean_stop_runs_nothing_of_the_last_run(short_dir: Path, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """Daemons killed under a running and a queued job, a node drained: the next `up` is an empty cluster."""
    base = _free_port_base(8)
    local = LocalCluster(short_dir)
    local.up(nodes=2, spares=0, gpus_per_node=2, cpus_per_node=4, memory_mb=4000, port_base=base)
    env = {**os.environ, **local.env()}

    def sbatch(*args: str) -> str:
        return subprocess.run(["sbatch", "--parsable", "-o", str(tmp_path / "%j.out"), *args], env=env,
                              capture_output=True, text=True, check=True).stdout.strip()

    def job_states() -> dict[str, str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=env, capture_output=True, text=True,
                             check=True).stdout
        return dict(line.split() for line in out.splitlines())

    try:
        running = sbatch("-N1", "--gres=gpu:2", "--mem=1G", "--requeue", "--wrap", "sleep 600")
        queued = sbatch("-N2", "--gres=gpu:2", "--mem=1G", "--requeue", "--wrap", "sleep 600")
        deadline = time.monotonic() + 30
        while job_states().get(running) != "RUNNING":
            assert time.monotonic() < deadline, f"job {running} never started: {job_states()}"
            time.sleep(0.2)
        assert job_states()[queued] == "PENDING"
        subprocess.run(["scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=left by a test"], env=env,
                       check=True)
        # As when a session is killed: slurmctld is told to stop (it saves its state), everything else dies.
        processes.stop([local.status().controller_pid], grace=5.0)
        for pid in local.leftover_processes():
            processes.send(pid, signal.SIGKILL)
        processes.wait_gone(local.leftover_processes(), 10.0)
        assert not local.is_up()

        with caplog.at_level("WARNING", logger="slurm_elastic.devcluster.local"):
            status = local.up(nodes=2, spares=0, gpus_per_node=2, cpus_per_node=4, memory_mb=4000, port_base=base)
        assert [n.serving for n in status.nodes] == [True, True], status.nodes
        # Neither job comes back: the requeued one does not restart and the queued one does not start.
        time.sleep(5)
        assert not {state for state in job_states().values()} & {"RUNNING", "PENDING", "CONFIGURING"}, job_states()
        assert not any((processes.cmdline(p) or [""])[0] == "sleep" for p in local.leftover_processes())
        assert f"(stopped uncleanly): {running} {queued}" in caplog.text
        assert "drained in the last run" in caplog.text and caplog.text.rstrip().endswith("n2")
    finally:
        local.down()
    assert local.leftover_processes() == []


def test_up_refuses_a_state_dir_too_long_for_slurmstepds_sockets_and_writes_nothing(short_cluster_dir: Path) -> None:
    deep = short_cluster_dir.parent / ("d" * 60) / "cluster"
    with pytest.raises(ClusterSetupError, match="too long: slurmstepd's socket"):
        LocalCluster(deep).up(nodes=1, spares=0, port_base=_free_port_base(5))
    assert not deep.exists(), "a refused `up` writes nothing"
