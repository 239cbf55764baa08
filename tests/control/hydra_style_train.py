"""A user's training script whose framework hides errors: a Hydra-style runner inside the elastic session.

    python -m tests.control.hydra_style_train --ckpt-dir D --loss-log L [--steps N] [--step-sleep S]

The loop runs under `hydra_style`, a plain function wrapper that does what Hydra's
run_and_report does (catch every exception, log it, `sys.exit(1)`), so a lost peer reaches
the session as SystemExit(1), not as the collective's error. Hydra itself is not a dependency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from slurm_elastic.train.examples.digits import build_model, load_digits_tensors
from slurm_elastic.train.session import ElasticSession


def hydra_style(task: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            task()
        except Exception:
            logging.getLogger("hydra").exception("Error executing job")
            sys.exit(1)
    return run


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--loss-log", required=True)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s")
    torch.set_num_threads(1)
    x, y = load_digits_tensors()
    with ElasticSession(ckpt_dir=args.ckpt_dir, timeout_s=args.timeout_s, metrics_every_s=0.0) as session:
        model = build_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        session.attach(model, optimizer, global_batch=48, micro_batch=8, dataset_size=len(x), seed=1234)
        net: nn.Module = nn.parallel.DistributedDataParallel(model) if session.world_size > 1 else model
        scale = session.world_size / 48
        loss_fn = nn.CrossEntropyLoss(reduction="sum")

        def train() -> None:
            while not session.done(args.steps):
                total = torch.zeros(1, dtype=torch.float64)
                micro = session.micro_batches()
                for i, idx in enumerate(micro):
                    sync = i == len(micro) - 1 or session.world_size == 1
                    with (contextlib.nullcontext() if sync else net.no_sync()):  # type: ignore[operator]
                        loss = loss_fn(net(x[idx]), y[idx])
                        (loss * scale).backward()
                    total += loss.detach()
                if session.world_size > 1:
                    dist.all_reduce(total)
                session.optimizer_step()
                if session.rank == 0:
                    with open(args.loss_log, "a", encoding="utf-8") as f:
                        f.write(json.dumps({"step": session.step, "loss": float(total) / 48}) + "\n")
                time.sleep(args.step_sleep)

        hydra_style(train)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
