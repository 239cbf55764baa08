"""LocalCluster checks that refuse bad input before anything starts, and scontrol text parsing."""

from __future__ import annotations

import subprocess
import sys
import threading
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


def _fake_daemon(tmp_path: Path, name: str, *args: str) -> list[str]:
    """argv of a process that passes the cluster's identity check for daemon `name` (a Python named so)."""
    program = tmp_path / "bin" / name
    program.parent.mkdir(exist_ok=True)
    program.symlink_to(sys.executable)
    return [str(program), "-c", "import time; time.sleep(60)", *args]


def _fake_slurmctld(tmp_path: Path, layout: ClusterLayout) -> list[str]:
    return _fake_daemon(tmp_path, "slurmctld", "-f", str(layout.slurm_conf))


def test_a_slurmctld_whose_pid_file_is_still_empty_is_starting_not_exited(tmp_path, monkeypatch):
    """slurmctld creates its pid file empty and writes its pid a moment later (polled on 22.05.8: empty in 14
    of 15 starts). `up` once took that for an exit and stopped the starting daemon. Stand-ins for the start
    and for `scontrol ping`; the daemon is a real process."""
    layout = ClusterLayout(state_dir=tmp_path, slurm_version="22.05.8")
    layout.ctld_pid.parent.mkdir(parents=True, exist_ok=True)
    argv = _fake_slurmctld(tmp_path, layout)
    children: list[subprocess.Popen] = []
    polled_while_empty = []

    def run_daemon(*_, **__):
        layout.ctld_pid.write_text("")   # created, pid not yet written

        def daemon_writes_its_pid() -> None:
            time.sleep(0.5)
            children.append(_started(argv))
            layout.ctld_pid.write_text(f"{children[0].pid}\n")

        threading.Thread(target=daemon_writes_its_pid, daemon=True).start()

    def ping(self, *args, **_):
        written = processes.read_pid(layout.ctld_pid) is not None
        if not written:
            polled_while_empty.append(args)
        return subprocess.CompletedProcess(args, 0 if written else 1, "Slurmctld(primary) at x is UP\n" if written
                                           else "", "")

    monkeypatch.setattr(local_module.processes, "run_daemon", run_daemon)
    monkeypatch.setattr(local_module, "require_program", lambda name: f"/usr/sbin/{name}")
    monkeypatch.setattr(LocalCluster, "slurm", ping)
    try:
        LocalCluster(tmp_path)._start_ctld(layout, 20.0)
        assert polled_while_empty, "the wait never saw the empty pid file: the test proves nothing"
        assert processes.verified_pid(layout.ctld_pid, LocalCluster._ctld_identity(layout)) == children[0].pid
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_a_slurmctld_whose_pid_is_gone_exited_during_start(tmp_path, monkeypatch):
    layout = ClusterLayout(state_dir=tmp_path, slurm_version="22.05.8")
    layout.ctld_pid.parent.mkdir(parents=True, exist_ok=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    monkeypatch.setattr(local_module.processes, "run_daemon",
                        lambda *_, **__: layout.ctld_pid.write_text(f"{gone.pid}\n"))
    monkeypatch.setattr(local_module, "require_program", lambda name: f"/usr/sbin/{name}")
    pings = []
    monkeypatch.setattr(LocalCluster, "slurm",
                        lambda self, *args, **_: pings.append(args) or subprocess.CompletedProcess(args, 1, "", ""))
    with pytest.raises(ClusterSetupError, match="exited during start"):
        LocalCluster(tmp_path)._start_ctld(layout, 600.0)
    assert pings == [], "an exited daemon is reported at its first look, not asked and waited for"


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


def test_a_retired_spare_that_slurm_puts_back_in_service_is_marked_down_again(tmp_path, monkeypatch):
    """A reply the spare's slurmd sent just before it was killed can reach slurmctld after State=DOWN and put
    the node back in service (ReturnToService=2; seen on 26.05.5 after node-down --mark-down). A retired spare
    that came back showed up as `resumed` in the next test's first snapshot (22.05.8). Stand-ins for Slurm's
    commands; the spare's slurmd is a real process."""
    layout = ClusterLayout(state_dir=tmp_path, slurm_version="22.05.8", nodes=1, spares=1)
    layout.layout_file.parent.mkdir(parents=True, exist_ok=True)
    layout.layout_file.write_text(layout.to_json())
    layout.slurmd_pid("n2").parent.mkdir(parents=True, exist_ok=True)
    slurmd = _started(_fake_daemon(tmp_path, "slurmd", "-f", str(layout.slurm_conf), "-N", "n2"))
    layout.slurmd_pid("n2").write_text(f"{slurmd.pid}\n")
    downs = []

    def slurm(self, *args, **_):
        if args[:2] == ("scontrol", "update"):
            downs.append(args)
            return subprocess.CompletedProcess(args, 0, "", "")
        assert args[:3] == ("scontrol", "-o", "show"), args
        state = "IDLE" if len(downs) == 1 else "DOWN"   # back in service once, after the first State=DOWN
        return subprocess.CompletedProcess(args, 0, f"NodeName=n2 State={state} Reason=x\n", "")

    monkeypatch.setattr(LocalCluster, "slurm", slurm)
    try:
        LocalCluster(tmp_path).retire_spare("n2")
    finally:
        slurmd.kill()
        slurmd.wait()
    assert [d[3] for d in downs] == ["State=DOWN", "State=DOWN"]
    assert all(d[4] == f"Reason={local_module.SPARE_REASON}" for d in downs)
