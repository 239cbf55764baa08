"""LocalCluster checks that refuse bad input before anything starts, and scontrol text parsing."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from slurm_elastic.devcluster import LocalCluster, UnknownNode, node_state_serving
from slurm_elastic.devcluster import local as local_module
from slurm_elastic.devcluster import processes
from slurm_elastic.devcluster.layout import ClusterLayout
from slurm_elastic.devcluster.status import parse_scontrol_nodes
from slurm_elastic.errors import ClusterSetupError

# `scontrol -o show node` lines as 22.05 prints them (trimmed).
SCONTROL_NODES = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=2 CPUTot=8 Gres=gpu:4 NodeAddr=127.0.0.1 "
    "State=MIXED ThreadsPerCore=1 Partitions=gpu\n"
    "NodeName=n2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=8 Gres=gpu:4 NodeAddr=127.0.0.1 "
    "State=DOWN+NOT_RESPONDING ThreadsPerCore=1 Partitions=gpu Reason=Not responding [slurm@2026-11-30T04:08:02]\n"
)


def test_parse_scontrol_nodes_keeps_reasons_with_spaces() -> None:
    nodes = parse_scontrol_nodes(SCONTROL_NODES)
    assert set(nodes) == {"n1", "n2"}
    assert nodes["n1"]["State"] == "MIXED"
    assert nodes["n2"]["State"] == "DOWN+NOT_RESPONDING"
    assert nodes["n2"]["Reason"] == "Not responding [slurm@2026-11-30T04:08:02]"


@pytest.mark.parametrize(
    ("state", "serving"),
    [
        ("IDLE", True),
        ("MIXED", True),
        ("ALLOCATED", True),
        ("IDLE+COMPLETING", True),
        ("DOWN", False),
        ("DOWN+NOT_RESPONDING", False),
        ("IDLE+NOT_RESPONDING", False),
        ("IDLE+DRAIN", False),
        ("UNKNOWN", False),
        ("STOPPED", False),
    ],
)
def test_node_state_serving(state: str, serving: bool) -> None:
    assert node_state_serving(state) is serving


def test_up_refuses_non_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(local_module.os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterSetupError, match="must run as root"):
        LocalCluster(tmp_path).up()
    assert list(tmp_path.iterdir()) == []


def test_up_refuses_when_slurm_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(local_module.os, "geteuid", lambda: 0)
    monkeypatch.setattr("slurm_elastic.devcluster.version.find_program", lambda name: None)
    with pytest.raises(ClusterSetupError, match="Slurm is not installed"):
        LocalCluster(tmp_path).up()
    assert list(tmp_path.iterdir()) == []


def test_unknown_node_is_refused_before_anything_is_signalled(tmp_path: Path) -> None:
    layout = ClusterLayout(state_dir=tmp_path, slurm_version="22.05.8")
    layout.layout_file.write_text(layout.to_json())
    local = LocalCluster(tmp_path)
    with pytest.raises(UnknownNode, match="unknown node 'n9'; this cluster has n1, n2"):
        local.node_down("n9")
    with pytest.raises(UnknownNode):
        local.node_up("n9")


def test_status_of_a_stopped_cluster(tmp_path: Path) -> None:
    layout = ClusterLayout(state_dir=tmp_path, slurm_version="22.05.8", nodes=2, spares=1)
    layout.layout_file.write_text(layout.to_json())
    status = LocalCluster(tmp_path).status().to_dict()
    assert status["running"] is False
    assert status["slurm_conf"] == str(tmp_path / "etc" / "slurm.conf")
    assert [(n["name"], n["state"], n["spare"], n["started"]) for n in status["nodes"]] == [
        ("n1", "STOPPED", False, False),
        ("n2", "STOPPED", False, False),
        ("n3", "STOPPED", True, False),
    ]


def test_a_terminate_signal_in_the_ctld_log_is_read_only_from_this_start(tmp_path):
    """The words of 22.05 and of 24.11/26.05; a terminate signal logged before this start does not count."""
    from slurm_elastic.devcluster.local import terminated_by_a_signal

    log = tmp_path / "slurmctld.log"
    assert not terminated_by_a_signal(log)                       # no log yet
    log.write_text("[2026-12-01T11:20:20.325] Terminate signal (SIGINT or SIGTERM) received\n")
    since = log.stat().st_size
    assert terminated_by_a_signal(log)
    with log.open("a") as f:
        f.write("[2026-12-02T00:01:59.463] Running as primary controller\n")
    assert not terminated_by_a_signal(log, since=since)
    with log.open("a") as f:
        f.write("[2026-12-02T00:01:59.465] Terminate signal SIGTERM received\n")
    assert terminated_by_a_signal(log, since=since)


@pytest.mark.parametrize("signalled", [True, False])
def test_a_slurmctld_terminated_while_it_starts_is_started_once_more_and_only_then(tmp_path, monkeypatch,
                                                                                    signalled):
    """Stand-ins for the daemon start and the wait (no Slurm here): the first start dies. With a terminate
    signal in its log it is started once more; without one (it failed on its own) the error stands."""
    layout = ClusterLayout(state_dir=tmp_path, slurm_version="26.05.5")
    layout.ctld_log.parent.mkdir(parents=True, exist_ok=True)
    starts = []

    def run_daemon(argv, **_):
        starts.append(argv)
        if len(starts) == 1:
            layout.ctld_log.write_text("Running as primary controller\n"
                                       + ("Terminate signal SIGTERM received\n" if signalled else "fatal: no\n"))

    def wait_until(predicate, timeout, error):
        if len(starts) == 1:
            raise ClusterSetupError("slurmctld exited during start")
        return True

    monkeypatch.setattr(local_module.processes, "run_daemon", run_daemon)
    monkeypatch.setattr(local_module, "_wait_until", wait_until)
    monkeypatch.setattr(local_module, "require_program", lambda name: f"/usr/sbin/{name}")
    cluster = LocalCluster(tmp_path)
    if signalled:
        cluster._start_ctld(layout, 5.0)
        assert len(starts) == 2
    else:
        with pytest.raises(ClusterSetupError, match="exited during start"):
            cluster._start_ctld(layout, 5.0)
        assert len(starts) == 1


def _started(argv: list[str]) -> subprocess.Popen:
    child = subprocess.Popen(argv)
    while processes.cmdline(child.pid) is None:   # argv appears a moment after exec
        time.sleep(0.01)
    return child


def test_the_successor_of_a_reconfigure_handover_gets_the_pid_file(tmp_path: Path) -> None:
    """24.11+ hands each daemon over to a new process; a pid file lost on the way is written for the successor."""
    identity = processes.Identity("sleep", ("41.731",))
    old, new = _started(["sleep", "41.731"]), _started(["sleep", "41.731"])
    pid_file = tmp_path / "slurmd-n1.pid"
    try:
        # While the old process lives there are two candidates: no guess is made.
        with pytest.raises(ClusterSetupError, match="no successor"):
            local_module._adopt_successor(pid_file, identity, old.pid, 0.3, "no successor")
        assert not pid_file.exists()
        old.kill()
        old.wait()
        assert local_module._adopt_successor(pid_file, identity, old.pid, 10.0, "no successor") == new.pid
        assert processes.read_pid(pid_file) == new.pid
        # The old process alone, with no successor yet, is not taken for one.
        with pytest.raises(ClusterSetupError, match="no successor"):
            local_module._adopt_successor(pid_file, identity, new.pid, 0.3, "no successor")
    finally:
        for child in (old, new):
            child.kill()
            child.wait()
