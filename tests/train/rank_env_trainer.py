"""A loop written as nanoGPT's: it decides whether it runs distributed from RANK, and wraps the model in
DDP only then (tests/train/test_session.py: the session exports RANK, and a loop whose ranks never average
their gradients is stopped instead of training one model per rank)."""

import argparse
import os
import sys

import torch
from torch import nn

from slurm_elastic.train import ElasticSession
from slurm_elastic.train.examples.digits import build_model, load_digits_tensors


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--never-ddp", action="store_true", help="the script's own bug: no DDP whatever RANK says")
    p.add_argument("--warmup-zero-lr", action="store_true", help="lr 0 at the first step, as nanoGPT's warmup")
    args = p.parse_args()
    torch.set_num_threads(1)
    x, y = load_digits_tensors()
    with ElasticSession(every_steps=1000, metrics_every_s=0.0) as session:
        ddp = int(os.environ.get("RANK", -1)) != -1 and not args.never_ddp
        print(f"ddp {ddp} RANK {os.environ.get('RANK')} WORLD_SIZE {os.environ.get('WORLD_SIZE')}", flush=True)
        model = build_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        session.attach(model, optimizer, global_batch=32, micro_batch=16, dataset_size=len(x), seed=7)
        net = nn.parallel.DistributedDataParallel(model) if ddp else model
        loss_fn = nn.CrossEntropyLoss()
        while not session.done(args.steps):
            for group in optimizer.param_groups:
                group["lr"] = 0.0 if args.warmup_zero_lr and session.step == 0 else 0.1
            for idx in session.micro_batches():
                loss_fn(net(x[idx]), y[idx]).backward()
            session.optimizer_step()
    print("trained", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
