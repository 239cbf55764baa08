"""LocalCluster checks that refuse bad input before anything starts, and scontrol text parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.devcluster import LocalCluster, UnknownNode, node_state_serving
from slurm_elastic.devcluster import local as local_module
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
