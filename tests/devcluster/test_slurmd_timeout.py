"""SlurmdTimeout as a cluster option: long for the shared test cluster, short while a test waits for a node loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.devcluster.layout import DEFAULT_SLURMD_TIMEOUT_S, ClusterLayout
from slurm_elastic.devcluster.slurmconf import render_slurm_conf
from slurm_elastic.devcluster.version import SlurmVersion
from slurm_elastic.errors import ClusterSetupError


def test_default_is_ten_seconds_and_cluster_json_keeps_the_choice(tmp_path: Path) -> None:
    assert ClusterLayout(state_dir=tmp_path, slurm_version="22.05.8").slurmd_timeout == DEFAULT_SLURMD_TIMEOUT_S == 10
    layout = ClusterLayout(state_dir=tmp_path, slurm_version="22.05.8", slurmd_timeout=300)
    layout.layout_file.write_text(layout.to_json())
    assert ClusterLayout.load(tmp_path).slurmd_timeout == 300
    assert "SlurmdTimeout=300\n" in render_slurm_conf(layout, SlurmVersion(22, 5, 8))


def test_a_cluster_json_from_before_the_option_loads_with_the_default(tmp_path: Path) -> None:
    data = json.loads(ClusterLayout(state_dir=tmp_path, slurm_version="22.05.8").to_json())
    del data["slurmd_timeout"]
    (tmp_path / "cluster.json").write_text(json.dumps(data))
    assert ClusterLayout.load(tmp_path).slurmd_timeout == 10


@pytest.mark.parametrize("seconds", [0, -5, 70000])
def test_out_of_range_is_refused(tmp_path: Path, seconds: int) -> None:
    with pytest.raises(ClusterSetupError, match="--slurmd-timeout"):
        ClusterLayout(state_dir=tmp_path, slurm_version="22.05.8", slurmd_timeout=seconds)
    result = CliRunner().invoke(main, ["cluster", "up", "--slurmd-timeout", str(seconds),
                                       "--state-dir", str(tmp_path / "c")])
    assert result.exit_code == 2 and "--slurmd-timeout" in result.output
    assert not (tmp_path / "c").exists()


@pytest.mark.slurm
def test_shared_cluster_is_long_and_a_node_killed_for_slurm_to_notice_gets_the_short_one(slurm_cluster) -> None:
    from conftest import NODE_FAILURE_SLURMD_TIMEOUT_S, TEST_SLURMD_TIMEOUT_S

    local = slurm_cluster.require_local()
    if not (local.state_dir / "started-by-tests").exists():
        pytest.skip("the cluster was started outside the tests: its SlurmdTimeout is whoever started it's choice")
    assert local.slurmd_timeout_in_effect() == TEST_SLURMD_TIMEOUT_S
    victim = slurm_cluster.nodes[-1]
    try:
        local.node_down(victim)
        assert local.slurmd_timeout_in_effect() == NODE_FAILURE_SLURMD_TIMEOUT_S
        state = slurm_cluster.wait_for(lambda: (s := slurm_cluster.node_state(victim)).startswith("DOWN") and s,
                                       180, what=f"Slurm to mark {victim} DOWN")
        assert "NOT_RESPONDING" in state
    finally:
        slurm_cluster.restore()


@pytest.mark.slurm
def test_after_a_node_failure_test_the_timeout_is_long_again(slurm_cluster) -> None:
    from conftest import TEST_SLURMD_TIMEOUT_S

    local = slurm_cluster.require_local()
    if not (local.state_dir / "started-by-tests").exists():
        pytest.skip("the cluster was started outside the tests")
    assert local.slurmd_timeout_in_effect() == TEST_SLURMD_TIMEOUT_S
    assert local.layout.slurmd_timeout == TEST_SLURMD_TIMEOUT_S
