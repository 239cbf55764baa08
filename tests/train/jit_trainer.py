"""Test trainer for peer loss: the digits MLP under DDP, with a victim that dies at a chosen point of a step.

    python -m tests.train.jit_trainer --ckpt-dir D --steps 12 --log-dir L \
        [--die RANK:STEP:POINT:kill|stop] [--lag RANK:STEP:POINT:SECONDS] [--slow RANK:STEP:SECONDS]
        [--catch carry-on|swallow|hydra|hydra-detached|lightning]

Points of step STEP (the step being computed, i.e. after STEP-1 completed steps):
forward, mid-forward (after the first layer: a periodic snapshot is half taken),
bucket-first / bucket-last (in DDP's gradient all-reduce, before that bucket is
sent), bucket-done (the last bucket's all-reduce came back), after-backward,
before-step (before the session's per-step agreement), in-step (half the
parameters updated), after-step (updated), after-agree (optimizer_step returned).

--catch: how the training loop treats exceptions, as frameworks do: carry-on
(a try/except around each step that logs and goes on), swallow (a try/except
around each collective alone: the step goes on to optimizer_step), hydra (a runner that
catches, logs and exits 1 inside its except block, as Hydra's does),
hydra-detached (the same, exiting after the except block: no exception chain
left), lightning (a runner that re-raises its own error from the original).

Every rank logs `applied-<rank>.jsonl`: {"step", "digest"} right after each
optimizer update (state digest as checkpoints compute it), and rank 0
`loss.jsonl`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from slurm_elastic.train.checkpointer import state_digest
from slurm_elastic.train.examples.digits import build_model, load_digits_tensors
from slurm_elastic.train.session import ElasticSession

POINTS = ("forward", "mid-forward", "bucket-first", "bucket-last", "bucket-done", "after-backward", "before-step",
          "in-step", "after-step", "after-agree")


class SteppedSGD(torch.optim.Optimizer):
    """SGD with momentum, one parameter after another, with a seam halfway (`pause`)."""

    def __init__(self, params, lr: float, momentum: float, pause: Callable[[], None]) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})
        self.pause = pause

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            if i == len(params) // 2:
                self.pause()
            group = self.param_groups[0]
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = p.grad.detach().clone()
            else:
                state["momentum_buffer"].mul_(group["momentum"]).add_(p.grad)
            p.add_(state["momentum_buffer"], alpha=-group["lr"])
        return None


def live_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    items = []
    for name, p in model.named_parameters():
        items.append(("param/" + name, p.detach()))
        for key, value in optimizer.state.get(p, {}).items():
            items.append((f"optim/{name}/{key}", value))
    return state_digest(items)


_DATA: tuple[torch.Tensor, torch.Tensor] | None = None


def warm() -> None:
    """Load what every rank loads (the fork server calls this once, before forking)."""
    global _DATA
    _DATA = load_digits_tensors()


class FitError(Exception):
    """What a Lightning-style runner raises instead of the error it caught."""


def hydra_style(fn: Callable[[], None]) -> Callable[[], None]:
    """Hydra's run_and_report: log the error, exit 1 (inside the except block)."""
    def run() -> None:
        try:
            fn()
        except Exception:
            logging.getLogger("hydra").exception("Error executing job")
            sys.exit(1)
    return run


def hydra_detached_style(fn: Callable[[], None]) -> Callable[[], None]:
    """Like hydra_style, but the exit comes after the except block: SystemExit(1) carries no chain."""
    def run() -> None:
        failed = False
        try:
            fn()
        except Exception:
            logging.getLogger("hydra").exception("Error executing job")
            failed = True
        if failed:
            sys.exit(1)
    return run


def lightning_style(fn: Callable[[], None]) -> Callable[[], None]:
    """A trainer that tears down and raises its own error from the one it caught."""
    def run() -> None:
        try:
            fn()
        except Exception as exc:
            raise FitError("fit failed") from exc
    return run


RUNNERS: dict[str, Callable[[Callable[[], None]], Callable[[], None]]] = {
    "hydra": hydra_style, "hydra-detached": hydra_detached_style, "lightning": lightning_style}


def _spec(text: str | None, n: int) -> list[str] | None:
    if not text:
        return None
    parts = text.split(":")
    if len(parts) != n:
        raise SystemExit(f"bad spec {text!r}")
    return parts


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every-steps", type=int, default=None)
    p.add_argument("--die", default=None, help="RANK:STEP:POINT:kill|stop")
    p.add_argument("--lag", default=None, help="RANK:STEP:POINT:SECONDS - a survivor that is late at a point")
    p.add_argument("--slow", default=None, help="RANK:STEP:SECONDS - one step this much slower on that rank")
    p.add_argument("--liveness-timeout", type=float, default=3.0)
    p.add_argument("--heartbeat", type=float, default=0.5)
    p.add_argument("--timeout-s", type=float, default=240.0)
    p.add_argument("--fail", type=int, default=None,
                   help="STEP: every rank raises an error of its own there, rank r r/2 s after rank 0")
    p.add_argument("--catch", choices=("carry-on", "swallow", *RUNNERS), default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("SLURM_ELASTIC_LOG", "INFO"),
                        format="%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    die, lag, slow = _spec(args.die, 4), _spec(args.lag, 4), _spec(args.slow, 3)
    x, y = _DATA or load_digits_tensors()
    global_batch, micro_batch = 48, 8
    with ElasticSession(ckpt_dir=args.ckpt_dir, every_steps=args.every_steps, timeout_s=args.timeout_s,
                        metrics_every_s=0.0, liveness_timeout_s=args.liveness_timeout,
                        heartbeat_s=args.heartbeat) as session:
        rank = session.rank

        fired: set[str] = set()

        def at(point: str) -> None:
            """The kill and lag seams, each once (a point may recur: one forward per micro-batch);
            step numbers count the step being computed."""
            step = session.step + 1
            if die and int(die[0]) == rank and int(die[1]) == step and die[2] == point and "die" not in fired:
                fired.add("die")
                logging.getLogger("victim").warning("rank %d: dying (%s) at step %d, %s", rank, die[3], step, point)
                os.kill(os.getpid(), signal.SIGKILL if die[3] == "kill" else signal.SIGSTOP)
            if lag and int(lag[0]) == rank and int(lag[1]) == step and lag[2] == point and "lag" not in fired:
                fired.add("lag")
                time.sleep(float(lag[3]))

        model = build_model()
        optimizer = SteppedSGD(model.parameters(), lr=0.05, momentum=0.9, pause=lambda: at("in-step"))
        applied = open(os.path.join(args.log_dir, f"applied-{rank}.jsonl"), "a", encoding="utf-8")

        def log_applied(_opt: object, _args: object, _kwargs: object) -> None:
            applied.write(json.dumps({"step": session.step + 1, "digest": live_digest(model, optimizer)}) + "\n")
            applied.flush()
            at("after-step")
        optimizer.register_step_post_hook(log_applied)
        session.attach(model, optimizer, global_batch=global_batch, micro_batch=micro_batch, dataset_size=len(x),
                       seed=1234)
        model[1].register_forward_hook(lambda *_: at("mid-forward"))
        net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)
        # DDP's first bucket is 1 MiB unless told otherwise: split it too, so the
        # gradient all-reduce has several buckets to die between.
        net.bucket_bytes_cap_default = False

        def comm_hook(_state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the (non-string) annotations
            last = bucket.is_last()
            at("bucket-last" if last else "bucket-first") if (last or bucket.index() == 0) else None
            fut = dist.all_reduce(bucket.buffer().div_(session.world_size), async_op=True).get_future()

            def done(f: torch.futures.Future) -> torch.Tensor:
                if last:
                    at("bucket-done")
                return f.value()[0]
            return fut.then(done)
        net.register_comm_hook(None, comm_hook)
        scale = session.world_size / global_batch
        loss_fn = nn.CrossEntropyLoss(reduction="sum")
        @contextlib.contextmanager
        def swallowed() -> Iterator[None]:
            if args.catch != "swallow":
                yield
                return
            try:
                yield
            except Exception as exc:
                logging.getLogger("loop").warning("ignoring %s", type(exc).__name__)

        def one_step() -> None:
            # the loop's own state, changed as the step starts (a just-in-time commit of the step before
            # must save it as it was then)
            session.user_state["computing"] = session.step + 1
            at("forward")
            if args.fail is not None and session.step + 1 == args.fail:
                time.sleep(rank / 2)
                raise ValueError(f"rank {rank}: the user's own error at step {args.fail}")
            if slow and int(slow[0]) == rank and int(slow[1]) == session.step + 1:
                time.sleep(float(slow[2]))
            total = torch.zeros(1, dtype=torch.float64)
            micro = session.micro_batches()
            for i, idx in enumerate(micro):
                with (net.no_sync() if i < len(micro) - 1 else contextlib.nullcontext()):
                    loss = loss_fn(net(x[idx]), y[idx])
                    with swallowed():
                        (loss * scale).backward()
                total += loss.detach()
            at("after-backward")
            with swallowed():
                dist.all_reduce(total)
            at("before-step")
            session.optimizer_step()
            at("after-agree")
            if rank == 0:
                with open(os.path.join(args.log_dir, "loss.jsonl"), "a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": session.step, "loss": float(total) / global_batch,
                                        "world_size": session.world_size}) + "\n")

        def loop() -> None:
            while not session.done(args.steps):
                if args.catch != "carry-on":
                    one_step()
                    continue
                try:
                    one_step()
                except Exception as exc:     # the user's loop: log and go on with the next batch
                    logging.getLogger("loop").warning("step %d failed (%s); going on", session.step + 1,
                                                      type(exc).__name__)
        RUNNERS.get(args.catch or "", lambda fn: fn)(loop)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
