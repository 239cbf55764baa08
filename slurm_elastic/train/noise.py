"""Gradient noise, measured in the training loop: smoothed |E g|^2 and tr(Sigma) from two batch sizes.

Every optimizer step averages the gradients of `global_batch` samples (B);
each of this rank's micro-batches is a mean over `micro_batch` samples (b).
For a mean over n independent samples, E|g_n|^2 = |G|^2 + tr(Sigma)/n, so the
squared norms at the two sizes give unbiased estimates of both

    |G|^2      = (B |g_B|^2 - b |g_b|^2) / (B - b)
    tr(Sigma)  = (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

(McCandlish et al. 2018, appendix A; Pollux/AdaptDL use the same). One step's
values are very noisy, so both are smoothed with an exponential moving
average, bias-corrected as Adam does.

Cost: one dot product per parameter per micro-batch (a tensor hook, which
sees the micro-batch's gradient before it is added to `.grad` and before DDP
reduces it), and per step one total norm and a few scalar operations. Nothing is communicated: only this
rank's micro-batches enter |g_b|^2 (still unbiased; the moving average does
the rest), and nothing is copied to the host until `estimate()` is asked for.
Everything stays on the parameters' device, so the step does not wait on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

DEFAULT_SMOOTHING = 0.99
DEFAULT_EVERY_STEPS = 10   # benchmarks/noise_cost.py: every step cost 10-18 % of a small CPU step


@dataclass(frozen=True, slots=True)
class NoiseEstimate:
    """Smoothed per-sample gradient statistics: grad_sqr = |E g|^2, grad_var = tr(Sigma) of one sample."""

    grad_sqr: float
    grad_var: float
    updates: int          # optimizer steps that went into the average (tried: ones left out count too)

    def to_json(self) -> dict[str, Any]:
        return {"grad_sqr": self.grad_sqr, "grad_var": self.grad_var, "updates": self.updates}

    @classmethod
    def from_json(cls, body: Any) -> NoiseEstimate:
        """Strict: a checkpoint's `noise` entry, or ValueError saying what is wrong."""
        if not isinstance(body, dict):
            raise ValueError("noise must be an object with grad_sqr, grad_var, updates")
        values = []
        for key in ("grad_sqr", "grad_var"):
            v = body.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"noise.{key} must be a finite number, got {v!r}")
            values.append(float(v))
        n = body.get("updates")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"noise.updates must be a whole number >= 1, got {n!r}")
        return cls(values[0], values[1], n)


class GradientNoiseEstimator:
    """Hooks a model's parameters; `step_done()` once per optimizer step, before `optimizer.step()`.

    `micro_grad_scale` is the factor the micro-batch gradients carry when the
    hooks see them relative to a micro-batch *mean* (1/accumulation when the
    loss is scaled so that the accumulated `.grad` is the global-batch mean,
    the session's contract); `.grad` at `step_done()` must be the mean over
    the global batch.
    """

    def __init__(self, model: nn.Module, *, smoothing: float = DEFAULT_SMOOTHING,
                 every_steps: int = DEFAULT_EVERY_STEPS) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.smoothing = smoothing
        # Measuring one step in `every_steps` divides the cost by it; the average then spans
        # every_steps / (1 - smoothing) steps.
        self.every_steps = every_steps
        self.armed = True               # this step is measured
        self._steps_seen = 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        device = self.params[0].device
        self._partials: list[torch.Tensor] = []     # one squared norm per parameter per micro-batch, on device
        # Biased averages (grad_sqr, grad_var) and, third, the weight they carry (1 - smoothing^steps taken),
        # which corrects the bias; all on the device.
        self._ema = torch.zeros(3, dtype=torch.float64, device=device)
        self.updates = 0
        self.micro_grad_scale = 1.0
        self._handles = [p.register_hook(self._on_grad) for p in self.params]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_grad(self, grad: torch.Tensor) -> None:
        # One kernel per parameter; returns None, so the gradient passes on unchanged.
        if not self.armed:
            return
        if grad.is_sparse:
            grad = grad.coalesce().values()
        flat = grad.reshape(-1)
        if flat.dtype not in (torch.float32, torch.float64):
            flat = flat.float()     # a half-precision dot overflows at 65504
        self._partials.append(torch.dot(flat, flat))

    def _micro_sqr(self) -> torch.Tensor:
        """Sum of the squared norms hooked since the last step, as a float64 scalar on the device."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in self._partials:
            by_dtype.setdefault(t.dtype, []).append(t)
        total = torch.zeros((), dtype=torch.float64, device=self._ema.device)
        for parts in by_dtype.values():
            total = total + torch.stack(parts).sum().to(torch.float64)
        return total

    def step_done(self, *, micro_batch: int, global_batch: int, micro_batches: int) -> None:
        """Fold this step in: `micro_batches` of `micro_batch` samples were hooked here, `.grad` is the mean of
        `global_batch`. A step with nothing to compare (global batch = micro batch) only resets."""
        b, big = float(micro_batch), float(global_batch)
        if self.armed and big > b and micro_batches > 0 and self._partials:
            micro_sqr = self._micro_sqr() / (micro_batches * self.micro_grad_scale ** 2)
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                big_sqr = torch.nn.utils.get_total_norm(grads, 2.0).to(torch.float64) ** 2
                one = torch.ones((), dtype=torch.float64, device=self._ema.device)
                raw = torch.stack(((big * big_sqr - b * micro_sqr) / (big - b),
                                   (micro_sqr - big_sqr) / (1.0 / b - 1.0 / big), one))
                # A step with an inf/nan gradient (AMP overflow, divergence) is left out, on the device.
                blended = self._ema * self.smoothing + raw * (1.0 - self.smoothing)
                self._ema.copy_(torch.where(torch.isfinite(raw).all(), blended, self._ema))
                self.updates += 1
        self._partials.clear()
        self._steps_seen += 1
        self.armed = self._steps_seen % self.every_steps == 0

    def estimate(self) -> NoiseEstimate | None:
        """The bias-corrected averages (one device-to-host copy), clipped at 0; None before any step."""
        if self.updates == 0:
            return None
        grad_sqr, grad_var, weight = self._ema.tolist()
        if weight <= 0:
            return None         # every step so far was left out
        grad_sqr, grad_var = grad_sqr / weight, grad_var / weight
        if not (math.isfinite(grad_sqr) and math.isfinite(grad_var)):
            return None
        return NoiseEstimate(max(grad_sqr, 0.0), max(grad_var, 0.0), self.updates)

    def resume(self, estimate: NoiseEstimate) -> None:
        """Continue the average from a checkpoint's estimate (as if its `updates` steps had run here)."""
        weight = 1.0 - self.smoothing ** estimate.updates
        self._ema.copy_(torch.tensor([estimate.grad_sqr * weight, estimate.grad_var * weight, weight],
                                     dtype=torch.float64))
        self.updates = estimate.updates


def has_dtensor(params: Iterable[torch.Tensor]) -> bool:
    """FSDP2 shards parameters as DTensors: a hook sees a shard, so the norms would not be a micro-batch's."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)
