"""`slurm-elastic cluster` commands without live Slurm: bad input gets one line and exit 2."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.devcluster.layout import ClusterLayout


def test_commands_on_a_missing_cluster_say_how_to_start_one(tmp_path: Path) -> None:
    runner = CliRunner()
    for args in (["status"], ["down"], ["env"], ["node-down", "n1"], ["node-up", "n1"]):
        result = runner.invoke(main, ["cluster", *args, "--state-dir", str(tmp_path / "none")])
        assert result.exit_code == 2, (args, result.output)
        assert "no local cluster in" in result.output and "cluster up" in result.output


def test_unknown_node_exits_2_with_the_known_names(tmp_path: Path) -> None:
    layout = ClusterLayout(state_dir=tmp_path, slurm_version="22.05.8", nodes=2, spares=0)
    layout.layout_file.write_text(layout.to_json())
    result = CliRunner().invoke(main, ["cluster", "node-down", "n7", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown node 'n7'; this cluster has n1, n2" in result.output


def test_status_json_and_env_of_a_stopped_cluster(tmp_path: Path) -> None:
    import json

    layout = ClusterLayout(state_dir=tmp_path, slurm_version="22.05.8")
    layout.layout_file.write_text(layout.to_json())
    result = CliRunner().invoke(main, ["cluster", "status", "--json", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    status = json.loads(result.output)
    assert status["slurm_conf"] == str(layout.slurm_conf)
    assert status["state_dir"] == str(tmp_path)
    assert [node["name"] for node in status["nodes"]] == list(layout.node_names)
    assert all(node["gpus"] == 4 for node in status["nodes"])
    env = CliRunner().invoke(main, ["cluster", "env", "--state-dir", str(tmp_path)])
    assert env.output == f"export SLURM_CONF={layout.slurm_conf}\n"


def test_up_rejects_bad_numbers_before_touching_anything(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["cluster", "up", "--nodes", "0", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert not tmp_path.joinpath("cluster.json").exists()
