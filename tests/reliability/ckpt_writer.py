"""A training process that checkpoints every step, for the crash tests; the parent SIGKILLs it at random.

It runs the real ElasticSession/LayerCheckpointer/CheckpointStore. The only
addition is a trace: before and after each store operation one line goes to
`trace` with a single O_APPEND write, so after a SIGKILL the parent knows which
steps were committed (a `committed N` line is written only after commit()
returned) and in which phase the kill landed.
"""

from __future__ import annotations

import os
from typing import Any

TRAIN_WIDTH = 96
TRAIN_LAYERS = 6


def _trace(fd: int, text: str) -> None:
    os.write(fd, (text + "\n").encode())


def instrument(fd: int) -> None:
    """Wrap the store's operations with trace lines (this process only)."""
    from slurm_elastic.train.store import CheckpointStore

    commit, write, discard = CheckpointStore.commit, CheckpointStore.write_tensors, CheckpointStore.discard_step

    def traced_commit(self: CheckpointStore, step: int, manifest: Any) -> None:
        _trace(fd, f"commit-begin {step}")
        commit(self, step, manifest)
        _trace(fd, f"committed {step}")

    def traced_write(self: CheckpointStore, step: int, name: str, tensors: Any, *, rank: int) -> Any:
        _trace(fd, f"write-begin {step} {name}")
        rec = write(self, step, name, tensors, rank=rank)
        _trace(fd, f"write-end {step} {name}")
        return rec

    def traced_discard(self: CheckpointStore, step: int) -> None:
        _trace(fd, f"discard {step}")
        discard(self, step)

    CheckpointStore.commit = traced_commit  # type: ignore[method-assign]
    CheckpointStore.write_tensors = traced_write  # type: ignore[method-assign]
    CheckpointStore.discard_step = traced_discard  # type: ignore[method-assign]


def build_model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, TRAIN_WIDTH)]
    for _ in range(TRAIN_LAYERS):
        layers += [nn.Tanh(), nn.Linear(TRAIN_WIDTH, TRAIN_WIDTH)]
    layers += [nn.Tanh(), nn.Linear(TRAIN_WIDTH, 1)]
    return nn.Sequential(*layers).double()


def train_forever(root: str, job_id: str, trace_path: str | None, keep: int, job_name: str = "same-name",
                  steps: int = 10**9, restart_count: int | None = None, wait: bool = False) -> int:
    """Train and checkpoint every step until killed (or `steps`), resuming from the newest complete step.

    With a trace (a child process) the store is instrumented; without one
    (in the test process) it is left alone. Returns the last committed step.
    `restart_count` (for a child process: it sets SLURM_JOB_ID and SLURM_RESTART_COUNT,
    which is where the store reads its incarnation from) makes this process that
    incarnation of the job. `wait` commits every step (no snapshot skipped while the previous
    one is still being written).
    """
    import torch

    from slurm_elastic.train.environment import JobEnvironment
    from slurm_elastic.train.session import ElasticSession

    if restart_count is not None:
        os.environ["SLURM_JOB_ID"] = job_id
        os.environ["SLURM_RESTART_COUNT"] = str(restart_count)
    fd = -1
    if trace_path is not None:
        torch.set_num_threads(1)
        fd = os.open(trace_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        instrument(fd)
    env = JobEnvironment(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1,
                         master_addr="127.0.0.1", master_port=1, job_id=job_id, job_name=job_name,
                         restart_count=restart_count or 0, launcher="single")
    gen = torch.Generator().manual_seed(int(job_id) if job_id.isdigit() else 0)
    x = torch.randn(64, 6, generator=gen, dtype=torch.float64)
    y = x.sum(1, keepdim=True)
    model = build_model()
    with ElasticSession(ckpt_dir=root, env=env, every_steps=1, keep=keep, metrics_every_s=0.0,
                        wait_for_previous=wait) as s:
        if restart_count is not None:
            # Take the job directory over before choosing the step to resume from (what the session's
            # rank 0 should do at start); a store from before writer identities has no claim.
            getattr(s.store, "claim", lambda: None)()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        s.attach(model, opt, global_batch=16, micro_batch=16, dataset_size=len(x), group_bytes=1)
        if fd >= 0:
            _trace(fd, f"restored {s.restored_step}")
        while not s.done(steps):
            for idx in s.micro_batches():
                loss = (model(x[idx]) - y[idx]).pow(2).mean()
                loss.backward()
            s.optimizer_step()
        s.checkpoint_now()
    if fd >= 0:
        _trace(fd, "finished")
        os.close(fd)
    return -1 if s.last_committed_step is None else s.last_committed_step
