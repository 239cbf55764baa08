"""What a simulated job's training shim writes: the metrics rows and, for an adaptive job, its batch range.

The rows are the contract's MetricsRow (jobfiles/metrics.py), as the real
shim writes them (train/session.py `_write_metrics`): step, time, GPUs, nodes, steps/s, samples/s, the global
batch and the gradient noise (grad_sqr = |E g|^2, grad_var = the variance
of ONE sample's gradient), plus the declared total, so the shipped request
source learns from them exactly as from a real job. A row is written only
once the job has stepped since its last one, as the shim does.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from slurm_elastic.sim.jobs import Segment, SimJob
from slurm_elastic.sim.pollux import AdaptiveSpeed, PolluxSpeed
from slurm_elastic import jobfiles as protocol


def _append(path: str, row: protocol.MetricsRow) -> None:
    with open(path, "ab", opener=lambda p, f: os.open(p, f, 0o600)) as fh:
        fh.write(row.to_line())


def write_batch_range(ckpt_root: str, key: str, job: SimJob) -> None:
    """An adaptive job's `batch.json`: from the smallest to the largest validated batch, tuned at the smallest."""
    speed = job.speed
    if not isinstance(speed, AdaptiveSpeed):
        return
    profile = speed.profile
    payload = protocol.BatchRange(min=profile.init_batch, max=profile.max_batch, base=profile.init_batch)
    with open(protocol.batch_path(ckpt_root, key), "wb", opener=lambda p, f: os.open(p, f, 0o600)) as fh:
        fh.write(payload.to_bytes())


@dataclass(slots=True)
class _Progress:
    done: float = 0.0        # work done when the last row was written (the engine's units)
    step: float = 0.0        # optimizer steps taken by then


class SimulatedShim:
    """One simulated job's shim: turns the engine's progress into the rows the real shim appends."""

    def __init__(self, ckpt_root: str, key: str, job: SimJob) -> None:
        self.path = protocol.metrics_path(ckpt_root, key)
        self.job = job
        self._last = _Progress()
        self._last_time = -math.inf
        self._in_place = 0

    def report(self, per_node: tuple[int, ...], done: float, now: float, segment: Segment | None,
               in_place: int = 0) -> bool:
        """Append a row for the job running at `per_node` with `done` work done; False when it did not step.
        `in_place`: the shrinks it went on from in its processes so far (the first row after one says so)."""
        job = self.job
        speed = job.speed
        gpus = sum(per_node)
        row: dict[str, Any] = {"time": now, "gpus": gpus, "nodes": len(per_node)}
        if isinstance(speed, AdaptiveSpeed) and segment is not None:
            # Work is statistical progress: an optimizer step at the segment's batch makes rate / steps_per_s
            # of it. The step count between rows uses the current segment's ratio (exact within an epoch).
            per_step = segment.rate / segment.steps_per_s
            step = self._last.step + max(done - self._last.done, 0.0) / per_step
            row.update(steps_per_s=segment.steps_per_s, samples_per_s=segment.steps_per_s * segment.batch,
                       batch=segment.batch, total_steps=max(int(math.ceil(step + (job.work - done) / per_step)), 1))
            noise = segment.noise
        else:
            # Work is optimizer steps (fixed batch) or the trace's own unit.
            step = done
            steps_per_s = speed(per_node)
            row.update(steps_per_s=steps_per_s, total_steps=max(int(math.ceil(job.work)), 1))
            noise = None
            if isinstance(speed, PolluxSpeed):
                row.update(samples_per_s=steps_per_s * speed.batch_size, batch=speed.batch_size)
                noise = speed.noise(done)
        if int(step) <= int(self._last.step):
            return False
        row["step"] = int(step)
        # The real shim writes a row as a step ends: this one is stamped when its last whole step ended, not
        # at the tick. Stamped at the tick, a slow job's fraction of a step (up to 1/steps_per_s seconds) read
        # as time that did no steps, i.e. as a restart, and its measured restart cost came out far too low.
        if row["steps_per_s"] > 0:
            row["time"] = max(now - (step - int(step)) / row["steps_per_s"], self._last_time)
        self._last_time = row["time"]
        if noise is not None:
            row["grad_sqr"], row["grad_var"] = noise.grad_sqr, noise.grad_var
        if in_place > self._in_place:
            row["in_place"] = 1
        _append(self.path, protocol.MetricsRow(**row))
        self._in_place = in_place
        self._last = _Progress(done, step)
        return True
