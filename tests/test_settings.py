"""slurm_elastic/settings.py: each setting once, read in one module, and the controller's options made from it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from slurm_elastic import settings
from slurm_elastic.cli import main
from slurm_elastic.control.reconcile import ControllerConfig
from slurm_elastic.control.requests import RequestSettings
from slurm_elastic.errors import SettingError

PACKAGE = Path(__file__).resolve().parents[1] / "slurm_elastic"
VARIABLE = re.compile(r"SLURM_ELASTIC_[A-Z0-9_]+")


def test_only_the_settings_module_names_a_variable():
    """A variable's name as a whole string (what an environment read needs) appears in settings.py alone;
    help texts may still mention it."""
    named: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and VARIABLE.fullmatch(node.value):
                named.setdefault(str(path.relative_to(PACKAGE)), []).append(node.value)
    assert set(named) == {"settings.py"}, named
    assert sorted(named["settings.py"]) == sorted(s.env for s in settings.SETTINGS if s.env)


def test_each_setting_once_with_unique_names_variables_options_and_heartbeat_keys():
    for field in ("name", "env", "option", "heartbeat"):
        values = [getattr(s, field) for s in settings.SETTINGS if getattr(s, field) is not None]
        assert len(values) == len(set(values)), field


def test_a_variable_is_parsed_and_bounded_and_a_bad_one_is_one_line():
    assert settings.HYSTERESIS.read({}) == 300.0
    assert settings.HYSTERESIS.read({"SLURM_ELASTIC_HYSTERESIS": ""}) == 300.0
    assert settings.HYSTERESIS.read({"SLURM_ELASTIC_HYSTERESIS": "45"}) == 45.0
    assert settings.RESTART_BUDGET.read({"SLURM_ELASTIC_RESTART_BUDGET": "2"}) == 2
    for setting, text, why in ((settings.INTERVAL, "soon", "must be a number"),
                               (settings.INTERVAL, "0.1", "must be at least 0.5"),
                               (settings.INTERVAL, "nan", "must be at least 0.5"),
                               (settings.RESTART_BUDGET, "1.5", "must be a whole number"),
                               (settings.PORT_SEARCH_START, "80", "must be between 1024 and 60000")):
        with pytest.raises(SettingError) as err:
            setting.read({setting.env: text})
        assert str(err.value) == f"{setting.env}={text!r}: {why}"


def test_paths_follow_their_variables(tmp_path):
    assert settings.daemon_dir({}) == Path("/var/lib/slurm-elastic")
    assert settings.daemon_dir({"SLURM_ELASTIC_DAEMON_DIR": str(tmp_path)}) == tmp_path
    assert settings.user_state_dir({"XDG_STATE_HOME": str(tmp_path)}) == tmp_path / "slurm-elastic"
    assert settings.user_state_dir({"SLURM_ELASTIC_STATE_DIR": str(tmp_path / "mine")}) == tmp_path / "mine"
    assert settings.cluster_dir({"XDG_STATE_HOME": str(tmp_path)}) == tmp_path / "slurm-elastic" / "cluster"


def test_the_controller_configs_take_their_defaults_and_heartbeat_keys_from_the_table():
    config = ControllerConfig()
    assert config.min_resize_interval_s == settings.HYSTERESIS.default == RequestSettings().hold_s
    assert config.restart_budget_per_hour == settings.RESTART_BUDGET.default
    assert config.protocol.ack_timeout_s == settings.ACK_TIMEOUT.default
    assert config.protocol.signal == settings.SIGNAL.default
    assert config.node_confirm_s == settings.NODE_CONFIRM_S.default
    announced = config.settings()
    assert set(announced) == {s.heartbeat for s in settings.SETTINGS if s.heartbeat and s is not settings.INTERVAL}
    heard = ControllerConfig().with_settings({**announced, "hysteresis_s": 45.0, "restart_budget_per_hour": 2,
                                              "speed": "linear"})
    assert (heard.min_resize_interval_s, heard.restart_budget_per_hour, heard.measured_speed) == (45.0, 2, False)
    # Out of the setting's bounds: not believed, the own value kept.
    assert ControllerConfig().with_settings({"hysteresis_s": -1.0}).min_resize_interval_s == 300.0


def _command(*path: str) -> click.Command:
    cmd: click.Command = main
    for name in path:
        assert isinstance(cmd, click.Group)
        cmd = cmd.get_command(click.Context(cmd), name)  # type: ignore[assignment]
    return cmd


@pytest.mark.parametrize("command, path", [(settings.DAEMON, ("admin", "daemon")),
                                           (settings.REBALANCE, ("admin", "rebalance")),
                                           (settings.WATCH, ("watch",))])
def test_the_controller_commands_options_are_the_tables(command, path):
    params = {p.name: p for p in _command(*path).params if isinstance(p, click.Option)}
    for setting in settings.for_command(command):
        param = params[setting.name]
        assert param.opts == [setting.option] and param.default == setting.default
        assert param.help == setting.help and param.envvar == setting.env


def test_a_variable_reaches_the_dry_run_through_the_generated_option(monkeypatch, tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from control.fake_slurm import FakeSlurm

    monkeypatch.setattr("slurm_elastic.cluster.select.select_backend", lambda *a, **k: FakeSlurm())
    env = {"SLURM_ELASTIC_DAEMON_DIR": str(tmp_path / "none"), "SLURM_ELASTIC_HYSTERESIS": "45"}
    out = CliRunner().invoke(main, ["admin", "rebalance", "--dry-run"], env=env)
    assert out.exit_code == 0, out.output
    assert "hysteresis_s 45," in out.output
    bad = CliRunner().invoke(main, ["admin", "rebalance", "--dry-run"], env={**env, "SLURM_ELASTIC_HYSTERESIS": "-3"})
    assert bad.exit_code == 2 and "SLURM_ELASTIC_HYSTERESIS" in bad.output


def test_the_shim_reads_the_signal_through_the_table(monkeypatch):
    from slurm_elastic import jobfiles as protocol

    monkeypatch.setenv("SLURM_ELASTIC_SIGNAL", "12")
    assert protocol.signal_name() == "USR2"
    assert protocol.SIGNAL_ENV == settings.SIGNAL.env and protocol.BATCH_ENV == settings.BATCH.env
