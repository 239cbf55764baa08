"""Checkpoint cost on a ~100M-parameter transformer on CPU: none / LayerCheckpointer / torch.save / DCP / jit.

Every mode checkpoints after every optimizer step (layer.skip: whenever its writer is free).
layer uses the store's default checksum (xxh3-128), layer.sha256 the same with sha256.
jit takes no periodic checkpoint: only the per-step bookkeeping that lets survivors of a
peer loss commit just in time, and the heartbeat; its jit_commit_s is what that commit costs
(replica digest plus writing every group from one rank).
Modes run one after another; the baseline runs first and last. Reported per mode: mean
step time, overhead against no checkpointing, training stall per checkpoint
(time the training thread spends on it), bytes written per second against
`dd` writing the same size to the same directory, and restore time.

    python3 benchmarks/checkpoint.py                 # table
    python3 benchmarks/checkpoint.py --json          # one JSON object per mode
    python3 benchmarks/checkpoint.py --steps 3 --layers 4 --dir /lustre/scratch/me
    python3 benchmarks/checkpoint.py --modes none,layer,none --repeat 5 --threads 1

Keep runs short on shared machines: every mode writes a full checkpoint
(parameters + AdamW state, ~1.2 GB at 100M parameters) per step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slurm_elastic.train.checkpointer import LayerCheckpointer, load_into
from slurm_elastic.train.peers import Liveness, RunDirectory
from slurm_elastic.train.rng import capture_rng_raw
from slurm_elastic.train.store import CheckpointStore


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer(args.vocab, args.d_model, args.layers, args.heads, args.seq)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def run_mode(mode: str, args: argparse.Namespace, root: str) -> Iterator[dict[str, Any] | None]:
    """Yields None after each step (so modes can be interleaved), then the result row."""
    model, opt = build(args)
    work = os.path.join(root, mode)
    os.makedirs(work)
    stalls: list[float] = []
    writes: list[tuple[int, float]] = []      # (bytes, seconds of writing)
    step_times: list[float] = []
    before_step: Callable[[int], None] = lambda step: None
    after_step: Callable[[int], None] = lambda step: None
    finish: Callable[[], None] = lambda: None
    restore: Callable[[], float] = lambda: float("nan")

    waits: list[float] = []                   # part of the stall spent waiting for an earlier write
    copied: list[int] = []                    # live bytes copied at optimizer.step (writer behind)
    if mode in ("layer", "layer.skip", "layer.sha256"):
        store = CheckpointStore(os.path.join(work, "job"), keep=1,
                                checksum="sha256" if mode == "layer.sha256" else "xxh3_128")
        ck = LayerCheckpointer(model, opt, store, group_bytes=args.group_mb << 20)
        committed: list[int] = []

        def settle(block: bool) -> None:
            got = ck.drain() if block else ck.poll()
            for f in got:
                stalls.append(f.stall_s)
                copied.append(f.copied_bytes)
                writes.append((sum(r.size for r in f.records), f.write_s))
                store.commit(f.step, {"samples_consumed": 0, "world_size": 1, "global_batch": 1,
                                      "model_fingerprint": "bench", "files": [r.to_json() for r in f.records]})
                committed.append(f.step)

        def after_layer(step: int) -> None:
            settle(block=False)
            if ck.in_flight:
                if mode == "layer.skip":
                    return          # the session's default: skip while the previous one is written
                # every step means every step: wait for the previous write, and count it as stall
                t0 = time.monotonic()
                settle(block=True)
                waits.append(time.monotonic() - t0)
                stalls[-1] += waits[-1]
            ck.arm(step)

        def finish_layer() -> None:
            settle(block=True)      # drains: no optimizer step follows, so nothing is copied
            ck.close()

        def restore_layer() -> float:
            m2, o2 = build(args)
            t0 = time.monotonic()
            step = store.candidates()[0]
            manifest = store.read_manifest(step)
            load_into(m2, o2, [kv for t in store.read_files(step, manifest["files"]) for kv in t.items()], None)
            return time.monotonic() - t0

        after_step, finish, restore = after_layer, finish_layer, restore_layer

    elif mode == "jit":
        # No periodic checkpoint: only what the session does every step so that a peer
        # loss can be committed just in time (the boundary bookkeeping under the state
        # lock, the generators' states) and the liveness thread's heartbeat once a second.
        store = CheckpointStore(os.path.join(work, "job"), keep=1)
        ck = LayerCheckpointer(model, opt, store, group_bytes=args.group_mb << 20)
        run = RunDirectory(work, "bench", 0, 0)
        run.create()
        live = Liveness(run, rank=0, world_size=2, node="bench", watch=1, on_lost=lambda reason: None)
        live.start()
        lock = threading.Lock()

        def after_jit(step: int) -> None:
            with lock:
                ck.mark_boundary()
                capture_rng_raw()

        def finish_jit() -> None:
            live.stop()
            ck.close()

        def restore_jit() -> float:
            # What a peer loss costs the committing survivor: its replica state (with digest)
            # written as one step, from this one rank.
            t0 = time.monotonic()
            state = ck.replica_state()
            store.begin_step(1)
            records = ck.write_replica(1, state, rank=0)
            store.commit(1, {"samples_consumed": 0, "world_size": 1, "global_batch": 1,
                             "model_fingerprint": "bench", "files": [r.to_json() for r in records]})
            jit_commit_s.append(time.monotonic() - t0)
            return float("nan")

        jit_commit_s: list[float] = []
        after_step, finish, restore = after_jit, finish_jit, restore_jit

    elif mode == "torch.save":
        path = os.path.join(work, "ckpt.pt")

        def after_save(step: int) -> None:
            t0 = time.monotonic()
            with open(path + ".tmp", "wb") as f:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
            dt = time.monotonic() - t0
            stalls.append(dt)
            writes.append((os.path.getsize(path), dt))

        def restore_save() -> float:
            m2, o2 = build(args)
            t0 = time.monotonic()
            state = torch.load(path, weights_only=True)
            m2.load_state_dict(state["model"])
            o2.load_state_dict(state["optim"])
            return time.monotonic() - t0

        after_step, restore = after_save, restore_save

    elif mode == "dcp.async_save":
        import torch.distributed.checkpoint as dcp

        pending: list[Any] = []

        def wait_prev() -> float:
            t0 = time.monotonic()
            while pending:
                fut, started, d = pending.pop(0)
                fut.result()
                writes.append((dir_bytes(d), time.monotonic() - started))
            return time.monotonic() - t0

        def after_dcp(step: int) -> None:
            waited = wait_prev()
            waits.append(waited)
            t0 = time.monotonic()
            d = os.path.join(work, f"step-{step}")
            fut = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=d)
            stalls.append(waited + time.monotonic() - t0)
            pending.append((fut, t0, d))

        def restore_dcp() -> float:
            m2, o2 = build(args)
            last = sorted(os.listdir(work), key=lambda n: int(n.split("-")[1]))[-1]
            t0 = time.monotonic()
            # DCP loads in place into a state dict of the right shapes.
            train_step(m2, o2, args, 0)   # materialise AdamW state so shapes exist
            t0 = time.monotonic()
            state = {"model": m2.state_dict(), "optim": o2.state_dict()}
            dcp.load(state, checkpoint_id=os.path.join(work, last))
            m2.load_state_dict(state["model"])
            o2.load_state_dict(state["optim"])
            return time.monotonic() - t0

        after_step, finish, restore = after_dcp, lambda: (wait_prev(), None)[1], restore_dcp

    cpu0 = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            stalls.clear()
            writes.clear()
            waits.clear()
            copied.clear()
            cpu0 = _cpu_s()
        t0 = time.monotonic()
        before_step(step)
        train_step(model, opt, args, step)
        after_step(step + 1)
        if step >= args.warmup:
            step_times.append(time.monotonic() - t0)
        yield None
    cpu_s = _cpu_s() - cpu0
    finish()
    written = sum(b for b, _ in writes)
    write_s = sum(s for _, s in writes)
    row = {
        "mode": mode,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "steps": len(step_times),
        "step_ms": 1000 * sum(step_times) / len(step_times),
        "cpu_s_per_step": cpu_s / len(step_times),
        "stall_ms": 1000 * sum(stalls) / len(stalls) if stalls else 0.0,
        "write_wait_ms": 1000 * sum(waits) / len(stalls) if stalls else 0.0,
        "checkpoints": len(writes),
        "checkpoint_mb": written / len(writes) / 1e6 if writes else 0.0,
        "copied_mb": sum(copied) / len(copied) / 1e6 if copied else None,
        "write_mb_per_s": written / write_s / 1e6 if write_s else None,
        "restore_cache": (_drop_caches(args) if mode not in ("none", "jit") else None),
        "restore_s": restore() if mode not in ("none", "jit") else None,
    }
    if mode == "jit":
        restore()
        row["jit_commit_s"] = jit_commit_s[0]   # the restore column has nothing to say here
    shutil.rmtree(work, ignore_errors=True)
    yield row


def _drop_caches(args: argparse.Namespace) -> str:
    """A restarted job reads its checkpoint cold (another node, or long after the write): drop
    the page cache first, so torch.save's page-cached file and our O_DIRECT one compare fairly."""
    if args.warm_restore:
        return "warm"
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return "warm (cannot drop caches: needs root)"
    return "cold"


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)   # all threads: training and the writer
    return r.ru_utime + r.ru_stime


def dd_mb_per_s(directory: str, nbytes: int, *, direct: bool = False) -> float:
    path = os.path.join(directory, "dd.bin")
    count = max(1, nbytes // (8 << 20))
    t0 = time.monotonic()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={count}", "conv=fsync",
                    *(["oflag=direct"] if direct else [])], check=True, capture_output=True)
    dt = time.monotonic() - t0
    os.unlink(path)
    return count * (8 << 20) / dt / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=65)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--group-mb", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--modes", default="none,layer,layer.sha256,layer.skip,torch.save,dcp.async_save,none",
                   help="layer: LayerCheckpointer every step, waiting for the previous write when it lags; "
                        "layer.skip: skip a step's snapshot while the previous one is still written")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the whole mode list this many times; overheads are against each repeat's "
                        "own baselines, and a median line per mode is printed")
    p.add_argument("--warm-restore", action="store_true",
                   help="restore from the page cache (default: drop caches first when root)")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not dist.is_initialized():
        # DCP wants a process group; a world of one over gloo.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    try:
        # Modes run one after another: a mode's background writer must not slow the
        # next mode's steps. The baseline runs first and last, to show the drift of a
        # shared machine's load over the run.
        rows = []
        for rep in range(args.repeat):
            for m in args.modes.split(","):
                for row in run_mode(m, args, root):
                    if row is not None:
                        rows.append({"repeat": rep, **row})
        ckpt_bytes = int(max(r["checkpoint_mb"] for r in rows) * 1e6) or (1 << 30)
        dd = dd_mb_per_s(root, ckpt_bytes)
        dd_direct = dd_mb_per_s(root, ckpt_bytes, direct=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for rep in range(args.repeat):
        # Overheads against this repeat's own baselines: a shared machine's load drifts
        # between repeats more than a checkpoint costs.
        mine = [r for r in rows if r["repeat"] == rep]
        nones = [r["step_ms"] for r in mine if r["mode"] == "none"]
        base = sum(nones) / len(nones) if nones else None
        save_stall = next((r["stall_ms"] for r in mine if r["mode"] == "torch.save"), None)
        for r in mine:
            r["overhead_pct"] = 100 * (r["step_ms"] / base - 1) if base else None
            r["stall_vs_torch_save_pct"] = (100 * r["stall_ms"] / save_stall
                                            if save_stall and r["mode"] != "none" else None)
    for r in rows:
        r["dd_mb_per_s"] = dd
        r["dd_direct_mb_per_s"] = dd_direct
        r["cpus"] = os.cpu_count()
        r["torch_threads"] = torch.get_num_threads()
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    cols = ["mode", "step_ms", "overhead_pct", "cpu_s_per_step", "stall_ms", "write_wait_ms", "stall_vs_torch_save_pct",
            "checkpoints", "checkpoint_mb", "copied_mb", "write_mb_per_s", "dd_mb_per_s", "dd_direct_mb_per_s",
            "restore_s", "jit_commit_s"]
    print(f"{rows[0]['params_m']:.1f}M parameters, {args.steps} measured steps per mode, "
          f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads")
    print("  ".join(f"{c[:14]:>14}" for c in cols))
    for r in rows:
        print("  ".join(f"{_fmt(r.get(c)):>14}" for c in cols))
    if args.repeat > 1:
        print(f"\nmedian over {args.repeat} repeats (overhead against each repeat's own baseline):")
        for mode in dict.fromkeys(r["mode"] for r in rows if r["mode"] != "none"):
            over = sorted(r["overhead_pct"] for r in rows if r["mode"] == mode and r["overhead_pct"] is not None)
            stall = sorted(r["stall_ms"] for r in rows if r["mode"] == mode)
            if over:
                print(f"  {mode:>14}: overhead {statistics.median(over):+.1f} % (range {over[0]:+.1f} .. "
                      f"{over[-1]:+.1f}), stall {statistics.median(stall):.1f} ms")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"
    return str(v)


if __name__ == "__main__":
    main()
