"""The daemon's rigid-job options become the RigidPolicy the controller decides with."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from slurm_elastic.allocate.from_state import RigidPolicy
from slurm_elastic.cli import main
from slurm_elastic.cli.controller_options import rigid_policy
from slurm_elastic.errors import SpecError


def test_the_defaults_are_the_policys_defaults() -> None:
    assert rigid_policy("", 0.0, "protected", "minimum") == RigidPolicy()


def test_partitions_yield_time_minimum_and_guarantee_reach_the_policy() -> None:
    rules = rigid_policy(" gpu, long ,", 120.0, "by-priority", "submitted")
    assert rules.partitions == ("gpu", "long") and rules.yield_after_s == 120.0 and not rules.protect_minimum
    assert rules.guarantee == "submitted"


@pytest.mark.parametrize("bad", ["gpu;rm", "a b", "x" * 65])
def test_a_bad_partition_name_is_one_line(bad: str) -> None:
    with pytest.raises(SpecError, match="--rigid-partitions"):
        rigid_policy(bad, 0.0, "protected", "minimum")


def test_the_daemon_refuses_a_bad_minimum_or_guarantee_choice_before_it_starts(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SLURM_ELASTIC_DAEMON_DIR", str(tmp_path))
    out = CliRunner().invoke(main, ["admin", "daemon", "--elastic-minimum", "never"])
    assert out.exit_code == 2 and "--elastic-minimum" in out.output
    out = CliRunner().invoke(main, ["admin", "daemon", "--elastic-guarantee", "everything"])
    assert out.exit_code == 2 and "--elastic-guarantee" in out.output


def test_the_objective_variable_reaches_every_controllers_policy(monkeypatch) -> None:
    from slurm_elastic.cli.controller_options import controller_config
    from slurm_elastic.errors import SettingError

    monkeypatch.delenv("SLURM_ELASTIC_OBJECTIVE", raising=False)
    assert controller_config(60.0, 300.0, 6, "USR2").policy.objective == "legacy"
    monkeypatch.setenv("SLURM_ELASTIC_OBJECTIVE", "progress")
    assert controller_config(60.0, 300.0, 6, "USR2").policy.objective == "progress"
    monkeypatch.setenv("SLURM_ELASTIC_OBJECTIVE", "fastest")
    with pytest.raises(SettingError, match="SLURM_ELASTIC_OBJECTIVE='fastest': must be one of legacy, progress"):
        controller_config(60.0, 300.0, 6, "USR2")
