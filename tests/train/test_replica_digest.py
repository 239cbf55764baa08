"""DDP keeps parameters and optimizer state equal on every replica, not BatchNorm statistics: each rank's
forward moves them by its own batch after DDP copied rank 0's in. The survivors of a lost peer agree on
what DDP keeps equal, so a model with BatchNorm (a ResNet) gets its just-in-time commit (before, its
replicas' digests always differed and nothing was committed)."""

from __future__ import annotations

import multiprocessing
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from slurm_elastic.train.checkpointer import LayerCheckpointer
from slurm_elastic.train.peers import decide
from slurm_elastic.train.store import CheckpointStore


def _rank(rank: int, port: int, root: str, out) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ck = LayerCheckpointer(model, opt, CheckpointStore(os.path.join(root, f"rank{rank}")), group_bytes=1024)
        net = nn.parallel.DistributedDataParallel(model)
        torch.manual_seed(1 + rank)                     # each rank its own batches
        for _ in range(2):
            opt.zero_grad()
            net(torch.randn(32, 8)).sum().backward()
            opt.step()
        ck.mark_boundary()
        state = ck.replica_state()
        out.put((rank, state.clean, state.digest, state.replicated_digest))
        ck.close()
    finally:
        dist.destroy_process_group()


def test_ddp_replicas_with_batchnorm_agree_on_their_replicated_state_and_commit(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (clean0, full0, replicated0), (clean1, full1, replicated1) = got[0], got[1]
    assert clean0 and clean1
    assert full0 != full1                  # the BatchNorm statistics differ: the whole state is not a replica
    assert replicated0 == replicated1      # parameters and momentum are
    statuses = {r: {"rank": r, "node": f"n{r}", "step": 2, "replica": True, "clean": True, "digest": replicated}
                for r, replicated in ((0, replicated0), (1, replicated1))}
    decision = decide(statuses, 3, {2: "n2"})
    assert decision["committer"] == 0 and decision["step"] == 2, decision
