"""The training job benchmarks/last_minute.py stops: a DDP script in the tutorial's shape (ElasticLoop, a
DataLoader with a DistributedSampler) that runs an evaluation pass, with an all-reduce of its metric, every
few steps, as real scripts do.

Each rank appends one JSON line per event to <log-dir>/rank<R>.log: `start` (the step it resumed at),
`step` (an optimizer step it completed), `eval` / `train` (the phase it enters). The injector reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from slurm_elastic.train import ElasticLoop


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--every-steps", type=int, default=20, help="periodic checkpoint every N steps")
    p.add_argument("--eval-every", type=int, default=25, help="an evaluation pass after every N steps")
    p.add_argument("--eval-s", type=float, default=3.0, help="length of an evaluation pass")
    p.add_argument("--step-s", type=float, default=0.05, help="time each optimizer step sleeps (the GPU's work)")
    args = p.parse_args()

    torch.set_num_threads(1)
    loop = ElasticLoop(global_batch=32, every_steps=args.every_steps)
    torch.manual_seed(0)
    x = torch.randn(8192, 32)
    y = (x.sum(dim=1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train = DataLoader(TensorDataset(x, y), batch_size=8, sampler=DistributedSampler(TensorDataset(x, y)))
    model, optimizer, train = loop.prepare(model, optimizer, train)
    held_out = x[:512], y[:512]

    log = open(os.path.join(args.log_dir, f"rank{loop.rank}.log"), "a", buffering=1, encoding="utf-8")

    def note(event: str, **fields: object) -> None:
        log.write(json.dumps({"event": event, "step": loop.step, "time": time.time(), **fields}) + "\n")

    note("start", restart=int(os.environ.get("SLURM_RESTART_COUNT", "0")), world_size=loop.world_size)
    last = loop.step
    for epoch in range(loop.epochs_done, 1_000_000):
        train.sampler.set_epoch(epoch)
        for xb, yb in train:
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(args.step_s / loop.accumulation)
            if loop.step == last:
                continue                      # a micro-batch of a step still accumulating
            last = loop.step
            note("step")
            if loop.step % args.eval_every == 0:
                note("eval")
                model.eval()
                end = time.monotonic() + args.eval_s
                correct = torch.zeros(1)
                with torch.no_grad():
                    while time.monotonic() < end:
                        correct += (model(held_out[0]).argmax(dim=1) == held_out[1]).sum()
                        time.sleep(0.05)
                if dist.is_initialized():
                    dist.all_reduce(correct)
                model.train()
                note("train")
    loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
