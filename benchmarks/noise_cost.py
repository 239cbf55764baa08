"""What measuring the gradient noise costs: training steps with the estimator on and off, side by side in one run.

The estimator (slurm_elastic/train/noise.py) adds one dot product per
parameter per micro-batch (a tensor hook) and one total norm per optimizer
step; this times whole optimizer steps (forward, backward over every
micro-batch, the estimator's update, SGD step) of an MLP, alternating blocks
with and without it so that drift on a shared machine hits both alike. The
figure is the median block's time per step (and the fastest block's, which
a loaded machine disturbs least). Since on/off differences of 1 % drown in
the noise of a shared CPU, the estimator's own work is also timed alone:
its hook function on every parameter's gradient for each micro-batch plus
its per-step update, fastest of --blocks x 5 repeats (`estimator_ms`);
`overhead_pct` is that over the fastest step without it. One process: DDP's all-reduce
would add the same time to both columns; the estimator's update takes the
global batch as micro x accumulation x --world (its cost does not depend on
that number, and at one rank without accumulation there is nothing to
compare).

    python3 benchmarks/noise_cost.py                   # table
    python3 benchmarks/noise_cost.py --json            # JSON list, one row per case and setting
    python3 benchmarks/noise_cost.py --device cuda --width 4096 --depth 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
import sys

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table import print_rows  # benchmarks/table.py: how every benchmark prints  # noqa: E402

from slurm_elastic.train.noise import GradientNoiseEstimator  # noqa: E402


def build(width: int, depth: int, device: torch.device) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_block(model: nn.Module, optimizer: torch.optim.Optimizer, est: GradientNoiseEstimator | None,
              data: list[tuple[torch.Tensor, torch.Tensor]], accumulation: int, steps: int,
              device: torch.device, world: int = 4) -> float:
    """Seconds per optimizer step over `steps` steps."""
    loss_fn = nn.CrossEntropyLoss()
    micro = data[0][0].shape[0]
    sync(device)
    t0 = time.perf_counter()
    for s in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for m in range(accumulation):
            x, y = data[(s * accumulation + m) % len(data)]
            (loss_fn(model(x), y) / accumulation).backward()
        if est is not None:
            est.step_done(micro_batch=micro, global_batch=micro * accumulation * world, micro_batches=accumulation)
        optimizer.step()
    sync(device)
    return (time.perf_counter() - t0) / steps


def measure(width: int, depth: int, micro: int, accumulation: int, device: torch.device, steps: int,
            blocks: int, every: int) -> list[dict[str, object]]:
    torch.manual_seed(0)
    model = build(width, depth, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = [(torch.randn(micro, width, device=device), torch.randint(0, 10, (micro,), device=device))
            for _ in range(8)]
    est = GradientNoiseEstimator(model, every_steps=every)
    est.micro_grad_scale = 1.0 / accumulation
    run_block(model, optimizer, est, data, accumulation, max(steps // 4, 2), device)    # warm-up, hooks on
    est.close()
    run_block(model, optimizer, None, data, accumulation, max(steps // 4, 2), device)   # warm-up, hooks off
    times: dict[bool, list[float]] = {False: [], True: []}
    for b in range(blocks):
        for on in ((False, True) if b % 2 == 0 else (True, False)):
            est = GradientNoiseEstimator(model, every_steps=every) if on else None
            if est is not None:
                est.micro_grad_scale = 1.0 / accumulation
            times[on].append(run_block(model, optimizer, est, data, accumulation, steps, device))
            if est is not None:
                assert est.estimate() is not None           # it measured something (and this syncs once)
                est.close()
    own = estimator_alone(model, micro, accumulation, device, blocks * 5) / every
    params = sum(p.numel() for p in model.parameters())
    off = statistics.median(times[False])
    rows: list[dict[str, object]] = []
    for on in (False, True):
        step_ms = statistics.median(times[on]) * 1e3
        rows.append({"device": device.type, "params_m": params / 1e6, "micro_batch": micro,
                     "accumulation": accumulation, "estimator": f"every {every}" if on else "off",
                     "step_ms": step_ms,
                     "step_ms_min": min(times[on]) * 1e3,
                     "on_vs_off_pct": (step_ms / (off * 1e3) - 1) * 100 if on else None,
                     "estimator_ms": own * 1e3 if on else None,
                     "overhead_pct": own / min(times[False]) * 100 if on else None})
    return rows


def estimator_alone(model: nn.Module, micro: int, accumulation: int, device: torch.device, repeats: int,
                    world: int = 4) -> float:
    """Seconds of the estimator's own work per optimizer step: what its hooks and update do, on real gradients."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads, "run a step first"
    best = float("inf")
    for _ in range(repeats):
        est = GradientNoiseEstimator(model)
        est.close()            # the hook function is called by hand below, on the gradients a step left
        est.micro_grad_scale = 1.0 / accumulation
        sync(device)
        t0 = time.perf_counter()
        for _ in range(accumulation):
            for g in grads:
                est._on_grad(g)
        est.step_done(micro_batch=micro, global_batch=micro * accumulation * world, micro_batches=accumulation)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--accumulation", type=int, nargs="+", default=[1, 4])
    p.add_argument("--every", type=int, nargs="+", default=[1, 10],
                   help="measure one optimizer step in N (the session's noise_every_steps)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per block")
    p.add_argument("--blocks", type=int, default=6, help="blocks per setting (alternating on/off)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows: list[dict[str, object]] = []
    for a in args.accumulation:
        for every in args.every:
            rows += measure(args.width, args.depth, args.micro_batch, a, device, args.steps, args.blocks, every)
    print_rows(rows, args.json, title=f"gradient-noise estimator cost: MLP {args.depth}x{args.width}, "
                                      f"median of {args.blocks} blocks of {args.steps} steps")


if __name__ == "__main__":
    main()
