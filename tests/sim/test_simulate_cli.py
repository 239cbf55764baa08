"""`slurm-elastic simulate` end to end on small inputs: table, JSON, plots, decisions, and bad input."""

from __future__ import annotations

import json

import pytest

from click.testing import CliRunner

from slurm_elastic.cli import main

from tests.sim.conftest import DATA


def test_simulate_sacct_sample_all_policies_json(tmp_path):
    decisions = tmp_path / "decisions.jsonl"
    result = CliRunner().invoke(main, ["simulate", str(DATA / "sacct-4x4.txt"), "--cluster", "4x4", "--json",
                                       "--no-progress", "--plot", str(tmp_path / "plots"),
                                       "--decisions", str(decisions)])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output[result.output.index("["):])
    assert [r["policy"] for r in rows] == ["static", "tiresias", "optimus", "controller"]
    for r in rows:
        assert r["finished"] == r["jobs"] == 26
        assert 0 < r["gpu_util"] <= 1
        assert r["avg_jct_s"] <= r["p99_jct_s"]
    assert rows[0]["restarts"] == 0  # static never restarts a job without failures
    names = {p.name for p in (tmp_path / "plots").iterdir()}
    assert {"jct-cdf.png", "utilisation.png", "gpus-per-job-controller.png", "gpus-per-job-static.png"} <= names
    lines = [json.loads(x) for x in decisions.read_text().splitlines()]
    assert {x["policy"] for x in lines} == {"static", "tiresias", "optimus", "controller"}


def test_simulate_with_failures_and_both_restart_methods(tmp_path):
    result = CliRunner().invoke(main, ["simulate", str(DATA / "sacct-4x4.txt"), "--cluster", "4x4",
                                       "--policy", "tiresias", "--failures", "every:3600:600", "--restart", "both",
                                       "--markdown", "--no-progress"])
    assert result.exit_code == 0, result.output
    lines = [x for x in result.output.splitlines() if x.startswith("| sacct")]
    assert len(lines) == 2
    assert "forward-layer" in lines[0] and "traditional" in lines[1]


def test_simulate_bad_input_is_one_clear_line(tmp_path):
    bad = tmp_path / "w.csv"
    bad.write_text("submit_s,gpus,duration_s\n-3,1,10\n")
    result = CliRunner().invoke(main, ["simulate", str(bad), "--no-progress"])
    assert result.exit_code == 2
    assert "column submit_s must be >= 0" in result.output
    result = CliRunner().invoke(main, ["simulate", str(bad), "--cluster", "4y4", "--no-progress"])
    assert result.exit_code == 2 and "bad cluster spec" in result.output


def test_per_application_restart_overhead(pollux, tmp_path):
    wl = tmp_path / "w.csv"
    wl.write_text("name,time,application,num_replicas,batch_size\nncf-0,0,ncf,1,32768\n")
    args = ["simulate", str(wl), "--applications", str(pollux / "applications"), "--policy", "static",
            "--cluster", "1x4", "--json", "--no-progress"]
    plain = CliRunner().invoke(main, args)
    slow = CliRunner().invoke(main, args + ["--app-overhead", "ncf=330"])
    assert plain.exit_code == 0 and slow.exit_code == 0, plain.output + slow.output
    jct = [json.loads(r.output[r.output.index("["):])[0]["avg_jct_s"] for r in (plain, slow)]
    assert jct[1] - jct[0] == pytest.approx(300)
    bad = CliRunner().invoke(main, args + ["--app-overhead", "bert=30"])
    assert bad.exit_code == 2 and "not in the workload" in bad.output


def test_adaptive_jobs_finish_sooner_alone_on_a_node(pollux, tmp_path):
    """--adaptive all: the same cifar10 job on 4 GPUs finishes sooner when its batch follows goodput."""
    wl = tmp_path / "w.csv"
    wl.write_text("name,time,application,num_replicas,batch_size\ncifar10-0,0,cifar10,4,128\n")
    args = ["simulate", str(wl), "--applications", str(pollux / "applications"), "--policy", "tiresias",
            "--cluster", "1x4", "--json", "--no-progress"]
    runs = [CliRunner().invoke(main, args + ["--adaptive", mode]) for mode in ("none", "all")]
    assert all(r.exit_code == 0 for r in runs), runs[0].output + runs[1].output
    fixed, adaptive = (json.loads(r.output[r.output.index("["):])[0]["avg_jct_s"] for r in runs)
    assert adaptive < 0.9 * fixed
    bad = CliRunner().invoke(main, args + ["--adaptive", "some"])
    assert bad.exit_code == 2


def test_simulate_runs_the_controller_with_the_objective_asked_for(tmp_path, monkeypatch):
    import slurm_elastic.sim as sim

    made = []

    def recording(name, **kwargs):
        policy = real(name, **kwargs)
        made.append(type(policy.reconciler.requests).__name__)
        return policy

    real = sim.make_policy
    monkeypatch.setattr(sim, "make_policy", recording)
    args = ["simulate", str(DATA / "sacct-4x4.txt"), "--cluster", "4x4", "--json", "--no-progress",
            "--policy", "controller"]
    result = CliRunner().invoke(main, args + ["--objective", "progress"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output[result.output.index("["):])
    assert rows[0]["finished"] == rows[0]["jobs"] == 26
    assert made == ["ProgressRequests"]
    result = CliRunner().invoke(main, args + ["--objective", "fastest"])
    assert result.exit_code == 2 and "fastest" in result.output
