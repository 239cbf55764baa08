"""Adaptive-batch jobs are allocated by goodput at their best batch; fixed-batch jobs by plain speed; hostile files
change nothing but the one job's own model (issue 18, point 3)."""

from __future__ import annotations

import dataclasses
import getpass
import json
import math
import os

import pytest

from slurm_elastic import goodput
from slurm_elastic.allocate.problem import Policy
from slurm_elastic.allocate.throughput import GoodputThroughput, MeasuredThroughput, concave_hull
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler
from slurm_elastic.control.requests import (BATCH_FILE, MeasuredRequests, RequestSettings, read_batch_range,
                                            validate_row)
from slurm_elastic.spec import ElasticSpec
from slurm_elastic import jobfiles as shim
from tests.control.test_requests import ran_at

ME = getpass.getuser()
RANGE = {"min": 32, "max": 1024, "base": 128}
BIG_NOISE = {"grad_sqr": 1.0, "grad_var": 1e5}     # noise scale 1e5: a big batch is as good as a small one
SMALL_NOISE = {"grad_sqr": 1.0, "grad_var": 1.0}   # noise scale 1: twice the batch, half the progress per sample


def _row(step: int, t: float, gpus: int, sps: float, **extra: float | int) -> dict:
    return {"step": step, "time": t, "gpus": gpus, "nodes": 1, "steps_per_s": sps, "samples_per_s": sps * 128,
            **extra}


def _write(ckpt: str, job: int, rows: list[dict], batch: object | None = None) -> None:
    path = shim.metrics_path(ckpt, str(job))
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    if batch is not None:
        with open(os.path.join(os.path.dirname(path), BATCH_FILE), "w") as f:
            f.write(batch if isinstance(batch, str) else json.dumps(batch))


def _measured(noise: dict) -> list[dict]:
    """Measured at 4 GPUs only, at batch 128 (32 per GPU), 1 step/s."""
    return [_row(10 * i, 10.0 * i, 4, 1.0, batch=128, **noise) for i in range(1, 6)]


@pytest.fixture
def cluster(tmp_path):
    slurm = InMemorySlurm(nodes=1, gpus_per_node=8)   # 6 GPUs fit on one node
    ckpt = str(tmp_path / "ckpt")
    spec = ElasticSpec(2, 6, gpu_step=2, ckpt_dir=ckpt)
    a = slurm.add_job(spec, nodes=1, gpus_per_node=4, user=ME)
    b = slurm.add_job(spec, nodes=1, gpus_per_node=4, user=ME)
    return slurm, ckpt, a, b


def _requests(slurm, src=None):
    src = src or MeasuredRequests()
    got = src.requests(slurm.snapshot(), slurm.now, Policy())
    return src, got, {r.key: r for r in got}


def test_goodput_decides_between_two_adaptive_jobs_in_one_milp(cluster):
    slurm, ckpt, a, b = cluster
    _write(ckpt, a, _measured(BIG_NOISE), RANGE)
    _write(ckpt, b, _measured(SMALL_NOISE), RANGE)
    src, got, reqs = _requests(slurm)
    ra, rb = reqs[str(a)], reqs[str(b)]
    assert isinstance(ra.throughput, GoodputThroughput) and isinstance(rb.throughput, GoodputThroughput)
    # a: its batch grows with its GPUs at almost no loss of efficiency, so its goodput scales as its samples/s
    # do in its step-time model (measured at 4 GPUs only: 1 node, the prior's constant all-reduce), the
    # gain past 4 GPUs credited in full (eta = 0 as shipped): (1 + 0.5) / 0.5
    assert ra.throughput(6) / ra.throughput(2) == pytest.approx(3.0, rel=0.01)
    # b: a bigger batch buys almost nothing, and a smaller one still takes a measured step's time per step
    # (three times the GPUs: 1 % more goodput, against a's 3x)
    assert rb.throughput(6) / rb.throughput(2) <= 1.02
    assert "goodput at the best batch" in got.basis[str(a)] and "6:192@" in got.basis[str(a)]
    # One cluster, one MILP (the shipped Reconciler): the GPUs go where they make progress.
    report = Reconciler(slurm, Journal(":memory:"), ControllerConfig(node_confirm_s=0, min_resize_interval_s=0),
                        requests=src).cycle(dry_run=True)
    assert (report.target(a), report.target(b)) == (6, 2)


def test_the_speed_is_goodput_at_the_best_batch_by_allocate_goodput(cluster):
    slurm, ckpt, a, _ = cluster
    _write(ckpt, a, _measured(SMALL_NOISE), RANGE)
    _, _, reqs = _requests(slurm)
    model = reqs[str(a)].throughput
    noise = goodput.GradientNoise(**SMALL_NOISE)
    # 6 GPUs: samples/s predicted from the one count measured at the batch per GPU measured (1.5 x 128/s on
    # one node, the gain past 4 GPUs credited in full: 1.5 x 128/s)
    batch, value = model.batch_for(6)
    assert batch == 192
    assert value == pytest.approx(goodput.goodput(1.5 * 128, 192, 128, noise))


def test_no_optimism_beyond_the_batch_measured():
    """The stated rule: above the batch per GPU measured, samples/s no higher than measured; below it,
    steps/s no higher than measured."""
    samples = MeasuredThroughput(concave_hull([(4, 128.0)]), ((4, 1),), 4.0)
    pure_noise = goodput.GradientNoise(grad_sqr=0.0, grad_var=1.0)        # every batch equally efficient
    no_noise = goodput.GradientNoise(grad_sqr=1.0, grad_var=0.0)          # only the number of steps counts
    grow = GoodputThroughput(samples, ((4, 32.0),), 32, 1024, 128, pure_noise)
    assert grow.batch_for(4) == (128, pytest.approx(128.0))              # a bigger batch is no faster per sample
    steps = GoodputThroughput(samples, ((4, 32.0),), 32, 1024, 128, no_noise)
    batch, value = steps.batch_for(4)
    assert batch == 32 and value == pytest.approx(128.0)                 # 1 step/s at most, whatever the batch


def test_a_count_measured_at_a_small_batch_is_credited_the_larger_batches_its_step_time_model_predicts():
    """Pollux's throughput model predicts every batch: a step costs a fixed time plus a time per sample. A
    job measured at 4 GPUs with 8 samples per GPU (the fixed cost dominates) and at 1 and 2 GPUs with 64:
    at 4 GPUs and a larger batch its fitted model says what it does, not the batch it happened to run at,
    within the bounds a step obeys (no more than linear in the batch)."""
    from slurm_elastic.allocate.stepmodel import StepTimeParams, step_time_model

    truth = StepTimeParams(alpha_c=0.3, beta_c=0.002, alpha_r=0.01, beta_r=0.0, alpha_n=0.0, beta_n=0.0)
    sizes = [(1, 1, 64.0), (2, 1, 128.0), (4, 1, 32.0)]
    steps = {g: 1.0 / truth.step_time(g, n, b) for g, n, b in sizes}
    predicted = step_time_model([(g, n, b, steps[g], 8) for g, n, b in sizes], kind="samples", eta=0.0)
    samples = {g: steps[g] * b for g, _, b in sizes}
    measured = MeasuredThroughput(concave_hull(samples.items()), ((1, 1), (2, 1), (4, 1)), 4.0, predicted=predicted)
    every_batch = goodput.GradientNoise(grad_sqr=0.0, grad_var=1.0)   # every batch equally efficient per sample
    local = ((1, 64.0), (2, 64.0), (4, 8.0))
    fitted = GoodputThroughput(measured, local, 32, 256, 32, every_batch)
    capped = GoodputThroughput(dataclasses.replace(measured, predicted=None), local, 32, 256, 32, every_batch)
    held = capped.batch_for(4)[1]       # the capped rule: the hull's samples/s at 4 (2 GPUs' 292), any batch
    batch, value = fitted.batch_for(4)
    assert batch == 256
    true = 256 / truth.step_time(4, 1, 256)
    assert abs(value - true) < abs(held - true)                     # nearer the truth (584/s) than held (292/s)
    assert samples[4] < value <= samples[4] * 256 / 32
    # rows at one batch per GPU only: the cost per sample would be the prior's, so the lower bound holds
    one = step_time_model([(4, 1, 32.0, steps[4], 8)], kind="samples", eta=0.0)
    alone = GoodputThroughput(MeasuredThroughput(concave_hull([(4, samples[4])]), ((4, 1),), 4.0, predicted=one),
                              ((4, 8.0),), 32, 256, 32, every_batch)
    assert alone.batch_for(4)[1] == pytest.approx(samples[4])


def test_an_adaptive_job_has_the_same_work_left_whichever_size_and_batch_it_last_ran_at(tmp_path):
    """Its rows count steps at the batch it ran at: many small steps at 2 GPUs (batch 64), fewer large ones at
    6 (batch 384). Two jobs with the same rows at both sizes and the same statistical work left, one last
    seen at 2 GPUs and one at 6, are equally far from their end: the same remaining-work weight. Counted as
    steps left over the fastest steps/s measured (2 GPUs' small steps), the one last at 6 looked 4.6x nearer
    its end, and a long job's weight swung with every resize (a job shrunk looked longer, and stayed small)."""
    slurm = InMemorySlurm(nodes=2, gpus_per_node=8)
    ckpt = str(tmp_path / "ckpt")
    spec = ElasticSpec(2, 6, gpu_step=2, ckpt_dir=ckpt)
    a, b = (slurm.add_job(spec, nodes=1, gpus_per_node=4, user=ME) for _ in range(2))
    noise = {"grad_sqr": 1.0, "grad_var": 1000.0}
    sizes = {2: (64, 2.0), 6: (384, 0.9)}                  # gpus: (global batch, steps/s)
    work = 6.4e6                                            # samples of the base batch (128) left

    def rows(order: tuple[int, int]) -> list[dict]:
        out, step = [], 0
        for i, gpus in enumerate(g for g in order for _ in range(4)):
            batch, sps = sizes[gpus]
            step += 20
            eff = goodput.efficiency(batch, RANGE["base"], goodput.GradientNoise(**noise))
            left = round(work / (batch * eff))
            out.append({"step": step, "time": 10.0 * (i + 1), "gpus": gpus, "nodes": 1, "steps_per_s": sps,
                        "samples_per_s": sps * batch, "batch": batch, "total_steps": step + left, **noise})
        return out

    src = MeasuredRequests()
    ran_at(slurm, src, a, (6, 1), (2, 1))
    ran_at(slurm, src, b, (2, 1), (6, 1))
    _write(ckpt, a, rows((6, 2)), RANGE)                    # last ran at 2 GPUs: many steps left
    _write(ckpt, b, rows((2, 6)), RANGE)                    # last ran at 6 GPUs: few (larger) steps left
    _, got, reqs = _requests(slurm, src)
    assert isinstance(reqs[str(a)].throughput, GoodputThroughput)
    lo, hi = RequestSettings().weight_range
    assert lo < reqs[str(a)].weight < hi                    # not clamped: the weights say the work left
    assert reqs[str(a)].weight == pytest.approx(reqs[str(b)].weight, rel=0.01)


def test_fixed_batch_jobs_keep_plain_speed_beside_an_adaptive_one(cluster):
    slurm, ckpt, a, b = cluster
    _write(ckpt, a, _measured(BIG_NOISE), RANGE)
    _write(ckpt, b, _measured(BIG_NOISE))                   # the same rows, no batch.json: fixed batch
    src, got, reqs = _requests(slurm)
    assert isinstance(reqs[str(a)].throughput, GoodputThroughput)
    assert isinstance(reqs[str(b)].throughput, MeasuredThroughput)
    assert reqs[str(b)].throughput(4) == pytest.approx(1.0)           # steps/s, as before
    assert "goodput" not in got.basis[str(b)]


def test_an_adaptive_job_without_noise_yet_is_allocated_by_plain_speed(cluster):
    slurm, ckpt, a, _ = cluster
    _write(ckpt, a, [_row(10 * i, 10.0 * i, 4, 1.0, batch=128) for i in range(1, 4)], RANGE)
    src, got, reqs = _requests(slurm)
    assert isinstance(reqs[str(a)].throughput, MeasuredThroughput)
    assert "no batch and gradient noise yet: plain speed" in got.basis[str(a)]


def test_a_new_batch_at_the_same_size_starts_its_speeds_afresh(cluster):
    slurm, ckpt, a, _ = cluster
    rows = [_row(i, float(i), 4, 1.0, batch=128, **BIG_NOISE) for i in range(1, 5)]
    rows += [_row(10 + i, 10.0 + i, 4, 0.5, batch=256, **BIG_NOISE) for i in range(1, 3)]   # twice the batch
    _write(ckpt, a, rows, RANGE)
    _, _, reqs = _requests(slurm)
    model = reqs[str(a)].throughput
    assert model.local_batch_at == ((4, 64.0),)
    assert model.samples(4) == pytest.approx(128.0)          # 0.5 steps/s x 256, not a median with 1.0 x 128


@pytest.mark.parametrize("case", ["symlink", "fifo", "huge", "not-json", "list", "bool", "float", "zero",
                                  "too-big", "min-above-max", "missing", "other-owner"])
def test_a_bad_batch_file_means_plain_speed_and_one_log_line(cluster, case, tmp_path, caplog):
    slurm, ckpt, a, b = cluster
    _write(ckpt, a, _measured(BIG_NOISE))
    _write(ckpt, b, _measured(BIG_NOISE), RANGE)
    path = os.path.join(shim.job_dir(ckpt, str(a)), BATCH_FILE)
    bodies = {"not-json": "{min: 1", "list": "[32, 1024, 128]", "bool": '{"min": true, "max": 1024, "base": 128}',
              "float": '{"min": 32.0, "max": 1024, "base": 128}', "zero": '{"min": 0, "max": 1024, "base": 128}',
              "too-big": '{"min": 32, "max": 1000000000, "base": 128}',
              "min-above-max": '{"min": 64, "max": 32, "base": 32}', "missing": '{"min": 32, "max": 1024}',
              "huge": json.dumps({**RANGE, "pad": "x" * 10000})}
    if case == "symlink":
        elsewhere = tmp_path / "batch.json"
        elsewhere.write_text(json.dumps(RANGE))
        os.symlink(elsewhere, path)
    elif case == "fifo":
        os.mkfifo(path)
    elif case == "other-owner":
        with open(path, "w") as f:
            json.dump(RANGE, f)
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(path, 65534, 65534)
    else:
        with open(path, "w") as f:
            f.write(bodies[case])
    src = MeasuredRequests()
    for _ in range(3):
        src, got, reqs = _requests(slurm, src)
    assert isinstance(reqs[str(a)].throughput, MeasuredThroughput)       # plain speed for a
    assert "batch.json ignored" in got.basis[str(a)]
    assert isinstance(reqs[str(b)].throughput, GoodputThroughput)        # b's own file still counts for b
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and BATCH_FILE in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_read_batch_range_valid_and_absent(tmp_path):
    path = tmp_path / BATCH_FILE
    assert read_batch_range(str(path), owner_uid=os.getuid(), max_bytes=4096) == (None, "")
    path.write_text(json.dumps(RANGE))
    got, problem = read_batch_range(str(path), owner_uid=os.getuid(), max_bytes=4096)
    assert problem == "" and (got.min, got.max, got.base) == (32, 1024, 128)


@pytest.mark.parametrize("bad", [{"batch": 0}, {"batch": True}, {"batch": 12.5}, {"batch": 10**9},
                                 {"grad_sqr": math.nan, "grad_var": 1.0}, {"grad_sqr": 1.0, "grad_var": math.inf},
                                 {"grad_sqr": -1.0, "grad_var": 1.0}, {"grad_sqr": "1", "grad_var": 1.0},
                                 {"grad_sqr": 1.0, "grad_var": False}, {"grad_sqr": 1.0}, {"grad_var": 1.0},
                                 {"grad_sqr": 1e31, "grad_var": 1.0}])
def test_hostile_goodput_fields_make_the_row_invalid(bad):
    assert validate_row(_row(1, 1.0, 4, 1.0)) is not None
    assert validate_row({**_row(1, 1.0, 4, 1.0), **bad}) is None


def test_valid_goodput_fields_are_kept():
    row = validate_row(_row(1, 1.0, 4, 1.0, batch=256, grad_sqr=0.5, grad_var=3.0))
    assert row is not None and row["batch"] == 256 and row["grad_sqr"] == 0.5 and row["grad_var"] == 3.0
