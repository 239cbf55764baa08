"""The whole demo on the live local cluster (shorter schedule), and the promises its report must keep."""

from __future__ import annotations

import html
import json

import pytest

from slurm_elastic.demo.scenario import Demo, DemoOptions
from slurm_elastic.demo.summary import summarize
from slurm_elastic.demo.timeline import Timeline


@pytest.mark.slurm
@pytest.mark.heavy
@pytest.mark.slurm_once     # its Slurm paths are the control live tests', run on every version
@pytest.mark.timeout(900)
def test_demo_runs_to_the_end_and_its_report_keeps_the_promises(slurm_cluster, tmp_path):
    local = slurm_cluster.require_local()
    if not slurm_cluster.spares:
        pytest.skip("the demo needs a spare node to gain")
    # Its promises assume the 16 GPUs are the demo's: let other tests' jobs finish first.
    slurm_cluster.wait_for(lambda: not slurm_cluster.run("squeue", "-h").stdout.strip(), 180,
                           what="the cluster to have no jobs left from other tests")
    # Shorter than `slurm-elastic demo`: the lost node is marked DOWN at once, fewer steps per phase.
    options = DemoOptions(report_dir=tmp_path / "report", state_dir=local.state_dir, mark_down=True,
                          settle_s=4.0, min_steps=3, start_timeout_s=240, recover_timeout_s=240,
                          grow_timeout_s=240)
    try:
        result = Demo(options).run()
    finally:
        slurm_cluster.restore(timeout=60)
    assert result.error is None, result.error

    body = json.loads(result.files.summary.read_text())
    assert [e["action"] for e in body["events"]] == ["node_lost", "node_gained"]
    assert len(body["jobs"]) == 3
    for job in body["jobs"]:
        assert job["restarts"] <= 2, job
        for restart in job["restart_details"]:
            if restart["signalled"]:
                assert restart["steps_lost"] == 0, restart
            assert restart["resumed_from"] is not None and restart["steps_lost"] >= 0, restart
        assert [a["trained_after"] for a in job["after_events"]] == [True, True], job
    assert body["problems"] == []
    # The method did something: a job restarted after the loss, and the jobs hold more GPUs after the gain.
    restarted = [a for job in body["jobs"] for a in job["after_events"] if a["event"].endswith("lost")
                 and a["restarted"]]
    assert restarted and all(a["recovery_s"] > 0 for a in restarted)
    gained = [a for job in body["jobs"] for a in job["after_events"] if a["event"].endswith("gained")]
    assert sum(a["gpus_after"] for a in gained) > sum(a["gpus_before"] for a in gained)

    # The controller's restarts, phase by phase (at least the signalled growth, a running job's plan).
    assert any(r["kind"] == "resize" and r["phases"] for r in body["restart_phases"]), body["restart_phases"]
    assert all(html.escape(r["line"]) in result.files.html.read_text() for r in body["restart_phases"])
    # The report's numbers are those of the recorded timeline, and the picture and the page exist.
    again = summarize(Timeline.read(result.files.timeline)).to_json()
    assert again["jobs"] == body["jobs"] and again["events"] == body["events"]
    assert result.files.png.read_bytes().startswith(b"\x89PNG")
    assert "data:image/png;base64," in result.files.html.read_text()
    # Nothing of the demo is left running on the cluster.
    ids = {j["job"] for j in body["jobs"]}
    queue = slurm_cluster.run("squeue", "-h", "-o", "%i %T").stdout.split("\n")
    assert not [line for line in queue if line.split() and line.split()[0] in ids and "COMPLETING" not in line]
