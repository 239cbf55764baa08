"""Adaptive-batch jobs in the simulator: progress by epochs at a goodput-chosen batch, and the shim's rows."""

from __future__ import annotations

import json
import math

import pytest

from slurm_elastic import goodput
from slurm_elastic.control.requests import validate_row
from slurm_elastic.sim import SimConfig, Simulation, parse_cluster
from slurm_elastic.sim.controller import ControllerPolicy
from slurm_elastic.sim.jobs import SimJob
from slurm_elastic.sim.pollux import AdaptiveSpeed, ApplicationProfile, PolluxSpeed, load_workload
from slurm_elastic.sim.shim import SimulatedShim, write_batch_range
from slurm_elastic.sim.tiresias import TiresiasPolicy
from slurm_elastic import jobfiles as protocol


def _adaptive(pollux, app="cifar10", gpus=4, submit=0.0, key="a"):
    profile = ApplicationProfile.load(pollux / "applications" / app)
    speed = AdaptiveSpeed(profile)
    return SimJob(key, submit, gpus, 1, 16, work=speed.work, speed=speed, application=app), speed


def test_adaptive_job_runs_epoch_by_epoch_at_the_batch_each_epoch_chose(pollux):
    """Alone at a fixed size, its run time is the sum over epochs of that epoch's progress / its rate."""
    job, speed = _adaptive(pollux)
    result = Simulation([job], TiresiasPolicy(), SimConfig(parse_cluster("1x4"))).run()
    expected, done = 30.0, 0.0                     # the first start's 30 s, as the original
    batches = set()
    for _ in range(speed.profile.epochs):
        seg = speed.segment((4,), done)
        expected += seg.until / seg.rate
        done += seg.until
        batches.add(seg.batch)
    assert done == pytest.approx(speed.work)
    assert result.jobs[0].finish_s == pytest.approx(expected, rel=1e-6)
    assert len(batches) > 1                         # the noise grows over training: the batch follows it
    # and it beats the same job at its trace batch run by iterations (what an adaptive batch is for)
    fixed = PolluxSpeed(speed.profile, speed.profile.init_batch)
    rigid = SimJob("f", 0.0, 4, 1, 16, work=speed.profile.work_statistical(speed.profile.init_batch), speed=fixed)
    slow = Simulation([rigid], TiresiasPolicy(), SimConfig(parse_cluster("1x4"))).run()
    assert result.jobs[0].finish_s < slow.jobs[0].finish_s


def test_workload_modes_make_all_half_or_no_job_adaptive(pollux):
    path = pollux / "workloads" / "workload-1.csv"
    none, half, every = (load_workload(path, adaptive=m) for m in ("none", "half", "all"))
    assert not any(isinstance(j.speed, AdaptiveSpeed) for j in none)
    adaptive = [isinstance(j.speed, AdaptiveSpeed) for j in every]
    assert all(a or j.application == "ncf" for a, j in zip(adaptive, every))
    halves = [isinstance(j.speed, AdaptiveSpeed) for j in half]
    assert halves[0] and not halves[1]
    assert abs(sum(halves) - len(half) / 2) <= sum(j.application == "ncf" for j in half)


def test_the_simulated_shim_writes_the_schema_the_request_source_reads(pollux, tmp_path):
    root = str(tmp_path)
    job, speed = _adaptive(pollux, "imagenet")
    (tmp_path / protocol.job_key("7")).mkdir()
    write_batch_range(root, "7", job)
    with open(protocol.batch_path(root, "7")) as fh:
        assert json.load(fh) == {"min": speed.profile.init_batch, "max": speed.profile.max_batch,
                                 "base": speed.profile.init_batch}
    shim = SimulatedShim(root, "7", job)
    small, big = speed.segment((2,), 0.0), speed.segment((4, 4), 0.0)
    assert not shim.report((2,), 0.0, 60.0, small)             # no step yet: no row
    assert shim.report((2,), small.rate * 100, 160.0, small)
    assert shim.report((4, 4), small.rate * 100 + big.rate * 100, 260.0, big)
    rows = [json.loads(line) for line in open(protocol.metrics_path(root, "7"))]
    assert [validate_row(r) is not None for r in rows] == [True, True]
    first, second = rows
    assert first["batch"] == small.batch and second["batch"] == big.batch > first["batch"]
    assert first["step"] == pytest.approx(100 * small.steps_per_s, abs=1)   # optimizer steps, not progress
    assert second["step"] - first["step"] == pytest.approx(100 * big.steps_per_s, abs=1)
    assert second["samples_per_s"] == pytest.approx(big.steps_per_s * big.batch)
    # grad_var is one sample's variance: the noise scale grad_var / grad_sqr is in samples
    noise = goodput.GradientNoise(second["grad_sqr"], second["grad_var"])
    assert noise == big.noise
    assert noise.grad_var == pytest.approx(big.noise.grad_var)
    assert second["total_steps"] >= second["step"]


def test_the_controller_runs_adaptive_jobs_and_reads_their_goodput_rows(pollux):
    a, _ = _adaptive(pollux, "cifar10", gpus=2, key="a")
    b, _ = _adaptive(pollux, "imagenet", gpus=4, submit=30.0, key="b")
    policy = ControllerPolicy(max_scale=None)
    result = Simulation([a, b], policy, SimConfig(parse_cluster("2x4"), immediate=False)).run()
    assert all(r.finish_s is not None for r in result.jobs)
    for job_id in policy.slurm.jobs:
        rows = [json.loads(line) for line in open(protocol.metrics_path(policy.ckpt_root, str(job_id)))]
        assert rows and all(validate_row(r) is not None for r in rows)
        assert all({"batch", "grad_sqr", "grad_var", "samples_per_s"} <= set(r) for r in rows)
        assert all(math.isfinite(r["grad_var"]) and r["grad_var"] >= 0 for r in rows)
        assert json.load(open(protocol.batch_path(policy.ckpt_root, str(job_id))))["base"] > 0
    policy.close()
