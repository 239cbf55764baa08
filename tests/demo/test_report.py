"""The report: table rows say what the summary says; the PNG and the HTML page are written and embed each other."""

from __future__ import annotations

import base64
import json

from slurm_elastic.demo.report import COLUMNS, _gpus_on_grid, job_bands, table_rows, write_report
from slurm_elastic.demo.summary import summarize
from slurm_elastic.demo.timeline import Timeline
from tests.demo.timelines import demo_timeline


def test_table_rows_per_job():
    rows = {r["job"]: r for r in table_rows(summarize(demo_timeline()))}
    a, b, c = rows["digits-a (11)"], rows["digits-b (12)"], rows["digits-c (13)"]
    assert set(a) == set(COLUMNS)
    assert a["GPUs over time"] == "8 -> 4" and a["restarts"] == "1"
    assert a["steps lost per restart"] == "8 (not signalled, n2 lost)"
    assert a["node loss -> training again"] == "40.0 s" and a["node gain -> training again"] == "kept training"
    assert b["steps lost per restart"] == "0 (signalled, n5 gained)" and b["GPUs over time"] == "4 -> 8"
    assert b["node gain -> training again"] == "15.0 s"
    assert c["restarts"] == "0" and c["steps lost per restart"] == "-" and c["final step"] == "341"


def test_write_report_leaves_png_html_summary_and_timeline(tmp_path):
    timeline = demo_timeline()
    summary = summarize(timeline)
    files = write_report(tmp_path / "r", timeline, summary)
    png = files.png.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    page = files.html.read_text()
    assert base64.b64encode(png).decode() in page
    for cell in ("digits-a (11)", "8 (not signalled, n2 lost)", "n5 gained", "All checks passed"):
        assert cell in page
    assert json.loads(files.summary.read_text()) == json.loads(json.dumps(summary.to_json()))
    assert Timeline.read(files.timeline) == timeline


def test_html_lists_failed_checks(tmp_path):
    timeline = demo_timeline(b_resume_gap=2)
    files = write_report(tmp_path, timeline, summarize(timeline))
    page = files.html.read_text()
    assert "Checks failed" in page and "signalled restart 1 lost 2 steps" in page


def test_an_empty_timeline_still_gives_a_report(tmp_path):
    timeline = Timeline(started_at=0.0, jobs=(), events=(), ended_at=3.0)
    files = write_report(tmp_path, timeline, summarize(timeline))
    assert files.png.stat().st_size > 0 and "<table>" in files.html.read_text()


def test_each_job_keeps_its_band_while_another_waits_at_zero():
    # A stacked plot restacks when a job waits at 0 GPUs, so untouched jobs look as if they shrank.
    summary = summarize(demo_timeline())
    _, held = _gpus_on_grid(summary, summary.wall_s)
    waiting = [[0] * len(held[0]), *held[1:]]           # the first job pending the whole time
    bands, bands_waiting = job_bands(summary.jobs, held), job_bands(summary.jobs, waiting)
    assert [b[:2] for b in bands] == [b[:2] for b in bands_waiting]
    assert [b[0] for b in bands] == [sum(j.max_gpus for j in summary.jobs[k + 1:]) for k in range(len(summary.jobs))]
    for base, height, values in bands:
        assert all(0 <= v <= height for v in values)
