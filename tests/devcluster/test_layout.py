"""ClusterLayout: validation of `up` options, default state directory, cluster.json round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.devcluster.layout import ClusterLayout, default_state_dir
from slurm_elastic.errors import ClusterSetupError


def test_defaults_are_four_nodes_and_two_spares() -> None:
    layout = ClusterLayout(state_dir=Path("/x"), slurm_version="22.05.8")
    assert layout.node_names == ("n1", "n2", "n3", "n4", "n5", "n6")
    assert layout.spare_names == ("n5", "n6")
    assert layout.all_ports == (6817, 6821, 6822, 6823, 6824, 6825, 6826)
    assert layout.node("n2").gpus == 4 and layout.node("n2").memory_mb == 16000
    with pytest.raises(KeyError):
        layout.node("n7")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nodes": 0}, "--nodes must be at least 1"),
        ({"spares": -1}, "--spares"),
        ({"gpus_per_node": 65}, "--gpus"),
        ({"cpus_per_node": 0}, "--cpus"),
        ({"memory_mb": 10}, "--mem-mb"),
        ({"port_base": 80}, "--port-base 80"),
        ({"port_base": 65530}, "--port-base 65530"),
    ],
)
def test_bad_options_are_refused_with_the_option_named(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ClusterSetupError, match=message):
        ClusterLayout(state_dir=Path("/x"), slurm_version="22.05.8", **kwargs)  # type: ignore[arg-type]


def test_json_round_trip(tmp_path: Path) -> None:
    layout = ClusterLayout(state_dir=tmp_path, slurm_version="24.11.5", nodes=3, spares=1, port_base=9000,
                           job_submit_lua=True)
    layout.layout_file.write_text(layout.to_json())
    assert ClusterLayout.load(tmp_path) == layout


def test_load_without_a_cluster_says_how_to_start_one(tmp_path: Path) -> None:
    with pytest.raises(ClusterSetupError, match="slurm-elastic cluster up"):
        ClusterLayout.load(tmp_path)


def test_default_state_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SLURM_ELASTIC_CLUSTER_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "slurm-elastic" / "cluster"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_state_dir() == tmp_path / "home" / ".local" / "state" / "slurm-elastic" / "cluster"
    monkeypatch.setenv("SLURM_ELASTIC_CLUSTER_DIR", str(tmp_path / "mine"))
    assert default_state_dir() == tmp_path / "mine"


def test_munge_socket_is_short_and_distinct_per_state_dir() -> None:
    a = ClusterLayout(state_dir=Path("/a/" + "x" * 200), slurm_version="22.05.8")
    b = ClusterLayout(state_dir=Path("/b"), slurm_version="22.05.8")
    assert len(str(a.munge_socket)) < 108
    assert a.munge_socket != b.munge_socket


def test_a_state_dir_too_long_for_slurmstepds_sockets_is_refused_at_up() -> None:
    # Seen in CI: under a long pytest basetemp every batch job failed to launch ("launch failed requeued held",
    # slurmd: "Unix socket path ... is too long. (111 > 108)") on a cluster that `up` had reported healthy.
    fits = Path("/" + "d" * (107 - len("/spool/n6/n6_67043328.4294967291") - 1))
    layout = ClusterLayout(state_dir=fits, slurm_version="22.05.8")
    assert len(str(layout.longest_step_socket)) == 107
    assert str(layout.longest_step_socket).endswith("/spool/n1/n1_67043328.4294967291")
    layout.check_step_sockets()
    longer = ClusterLayout(state_dir=Path(str(fits) + "d"), slurm_version="22.05.8")   # still loads and shows
    with pytest.raises(ClusterSetupError, match=r"too long: slurmstepd's socket .* would be 108 bytes"):
        longer.check_step_sockets()
    with pytest.raises(ClusterSetupError, match="would be 109 bytes"):   # n10: the longest node name counts
        ClusterLayout(state_dir=fits, slurm_version="22.05.8", spares=6).check_step_sockets()
