"""Adaptive batch (opt-in): the batch chosen per start, the AdaScale learning rate, the data position across a change."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slurm_elastic.goodput import GradientNoise, gain
from slurm_elastic.errors import ElasticError, SpecError
from slurm_elastic.spec import BatchRange, parse_directives, spec_from_options
from slurm_elastic import jobfiles as protocol
from slurm_elastic.train import ElasticLoop
from slurm_elastic.train.environment import JobEnvironment
from slurm_elastic.train.sampler import BatchGeometryError, ElasticSampler, adaptive_batches, choose_batch

N = 24
LR = 0.1


def _objects() -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    model = nn.Linear(1, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x = torch.linspace(-1, 1, N, dtype=torch.float64).unsqueeze(1)
    return model, optimizer, DataLoader(TensorDataset(x, torch.arange(N)), batch_size=2, shuffle=True)


def _loop(tmp_path: Path, **kw) -> ElasticLoop:
    return ElasticLoop(global_batch=8, batch="adaptive:4-16", ckpt_dir=str(tmp_path / "ck"),
                       env=JobEnvironment.from_env({"SLURM_JOB_ID": "93"}), fast_exit=False, metrics_every_s=0.0,
                       noise_every_steps=1,
                       **kw)


def test_a_restart_at_a_new_batch_keeps_the_stream_exact_and_scales_the_lr_by_the_gain(tmp_path: Path) -> None:
    by_step: dict[int, list[int]] = {}
    updates: list[tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]] = []   # (gain, w before, grad, w after)

    def run(signal_after: int | None) -> ElasticLoop:
        loop = _loop(tmp_path)
        model, optimizer, loader = _objects()
        ddp, optimizer, loader = loop.prepare(model, optimizer, loader)
        fresh: set[int] = set()
        batches = 0
        try:
            for epoch in range(3):
                loader.sampler.set_epoch(epoch)
                for x, idx in loader:
                    if loop.step not in fresh:
                        fresh.add(loop.step)
                        by_step[loop.step] = []
                    by_step[loop.step] += idx.tolist()
                    (ddp(x).squeeze(1) - 1.0).pow(2).mean().backward()
                    batches += 1
                    last = batches % loop.accumulation == 0
                    before = (model.weight.detach().clone(), model.weight.grad.detach().clone()) if last else None
                    optimizer.step()
                    if before is not None:
                        updates.append((loop.lr_gain, *before, model.weight.detach().clone()))
                        assert optimizer.param_groups[0]["lr"] == LR     # the group keeps the unscaled rate
                    if loop.step == signal_after:
                        os.kill(os.getpid(), signal.SIGUSR2)
        except SystemExit as exc:
            assert exc.code == protocol.REQUEUE_EXIT_CODE
            return loop
        loop.close()
        return loop

    first = run(signal_after=4)
    # No noise measured before the first start: the base batch, unscaled.
    assert first.global_batch == 8 and first.lr_gain == 1.0
    ck = tmp_path / "ck"
    assert json.loads((ck / "93" / protocol.BATCH_FILE).read_text()) == {"min": 4, "max": 16, "base": 8}
    manifest = json.loads((ck / "93" / protocol.step_dir_name(5) / protocol.MANIFEST_FILE).read_text())
    assert manifest["global_batch"] == 8 and manifest["samples_consumed"] == 40 and manifest["noise"]["updates"] >= 5
    noise = GradientNoise(manifest["noise"]["grad_sqr"], manifest["noise"]["grad_var"])

    updates.clear()
    second = run(signal_after=None)
    # Measured noise: goodput picks the smallest batch that runs here (samples/s is flat in the accumulation),
    # and AdaScale's gain for it relative to the base.
    assert second.global_batch == 4 and second.accumulation == 2
    assert second.lr_gain == pytest.approx(gain(4, 8, noise), rel=1e-12) and second.lr_gain < 1.0
    for g, w, grad, after in updates:
        assert g == second.lr_gain
        assert torch.allclose(after, w - LR * g * grad, rtol=0, atol=1e-14), (after, w, grad)
    # Steps 0-4 at 8 samples, then 5.. at 4: 72 samples = 3 epochs, each sample once per epoch, in stream order.
    assert second.step == 5 + (72 - 40) // 4
    seen = [i for s in sorted(by_step) for i in by_step[s]]
    assert seen == ElasticSampler(N, seed=0).indices(0, 72)
    for e in range(3):
        assert sorted(seen[e * N:(e + 1) * N]) == list(range(N))
    rows = [json.loads(line) for line in (ck / "93" / protocol.METRICS_FILE).read_text().splitlines()]
    assert {r["batch"] for r in rows if r["step"] <= 5} == {8} and rows[-1]["batch"] == 4
    assert rows[-1]["grad_var"] >= 0 and rows[-1]["grad_sqr"] >= 0


def test_fixed_batch_stays_the_default_and_refuses_a_checkpoint_of_another_batch(tmp_path: Path) -> None:
    env = JobEnvironment.from_env({"SLURM_JOB_ID": "94"})
    loop = ElasticLoop(global_batch=8, ckpt_dir=str(tmp_path / "ck"), env=env, fast_exit=False)
    model, optimizer, loader = _objects()
    _, optimizer, loader = loop.prepare(model, optimizer, loader)
    assert not loop.session.adaptive and loop.global_batch == 8 and loop.lr_gain == 1.0
    loop.close()
    assert not (tmp_path / "ck" / "94" / protocol.BATCH_FILE).exists()


def test_the_batch_range_is_one_clear_error_when_malformed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(protocol.BATCH_ENV, "adaptive:16-4")
    with pytest.raises(ElasticError, match=f"min batch 16 exceeds max batch 4 .*{protocol.BATCH_ENV}"):
        ElasticLoop(global_batch=8, ckpt_dir=str(tmp_path / "ck"), env=JobEnvironment.from_env({"SLURM_JOB_ID": "95"}))
    monkeypatch.delenv(protocol.BATCH_ENV)
    loop = ElasticLoop(global_batch=32, batch="adaptive:4-16", ckpt_dir=str(tmp_path / "ck"),
                       env=JobEnvironment.from_env({"SLURM_JOB_ID": "96"}), fast_exit=False)
    with pytest.raises(ElasticError, match="base batch 32 .* outside the adaptive range 4-16"):
        loop.prepare(*_objects())


def test_choose_batch_follows_goodput_and_the_geometry() -> None:
    assert adaptive_batches(8, 64, 4, 3) == [12, 24, 36, 48, 60]
    # No noise yet: the base when it splits, else the nearest below with linear scaling down.
    assert choose_batch(8, 64, 16, 4, 2, None).global_batch == 16
    low = choose_batch(8, 64, 16, 4, 3, None)
    assert (low.global_batch, low.lr_gain) == (12, 0.75)
    # Noise measured: the smallest candidate (more GPUs -> a larger one), AdaScale's gain above the base.
    noise = GradientNoise(grad_sqr=1.0, grad_var=40.0)
    grown = choose_batch(8, 64, 16, 4, 8, noise)
    assert grown.global_batch == 32 and grown.lr_gain == pytest.approx((40 / 16 + 1) / (40 / 32 + 1))
    assert 1.0 < grown.lr_gain < 2.0
    with pytest.raises(BatchGeometryError, match="nearest valid world size is 4") as exc:
        choose_batch(8, 16, 8, 4, 5, noise)
    assert exc.value.valid_world_sizes == (1, 2, 3, 4)


def test_batch_directive_and_flag_parse_into_the_spec() -> None:
    options = parse_directives("#!/bin/bash\n#ELASTIC --gpus 1-8\n#ELASTIC --batch adaptive:64-1024\npython3 t.py\n")
    spec = spec_from_options(options)
    assert spec.batch == BatchRange(64, 1024) and spec.batch.to_text() == "adaptive:64-1024"
    # Job-side: the canonical comment (job_submit.lua, every backend) is what it was.
    assert spec.to_comment() == spec_from_options({"gpus": "1-8"}).to_comment()
    for bad in ("64-1024", "adaptive:0-8", "adaptive:9-8", "adaptive:a-b", "fixed"):
        with pytest.raises(SpecError, match="--batch"):
            spec_from_options({"gpus": "1-8", "batch": bad})
