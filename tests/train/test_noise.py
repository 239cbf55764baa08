"""The gradient-noise estimator against closed-form |E g|^2 and tr(Sigma) (linear regression, Gaussian noise)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slurm_elastic.train import ElasticLoop
from slurm_elastic.train.environment import JobEnvironment
from slurm_elastic.train.noise import GradientNoiseEstimator, NoiseEstimate

from .launch import start_ranks, wait_ranks

D = 10
NOISE_STD = 1.0


def _truth(delta: torch.Tensor) -> tuple[float, float]:
    """Per-sample loss (x.w - y)^2 / 2 with x ~ N(0, I_D), y = x.w* + eps, eps ~ N(0, s^2), delta = w - w*:
    g = x x^T delta - x eps, so E g = delta and (Isserlis) tr Cov g = (D + 1)|delta|^2 + D s^2."""
    d2 = float(delta.pow(2).sum())
    return d2, (D + 1) * d2 + D * NOISE_STD ** 2


def _regression(n: int, w_star: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, D, generator=gen, dtype=torch.float64)
    y = x @ w_star + NOISE_STD * torch.randn(n, generator=gen, dtype=torch.float64)
    return x, y


@pytest.mark.parametrize("micro,accumulation", [(4, 8), (16, 2)])
def test_estimates_match_the_closed_form_within_ten_percent(micro: int, accumulation: int) -> None:
    gen = torch.Generator().manual_seed(7)
    w_star = torch.randn(D, generator=gen, dtype=torch.float64)
    model = nn.Linear(D, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w_star + 0.5 * torch.randn(D, generator=gen, dtype=torch.float64)).unsqueeze(0))
    true_sqr, true_var = _truth(model.weight.detach()[0] - w_star)
    est = GradientNoiseEstimator(model, smoothing=0.999, every_steps=1)
    est.micro_grad_scale = 1.0 / accumulation          # the loss below is divided, as the session's contract wants
    for _ in range(3000):                               # parameters fixed: every step samples the same distribution
        model.zero_grad()
        for _ in range(accumulation):
            x, y = _regression(micro, w_star, gen)
            (0.5 * (model(x).squeeze(1) - y).pow(2).mean() / accumulation).backward()
        est.step_done(micro_batch=micro, global_batch=micro * accumulation, micro_batches=accumulation)
    got = est.estimate()
    assert got is not None and got.updates == 3000
    assert got.grad_sqr == pytest.approx(true_sqr, rel=0.10), (got, true_sqr, true_var)
    assert got.grad_var == pytest.approx(true_var, rel=0.10), (got, true_sqr, true_var)


def test_no_estimate_without_two_batch_sizes_and_the_checkpoint_form_is_strict() -> None:
    model = nn.Linear(2, 1)
    est = GradientNoiseEstimator(model)
    model(torch.ones(3, 2)).sum().backward()
    est.step_done(micro_batch=3, global_batch=3, micro_batches=1)     # one rank, no accumulation: nothing to compare
    assert est.estimate() is None
    back = NoiseEstimate.from_json(json.loads(json.dumps(NoiseEstimate(1.5, 30.0, 12).to_json())))
    assert back == NoiseEstimate(1.5, 30.0, 12)
    other = GradientNoiseEstimator(model, smoothing=0.9)
    other.resume(back)
    assert other.estimate() == pytest.approx(back)
    for bad in ({"grad_sqr": float("nan"), "grad_var": 1.0, "updates": 1}, {"grad_sqr": 1.0, "grad_var": 1.0},
                {"grad_sqr": True, "grad_var": 1.0, "updates": 1}, [1, 2, 3]):
        with pytest.raises(ValueError):
            NoiseEstimate.from_json(bad)


def test_hooks_leave_the_gradients_unchanged() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    est = GradientNoiseEstimator(model)
    model(x).pow(2).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))
    est.close()


def _write_regression(path: Path, n: int) -> None:
    gen = torch.Generator().manual_seed(3)
    w_star = torch.randn(D, generator=gen, dtype=torch.float64)
    x, y = _regression(n, w_star, gen)
    w0 = w_star + 0.5 * torch.randn(D, generator=gen, dtype=torch.float64)
    path.write_text(json.dumps({"x": x.tolist(), "y": y.tolist(), "w_star": w_star.tolist(), "w0": w0.tolist()}))


def test_through_the_loop_at_two_ranks_the_local_gradients_are_seen_before_ddp_averages(tmp_path: Path) -> None:
    """2 ranks x 1 micro-batch of 8: only rank 0's own gradient can make tr(Sigma) > 0. Parameters stay fixed (lr 0),
    so the metrics row's estimate is compared with the closed form for the data set's empirical distribution."""
    data = tmp_path / "data.json"
    _write_regression(data, 4096)
    env = {"SLURM_ELASTIC_CKPT_DIR": str(tmp_path / "ck"), "NOISE_DATA": str(data)}
    results = wait_ranks(start_ranks("tests.train.noise_trainer", [], world_size=2, job_id="77", extra_env=env),
                         timeout=600)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "ck" / "77" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["batch"] == 16 and last["gpus"] == 2
    body = json.loads(data.read_text())
    x, y = torch.tensor(body["x"]), torch.tensor(body["y"])
    w0 = torch.tensor(body["w0"])
    g = x * (x @ w0 - y).unsqueeze(1)                    # every sample's gradient, exactly
    true_sqr = float(g.mean(0).pow(2).sum())
    true_var = float(g.var(0, unbiased=False).sum())
    assert last["grad_sqr"] == pytest.approx(true_sqr, rel=0.25), (last, true_sqr, true_var)
    assert last["grad_var"] == pytest.approx(true_var, rel=0.15), (last, true_sqr, true_var)
    assert math.isfinite(last["steps_per_s"])


def test_a_step_with_a_non_finite_gradient_is_left_out() -> None:
    model = nn.Linear(2, 1, bias=False).double()
    est = GradientNoiseEstimator(model, smoothing=0.5, every_steps=1)
    est.micro_grad_scale = 0.5
    for x in (torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[float("inf"), 0.0], [0.0, 1.0]])):
        model.zero_grad()
        for row in x:
            (model(row.double().unsqueeze(0)).sum() / 2).backward()
        est.step_done(micro_batch=1, global_batch=2, micro_batches=2)
    got = est.estimate()
    # Only the first step counts: sample gradients (1, 0) and (0, 1), so |g_b|^2 = 1 and |g_B|^2 = |(.5, .5)|^2 = .5:
    # grad_sqr = (2 x .5 - 1 x 1) / (2 - 1) = 0 and grad_var = (1 - .5) / (1 - 1/2) = 1, bias-corrected exactly.
    assert got is not None and math.isfinite(got.grad_var)
    assert got.grad_sqr == pytest.approx(0.0, abs=1e-12) and got.grad_var == pytest.approx(1.0)


def test_every_steps_measures_one_step_in_n_and_nothing_in_between() -> None:
    model = nn.Linear(2, 1)
    est = GradientNoiseEstimator(model, every_steps=3)
    for step in range(9):
        model.zero_grad()
        for _ in range(2):
            model(torch.randn(3, 2)).sum().backward()
        assert bool(est._partials) == (step % 3 == 0)     # unarmed steps' hooks record nothing
        est.step_done(micro_batch=3, global_batch=6, micro_batches=2)
    assert est.updates == 3
