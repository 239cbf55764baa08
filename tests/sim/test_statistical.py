"""Statistical progress as the original Pollux simulator counts it, and what its Optimus+Oracle knows."""

from __future__ import annotations

import csv

import pytest

from slurm_elastic import goodput
from slurm_elastic.sim.jobs import packed_placement
from slurm_elastic.sim.optimus import OptimusOracle
from slurm_elastic.sim.pollux import AdaptiveSpeed, ApplicationProfile, PolluxSpeed


def _rows(pollux, app, batch):
    with (pollux / "applications" / app / f"validation-{batch}.csv").open() as handle:
        return list(csv.DictReader(handle))


def test_per_sample_noise_gives_the_originals_gain(pollux):
    """The trace's grad_var is the variance at the smallest validated batch; goodput.py's is one sample's."""
    profile = ApplicationProfile.load(pollux / "applications" / "cifar10")
    b0 = profile.init_batch
    row = _rows(pollux, "cifar10", 1024)[5]
    sqr, var = float(row["grad_sqr"]), float(row["grad_var"])
    noise = profile.noise(1024, 5)
    assert noise.grad_sqr == pytest.approx(sqr)
    assert noise.grad_var == pytest.approx(var * b0)
    scale = 1024 / b0
    original = (var + sqr) / (var / scale + sqr)
    assert goodput.gain(1024, b0, noise) == pytest.approx(original)
    assert profile.gain(b0, 5) == pytest.approx(1.0)


def test_fixed_batch_work_sums_each_epochs_progress_over_its_gain(pollux):
    profile = ApplicationProfile.load(pollux / "applications" / "bert")
    ends = profile.epoch_ends(384)
    targets = profile.progress_targets
    assert ends[0] == pytest.approx(targets[0] / profile.gain(384, 0))
    assert ends[1] - ends[0] == pytest.approx((targets[1] - targets[0]) / profile.gain(384, 1))
    assert profile.work_statistical(384) == pytest.approx(ends[-1])
    # at the batch the rate was tuned for the gain is 1: work is the progress target itself
    assert profile.work_statistical(profile.init_batch) == pytest.approx(targets[-1])
    assert profile.epochs_done(384, 0.0) == 0
    assert profile.epochs_done(384, ends[0]) == 1
    assert profile.epochs_done(384, ends[-1]) == profile.epochs


def test_optimus_oracle_counts_whole_epochs_of_trace_iterations(pollux):
    profile = ApplicationProfile.load(pollux / "applications" / "cifar10")
    speed = PolluxSpeed(profile, 1024)
    assert isinstance(speed, OptimusOracle)
    iters = [float(r["iteration"]) for r in _rows(pollux, "cifar10", 1024)]
    ends = profile.epoch_ends(1024)
    last = profile.epochs - 1
    assert speed.oracle_remaining(0.0) == pytest.approx(iters[last] - iters[0])
    # halfway through epoch 3 it still counts from the end of epoch index 2's boundary
    assert speed.oracle_remaining((ends[2] + ends[3]) / 2) == pytest.approx(iters[last] - iters[3])
    assert speed.oracle_remaining(ends[last - 1] + 1) == 1.0
    # its one-GPU prediction accumulates even at the smallest batch, as the original's
    small = PolluxSpeed(profile, profile.init_batch)
    half, half_sync = profile.step_times((1,), float(profile.init_batch // 2))
    assert small.oracle_step_time(1, 4) == pytest.approx(half + (half - half_sync))
    assert 1 / small((1,)) == pytest.approx(profile.step_times((1,), float(profile.init_batch))[0])
    assert speed.oracle_step_time(6, 4) == pytest.approx(profile.iteration_time(packed_placement(6, 4), 1024))


def test_adaptive_job_picks_the_goodput_best_batch_and_grows_it_with_gpus(pollux):
    profile = ApplicationProfile.load(pollux / "applications" / "imagenet")
    speed = AdaptiveSpeed(profile)
    one, many = speed.segment((1,), 0.0), speed.segment((4, 4, 4, 4), 0.0)
    assert profile.init_batch <= one.batch <= many.batch <= profile.max_batch
    assert many.batch > one.batch
    assert many.rate > one.rate
    # the chosen batch is goodput.best_batch's pick: no candidate batch beats it on that placement
    for batch in (profile.init_batch, 2 * profile.init_batch, profile.max_batch):
        if batch < many.batch or batch > profile.max_batch or batch < profile.min_local_bsz * 16:
            continue
        step = profile.iteration_time((4, 4, 4, 4), batch, one_gpu_accumulates=False)
        assert goodput.gain(batch, profile.init_batch, profile.noise(batch, 0)) / step <= many.rate * 1.02
    # the segment ends at the epoch's progress target, and the work is the last target
    assert many.until == pytest.approx(profile.progress_targets[0])
    assert speed.work == pytest.approx(profile.progress_targets[-1])
    late = speed.segment((4, 4, 4, 4), profile.progress_targets[40] + 1.0)
    assert late.until == pytest.approx(profile.progress_targets[41] - profile.progress_targets[40] - 1.0)
