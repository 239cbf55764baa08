"""Goodput: throughput times statistical efficiency, the one home of that arithmetic.

A step at global batch M averages M per-sample gradients. With g2 = |E g|^2
(the true gradient's squared norm) and var = tr(Sigma) (the variance of one
sample's gradient), the mean's variance is var / M, and the gradient noise
scale is phi = var / g2. Relative to the batch M0 the learning rate was tuned
for, one sample at batch M makes

    efficiency(M) = (phi + M0) / (phi + M)

of the progress it made at M0 (McCandlish et al. 2018; Pollux, OSDI'21), so
goodput(M) = samples/s(M) x efficiency(M). AdaScale's gain

    gain(M) = (var / M0 + g2) / (var / M + g2) = efficiency(M) x M / M0

is the factor by which a step at M does more than a step at M0: the learning
rate is scaled by it, so progress per sample is preserved (Johnson et al.
2020; Pollux scales the same way).

The shim (choosing a job's batch), the request source (a job's speed model)
and the simulator (its statistical progress) all use these functions, so the
three agree on what a batch is worth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class GradientNoise:
    """A job's measured gradient statistics, per sample (see the module docstring)."""

    grad_sqr: float
    grad_var: float

    def __post_init__(self) -> None:
        for name in ("grad_sqr", "grad_var"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")

    @property
    def noise_scale(self) -> float:
        """phi = var / g2 (samples); infinite when the gradient's norm is 0 (pure noise)."""
        return self.grad_var / self.grad_sqr if self.grad_sqr > 0 else math.inf


def efficiency(batch: float, base_batch: float, noise: GradientNoise) -> float:
    """Progress per sample at `batch`, relative to `base_batch` (1.0 at base_batch; <= 1 above it)."""
    if batch <= 0 or base_batch <= 0:
        raise ValueError("batch sizes must be positive")
    phi = noise.noise_scale
    if math.isinf(phi):
        return 1.0  # gradient all noise: every sample is worth the same at any batch
    if phi + batch == 0:
        return 1.0
    return (phi + base_batch) / (phi + batch)


def gain(batch: float, base_batch: float, noise: GradientNoise) -> float:
    """AdaScale's gain: how much more one step at `batch` does than one at `base_batch` (the LR factor)."""
    return efficiency(batch, base_batch, noise) * batch / base_batch


def goodput(samples_per_s: float, batch: float, base_batch: float, noise: GradientNoise) -> float:
    """Useful samples per second at `batch`: samples/s x efficiency, in samples of `base_batch` worth."""
    return samples_per_s * efficiency(batch, base_batch, noise)


def best_batch(candidates: list[int], samples_per_s: Callable[[int], float], base_batch: int,
               noise: GradientNoise) -> tuple[int, float]:
    """The candidate global batch with the highest goodput (ties: the smaller batch), and that goodput.

    `samples_per_s(batch)` is the job's throughput at that batch on the GPUs
    it has; the caller lists only batches that geometry allows there.
    """
    if not candidates:
        raise ValueError("no candidate batch")
    best = min(candidates)
    best_value = goodput(samples_per_s(best), best, base_batch, noise)
    for batch in sorted(candidates):
        value = goodput(samples_per_s(batch), batch, base_batch, noise)
        if value > best_value * (1 + 1e-9):
            best, best_value = batch, value
    return best, best_value
