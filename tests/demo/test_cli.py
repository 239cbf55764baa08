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


def _fake_run(error=None, gap=0):
    """Demo.run stand-in (no Slurm here): the recorded-style timeline, summarised and written like a real run."""
    from slurm_elastic.demo.report import write_report
    from slurm_elastic.demo.scenario import DemoResult
    from slurm_elastic.demo.summary import summarize
    from tests.demo.timelines import demo_timeline

    def run(self):
        timeline = demo_timeline(b_resume_gap=gap)
        summary = summarize(timeline)
        return DemoResult(timeline, summary, write_report(self.report_dir, timeline, summary), error)
    return run


def test_json_summary_on_stdout_and_exit_0_when_the_checks_hold(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr("slurm_elastic.demo.scenario.Demo.run", _fake_run())
    result = CliRunner().invoke(main, ["demo", "--json", "--report-dir", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["error"] is None and body["problems"] == []
    assert [j["restarts"] for j in body["jobs"]] == [1, 1, 0]
    assert body["report"]["html"] == str(tmp_path / "r" / "index.html")


def test_table_then_exit_1_when_a_check_fails_or_the_demo_stopped_early(tmp_path, monkeypatch):
    monkeypatch.setattr("slurm_elastic.demo.scenario.Demo.run", _fake_run(gap=2))
    result = CliRunner().invoke(main, ["demo", "--report-dir", str(tmp_path / "r")])
    assert result.exit_code == 1
    assert "digits-b (12)" in result.output
    assert "checks failed: digits-b: signalled restart 1 lost 2 steps" in result.output
    monkeypatch.setattr("slurm_elastic.demo.scenario.Demo.run", _fake_run(error="waiting for x: not done after 5 s"))
    result = CliRunner().invoke(main, ["demo", "--report-dir", str(tmp_path / "r")])
    assert result.exit_code == 1 and "the demo stopped early: waiting for x" in result.output
