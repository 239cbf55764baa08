"""Example trainer: an MLP on scikit-learn's bundled digits, CPU/gloo, float64, bit-for-bit resumable."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from slurm_elastic import jobfiles as protocol
from slurm_elastic import settings
from slurm_elastic.train.session import ElasticSession

log = logging.getLogger(__name__)


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 10)).double()


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float64) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    return x, y


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ckpt-dir", default=None, help=f"checkpoint root (default ${protocol.CKPT_DIR_ENV})")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--every-steps", type=int, default=None, help="periodic checkpoint every N steps")
    p.add_argument("--every-seconds", type=float, default=None)
    p.add_argument("--loss-log", default=None, help="append {step, loss} JSON lines here (rank 0)")
    p.add_argument("--signal-self-at-step", type=int, default=None,
                   help="testing: every rank sends itself the checkpoint signal after this step")
    p.add_argument("--step-sleep", type=float, default=0.0, help="testing: seconds to sleep per step")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of DDP")
    p.add_argument("--batch", default=None,
                   help=f"adaptive:MIN-MAX: the session picks the global batch per start, --global-batch is the "
                        f"base the learning rate is tuned for (default ${protocol.BATCH_ENV}, else fixed)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=settings.LOG.read() or "INFO",
                        format="%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    x, y = load_digits_tensors()
    with ElasticSession(ckpt_dir=args.ckpt_dir, every_steps=args.every_steps, every_seconds=args.every_seconds,
                        timeout_s=args.timeout_s, metrics_every_s=0.0, batch=args.batch) as session:
        model = build_model()
        net: nn.Module = model
        if args.fsdp and session.world_size > 1:
            from torch.distributed.fsdp import fully_shard

            # Shard before the optimizer and attach(): both must see the sharded parameters.
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
        session.attach(model, optimizer, global_batch=args.global_batch, micro_batch=args.micro_batch,
                       dataset_size=len(x), scheduler=scheduler, seed=1234)
        if session.world_size > 1 and not args.fsdp:
            net = nn.parallel.DistributedDataParallel(model)
        # DDP averages gradients over ranks; scaling each rank's share by the world size
        # makes the update the exact global-batch mean at any world size. The global batch
        # is the session's: an adaptive job's differs from --global-batch.
        global_batch = session.geometry.global_batch
        scale = session.world_size / global_batch
        loss_fn = nn.CrossEntropyLoss(reduction="sum")
        while not session.done(args.steps):
            total = torch.zeros(1, dtype=torch.float64)
            micro = session.micro_batches()
            for i, idx in enumerate(micro):
                last = i == len(micro) - 1
                if args.fsdp and session.world_size > 1:
                    model.set_requires_gradient_sync(last)
                    ctx: object = _null()
                else:
                    ctx = net.no_sync() if (session.world_size > 1 and not last) else _null()
                with ctx:
                    loss = loss_fn(net(x[idx]), y[idx])
                    (loss * scale).backward()
                total += loss.detach()
            if session.world_size > 1:
                dist.all_reduce(total)
            step_loss = float(total) / global_batch
            session.optimizer_step()
            if session.rank == 0 and args.loss_log:
                with open(args.loss_log, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": session.step, "loss": step_loss, "world_size": session.world_size,
                                        "batch": global_batch, "lr_gain": session.lr_gain,
                                        "time": time.time()}) + "\n")
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.signal_self_at_step is not None and session.step == args.signal_self_at_step:
                os.kill(os.getpid(), getattr(signal, "SIG" + session.signal_name))
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
        if session.rank == 0:
            params = {n: t.tolist() for n, t in full.items()}
            final = os.path.join(session.job_dir, "final-params.json")
            with open(final, "w", encoding="utf-8") as f:
                json.dump({"step": session.step, "params": params}, f)
    return 0


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


if __name__ == "__main__":
    sys.exit(main())
