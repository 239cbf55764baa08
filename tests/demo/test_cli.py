"""`slurm-elastic demo` on bad input: one clear line, exit 2, nothing started."""

from __future__ import annotations

from click.testing import CliRunner

from slurm_elastic.cli import main


def test_help_has_an_example():
    result = CliRunner().invoke(main, ["demo", "--help"])
    assert result.exit_code == 0 and "slurm-elastic demo --keep" in result.output


def test_a_report_dir_holding_other_files_is_refused_before_anything_starts(tmp_path, monkeypatch):
    (tmp_path / "thesis.tex").write_text("x")
    started = []
    monkeypatch.setattr("slurm_elastic.demo.scenario.Demo.run", lambda self: started.append(1))
    result = CliRunner().invoke(main, ["demo", "--report-dir", str(tmp_path)])
    assert result.exit_code == 2 and "not a demo report directory" in result.output
    assert started == []


def test_bad_option_values_exit_2(tmp_path):
    result = CliRunner().invoke(main, ["demo", "--report-dir", str(tmp_path / "r"), "--interval", "0"])
    assert result.exit_code == 2 and "--interval" in result.output
