"""ElasticLoop.prepare(): the user's epoch loop made exact and resumable (in-process at one rank; 4 -> 2 -> 3 ranks)."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slurm_elastic.errors import ElasticError
from slurm_elastic import jobfiles as protocol
from slurm_elastic.train import ElasticLoop
from slurm_elastic.train.environment import JobEnvironment
from slurm_elastic.train.sampler import ElasticSampler

from .launch import start_ranks, wait_ranks

TUTORIAL = Path(__file__).resolve().parent / "tutorial"
N = 10


def _single() -> JobEnvironment:
    return JobEnvironment.from_env({"SLURM_JOB_ID": "91"})


def _objects(lr: float = 1.0, batch_size: int = 2) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    model = nn.Linear(1, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.arange(N, dtype=torch.float64).unsqueeze(1)
    data = TensorDataset(x, torch.arange(N))
    return model, optimizer, DataLoader(data, batch_size=batch_size, shuffle=True)


def _loop(tmp_path: Path, **kw) -> ElasticLoop:
    return ElasticLoop(global_batch=4, ckpt_dir=str(tmp_path / "ck"), env=_single(), fast_exit=False, **kw)


def test_epochs_see_every_sample_once_and_accumulate_to_the_global_mean(tmp_path: Path) -> None:
    loop = _loop(tmp_path)
    model, optimizer, loader = _objects()
    w0 = [p.detach().clone() for p in model.parameters()]
    ddp, optimizer, loader = loop.prepare(model, optimizer, loader)
    assert loop.accumulation == 2 and isinstance(ddp, nn.parallel.DistributedDataParallel)
    seen: list[int] = []
    after_step_0: list[torch.Tensor] = []
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        for x, idx in loader:
            optimizer.zero_grad()          # per batch, as the tutorial does: must not drop micro-batch 0
            loss = (ddp(x).squeeze(1) - 1.0).pow(2).mean()
            loss.backward()
            optimizer.step()
            seen += idx.tolist()
            if loop.step == 1 and not after_step_0:
                after_step_0 = [p.detach().clone() for p in model.parameters()]
    loop.close()
    # Epoch boundaries 10 and 20 fall inside steps (global batch 4): epoch e iterates the steps
    # that start in it, so 3 epochs ran steps 0..7 = the first 32 samples of the stream.
    assert loop.step == 8
    assert seen == ElasticSampler(N, seed=0).indices(0, 32)
    for e in range(3):
        assert sorted(seen[e * N:(e + 1) * N]) == list(range(N))
    # Step 0's update (SGD, lr 1) is the mean gradient over its 4 samples, though they came
    # in 2 micro-batches with zero_grad() before each.
    ref = nn.Linear(1, 1).double()
    with torch.no_grad():
        for p, w in zip(ref.parameters(), w0):
            p.copy_(w)
    x = torch.tensor(seen[:4], dtype=torch.float64).unsqueeze(1)
    (ref(x).squeeze(1) - 1.0).pow(2).mean().backward()
    for got, w, p in zip(after_step_0, w0, ref.parameters()):
        assert torch.allclose(got, w - p.grad, rtol=0, atol=1e-12), (got, w - p.grad)


def test_a_signalled_stop_resumes_where_it_stopped_and_done_epochs_yield_nothing(tmp_path: Path) -> None:
    by_step: dict[int, list[int]] = {}

    def run(signal_after: int | None) -> tuple[int, list[int]]:
        loop = _loop(tmp_path)
        model, optimizer, loader = _objects()
        ddp, optimizer, loader = loop.prepare(model, optimizer, loader)
        start, lengths, fresh = loop.step, [], set()
        try:
            for epoch in range(3):
                loader.sampler.set_epoch(epoch)
                lengths.append(len(loader))
                for x, idx in loader:
                    if loop.step not in fresh:          # a step redone after the restart replaces the old one
                        fresh.add(loop.step)
                        by_step[loop.step] = []
                    by_step[loop.step] += idx.tolist()
                    ddp(x).squeeze(1).pow(2).mean().backward()
                    optimizer.step()
                    if loop.step == signal_after:
                        os.kill(os.getpid(), signal.SIGUSR2)
        except SystemExit as exc:
            assert exc.code == protocol.REQUEUE_EXIT_CODE
            return -1, lengths
        loop.close()
        return start, lengths

    assert run(signal_after=4)[0] == -1
    ack = _json(protocol.ack_path(str(tmp_path / "ck"), "91", "91", 0))
    # Seen at the boundary after step 5; step 6's micro-batches were the checkpoint pass.
    assert ack["committed"] and ack["step"] == 5
    start, lengths = run(signal_after=None)
    assert start == 5
    assert lengths == [0, 0, 6]          # epochs 0 (steps 0-2) and 1 (3-4) are done: nothing to yield
    assert sorted(by_step) == list(range(8))
    assert [i for s in sorted(by_step) for i in by_step[s]] == ElasticSampler(N, seed=0).indices(0, 32)


def test_every_start_says_where_it_resumed_from_and_why_whatever_logging_says(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def start(restart: int, signal_after: int | None) -> ElasticLoop:
        env = JobEnvironment.from_env({"SLURM_JOB_ID": "91", "SLURM_RESTART_COUNT": str(restart)})
        loop = ElasticLoop(global_batch=4, ckpt_dir=str(tmp_path / "ck"), env=env, fast_exit=False)
        model, optimizer, loader = _objects()
        ddp, optimizer, loader = loop.prepare(model, optimizer, loader)
        try:
            for epoch in range(3):
                loader.sampler.set_epoch(epoch)
                for x, _ in loader:
                    ddp(x).squeeze(1).pow(2).mean().backward()
                    optimizer.step()
                    if loop.step == signal_after:
                        os.kill(os.getpid(), signal.SIGUSR2)
        except SystemExit as exc:
            assert exc.code == protocol.REQUEUE_EXIT_CODE
            return loop
        loop.close()
        return loop

    logging.disable(logging.CRITICAL)        # a script that silences logging still gets the line
    try:
        start(0, signal_after=4)
        first = capsys.readouterr().err
        loop = start(1, signal_after=None)
        second = capsys.readouterr().err
    finally:
        logging.disable(logging.NOTSET)
    job_dir = tmp_path / "ck" / "91"
    assert [ln for ln in first.splitlines() if ln.startswith("slurm-elastic:")] == [
        f"slurm-elastic: started at step 0 (epoch 0): no checkpoint in {job_dir}"]
    assert [ln for ln in second.splitlines() if ln.startswith("slurm-elastic:")] == [
        f"slurm-elastic: resumed at step 5 (epoch 2) from {job_dir / protocol.step_dir_name(5)} after a signalled "
        "stop: a resize by the controller, a time limit or a preemption (checkpoint acknowledged)"]
    assert loop.step == 8


def test_optimizer_step_after_every_batch_is_required(tmp_path: Path) -> None:
    loop = _loop(tmp_path)
    ddp, optimizer, loader = loop.prepare(*_objects())
    it = iter(loader)
    x, _ = next(it)
    ddp(x).sum().backward()
    optimizer.step()
    next(it)
    with pytest.raises(ElasticError, match="call optimizer.step\\(\\) after every batch"):
        next(it)              # step 0 (2 micro-batches) never finished
    with pytest.raises(ElasticError, match="once per batch"):
        loop._stepped_current = True
        optimizer.step()
    loop.close()


def test_skipping_ahead_and_unknown_objects_are_refused(tmp_path: Path) -> None:
    loop = _loop(tmp_path)
    with pytest.raises(ElasticError, match="does not know what to do with a str"):
        loop.prepare(*_objects(), "lr=0.1")
    loop2 = _loop(tmp_path / "b")
    ddp, optimizer, loader = loop2.prepare(*_objects())
    loader.sampler.set_epoch(2)
    with pytest.raises(ElasticError, match="asks for epoch 2 but the data position \\(step 0\\) is in epoch 0"):
        iter(loader).__next__()
    loop2.close()


def test_a_global_batch_that_is_no_multiple_of_the_micro_batch_is_one_clear_error(tmp_path: Path) -> None:
    loop = ElasticLoop(global_batch=6, ckpt_dir=str(tmp_path / "ck"), env=_single(), fast_exit=False)
    with pytest.raises(ElasticError, match="global batch 6 is not a multiple of the micro batch 4"):
        loop.prepare(*_objects(batch_size=4))


def test_scheduler_steps_per_optimizer_step_or_per_epoch_and_mismatch_is_an_error(tmp_path: Path) -> None:
    for interval, calls_per_epoch, want_steps in (("step", "batch", 8), ("epoch", "epoch", 3)):
        loop = _loop(tmp_path / interval, scheduler_interval=interval)
        model, optimizer, loader = _objects()
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1.0 / (1 + n))
        ddp, optimizer, loader, sched = loop.prepare(model, optimizer, loader, sched)
        for epoch in range(3):
            for x, _ in loader:
                ddp(x).sum().backward()
                optimizer.step()
                if calls_per_epoch == "batch":
                    sched.step()
            if calls_per_epoch == "epoch":
                sched.step()
        loop.close()
        assert sched.last_epoch == want_steps, interval
        assert math.isclose(optimizer.param_groups[0]["lr"], 1.0 / (1 + want_steps))

    loop = _loop(tmp_path / "mismatch")
    model, optimizer, loader = _objects()
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    ddp, optimizer, loader, sched = loop.prepare(model, optimizer, loader, sched)
    with pytest.raises(ElasticError, match="scheduler_interval='epoch'"):
        for epoch in range(2):
            for x, _ in loader:
                ddp(x).sum().backward()
                optimizer.step()
            sched.step()
    loop.close()


# -- the tutorial script, as separate ranks ----------------------------------------------------------
def _tutorial_env(tmp: Path) -> dict[str, str]:
    return {"SLURM_ELASTIC_CKPT_DIR": str(tmp / "ck"), "PYTHONPATH": str(TUTORIAL)}


def _run_tutorial(tmp: Path, world: int, restart: int, *, signal_on: str | None, epochs: int = 3) -> list[str]:
    """Start the elastic tutorial as `world` ranks; with signal_on, SIGUSR2 them when rank 0 prints it."""
    snap = tmp / "snapshot.pt"
    procs = start_ranks("multigpu_elastic", [str(epochs), "1", "--snapshot_path", str(snap)], world_size=world,
                        job_id="313", restart_count=restart, extra_env=_tutorial_env(tmp))
    head: list[str] = []
    if signal_on is not None:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            head.append(line)
            if signal_on in line:
                for p in procs:
                    p.send_signal(signal.SIGUSR2)
                break
    results = wait_ranks(procs, timeout=600)
    outs = ["".join(head) + r.stdout if i == 0 else r.stdout for i, r in enumerate(results)]
    want = 0 if signal_on is None else protocol.REQUEUE_EXIT_CODE
    for r, out in zip(results, outs):
        assert r.returncode == want, out[-4000:]
    return outs


def _final_params(tmp: Path) -> list[float]:
    snap = torch.load(tmp / "snapshot.pt", weights_only=True)
    assert snap["EPOCHS_RUN"] == 3
    return [float(v) for k in sorted(snap["MODEL_STATE"]) for v in snap["MODEL_STATE"][k].flatten()]


def test_tutorial_diff_is_at_most_ten_lines() -> None:
    """Counted as for upstream's files (tests/train/upstream_edits.py): an edited line counts once."""
    from .upstream_edits import lines_touched

    before, after = (TUTORIAL / "multigpu_torchrun.py").read_text(), (TUTORIAL / "multigpu_elastic.py").read_text()
    assert 0 < lines_touched(before, after) <= 10


def test_tutorial_resumes_exactly_across_4_2_3_ranks(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    _run_tutorial(straight, 4, 0, signal_on=None)

    elastic = tmp_path / "elastic"
    outs = _run_tutorial(elastic, 4, 0, signal_on="[RANK0] Epoch 0")
    ack0 = protocol.ack_path(str(elastic / "ck"), "313", "313", 0)
    first = _json(ack0)
    # Rank output printed before the exit reaches the pipe (os._exit would drop a block buffer).
    for rank, out in enumerate(outs):
        assert f"[RANK{rank}] Epoch 0 | Batchsize: 4 | Steps: 114" in out, out[-2000:]
    outs = _run_tutorial(elastic, 2, 1, signal_on="Steps: ")
    assert _resumes_at(first["step"], world=2) in outs[0], outs[0][-3000:]      # 0 steps lost
    second = _json(protocol.ack_path(str(elastic / "ck"), "313", "313", 1))
    outs = _run_tutorial(elastic, 3, 2, signal_on=None)
    assert _resumes_at(second["step"], world=3) in outs[0], outs[0][-3000:]
    assert first["committed"] and second["committed"] and first["step"] < second["step"]
    assert first["world_size"] == 4 and second["world_size"] == 2

    a, b = _final_params(straight), _final_params(elastic)
    worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b) if abs(x) > 1e-8)
    assert worst <= 1e-9, worst


def test_the_original_tutorial_runs_as_written_under_torchrun_variables(tmp_path: Path) -> None:
    from .launch import free_port

    port, procs = free_port(), []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(TUTORIAL / "multigpu_torchrun.py"), "1", "1",
                                       "--snapshot_path", str(tmp_path / "snapshot.pt")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = wait_ranks(procs, timeout=600)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:]
    # DistributedSampler: 1797 samples over 2 ranks, 4 per batch
    assert "[RANK0] Epoch 0 | Batchsize: 4 | Steps: 225" in results[0].stdout, results[0].stdout[-2000:]
    assert torch.load(tmp_path / "snapshot.pt", weights_only=True)["EPOCHS_RUN"] == 1


def _output_until(proc: subprocess.Popen, text: str) -> list[str]:
    """The process's output lines up to and including the first that holds `text` (the rest stays unread)."""
    assert proc.stdout is not None
    head = []
    for line in proc.stdout:
        head.append(line)
        if text in line:
            break
    return head


def test_a_lost_rank_ends_the_others_with_86_and_their_output_is_kept(tmp_path: Path) -> None:
    procs = start_ranks("multigpu_elastic", ["50", "1", "--snapshot_path", str(tmp_path / "snapshot.pt")],
                        world_size=3, job_id="314",
                        extra_env={**_tutorial_env(tmp_path), "TUTORIAL_BATCH_DELAY": "0.05"})
    head = _output_until(procs[0], "[RANK0] Epoch 0")
    procs[2].kill()
    results = wait_ranks(procs, timeout=600)
    outs = ["".join(head) + results[0].stdout, results[1].stdout]
    for rank, (r, out) in enumerate(zip(results[:2], outs)):
        assert r.returncode == protocol.PEER_LOST_EXIT_CODE, out[-3000:]
        assert f"[RANK{rank}] Epoch 0 | Batchsize: 4 | Steps: " in out, out[-3000:]


def test_fsdp2_through_the_loop_matches_ddp_at_another_world_size(tmp_path: Path) -> None:
    final = {}
    for mode, world in (("ddp", 2), ("fsdp", 3)):
        out = tmp_path / f"{mode}.json"
        for r in wait_ranks(start_ranks("loop_fsdp", [str(out), mode], world_size=world, job_id=f"40{world}",
                                        extra_env=_tutorial_env(tmp_path / mode)), timeout=600):
            assert r.returncode == 0, r.stdout[-3000:]
        final[mode] = _json(str(out))
    assert final["ddp"]["step"] == final["fsdp"]["step"] == 38
    a, b = (sum((final[m]["params"][k] for k in sorted(final[m]["params"])), []) for m in ("ddp", "fsdp"))
    assert len(a) == len(b)
    assert max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b) if abs(x) > 1e-8) <= 1e-9


def _resumes_at(step: int, *, world: int) -> str:
    """The tutorial's own epoch line when its loader continues at `step`: the rest of that epoch's batches."""
    digits, global_batch, micro = 1797, 48, 4
    epoch = step * global_batch // digits
    end = -(-(epoch + 1) * digits // global_batch)
    return f"[RANK0] Epoch {epoch} | Batchsize: {micro} | Steps: {(end - step) * global_batch // micro // world}\n"


def _json(path: str) -> dict:
    import json

    return json.loads(Path(path).read_text())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_loop_that_counts_epochs_from_1_resumes_on_the_same_data(tmp_path: Path) -> None:
    """minGPT's trainer does `epoch += 1` before set_epoch: its first epoch is 1, before and after a restart."""
    by_step: dict[int, list[int]] = {}

    def run(signal_after: int | None) -> tuple[int, list[int], int]:
        loop = _loop(tmp_path)
        model, optimizer, loader = _objects()
        ddp, optimizer, loader = loop.prepare(model, optimizer, loader)
        start, lengths, fresh, announced = loop.step, [], set(), loop.epoch
        try:
            for epoch in range(0, 3):
                epoch += 1
                loader.sampler.set_epoch(epoch)
                lengths.append(len(loader))
                for x, idx in loader:
                    if loop.step not in fresh:
                        fresh.add(loop.step)
                        by_step[loop.step] = []
                    by_step[loop.step] += idx.tolist()
                    ddp(x).squeeze(1).pow(2).mean().backward()
                    optimizer.step()
                    if loop.step == signal_after:
                        os.kill(os.getpid(), signal.SIGUSR2)
        except SystemExit as exc:
            assert exc.code == protocol.REQUEUE_EXIT_CODE
            return -1, lengths, announced
        loop.close()
        return start, lengths, announced

    first = run(signal_after=4)
    assert first[0] == -1 and first[1] == [6, 4, 6]   # at step 0, set_epoch(1) was the data's first epoch
    start, lengths, announced = run(signal_after=None)
    assert start == 5 and announced == 3              # data epoch 2, numbered as the loop numbers it
    assert lengths == [0, 0, 6]
    assert [i for s in sorted(by_step) for i in by_step[s]] == ElasticSampler(N, seed=0).indices(0, 32)


def test_clipping_a_micro_batch_waits_for_the_whole_steps_gradient(tmp_path: Path) -> None:
    """A script that clips after every backward (minGPT) clips the step's gradient, as at one micro-batch."""
    updates = {}
    for micro in (4, 2):
        loop = ElasticLoop(global_batch=4, ckpt_dir=str(tmp_path / f"ck{micro}"), env=_single(), fast_exit=False)
        model, optimizer, loader = _objects(batch_size=micro)
        ddp, optimizer, loader = loop.prepare(model, optimizer, loader)
        w0 = [p.detach().clone() for p in model.parameters()]
        norms = []
        for x, _ in loader:
            optimizer.zero_grad()
            (ddp(x).squeeze(1) - 100.0).pow(2).mean().backward()      # far from the target: a large gradient
            norms.append(float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)))
            optimizer.step()
            if loop.step == 1:
                break
        loop.close()
        updates[micro] = [p.detach() - w for p, w in zip(model.parameters(), w0)]
        assert torch.nn.utils.clip_grad_norm_.__name__ == "clip_grad_norm_" and loop.accumulation == 4 // micro
        assert all(n > 0.5 for n in norms)                       # the norm is still measured and returned
    for a, b in zip(updates[4], updates[2]):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (a, b)


def test_under_the_regroup_runner_the_survivors_of_a_lost_rank_finish_in_their_processes(tmp_path: Path) -> None:
    """The tutorial as its author wrote it (no `with`, the peer loss uncaught in its backward): the error
    reaches ElasticLoop's excepthook, whose session answers with Regroup; the runner (train/regroup.py)
    runs the script again in the same process at 2 ranks, and both finish the run."""
    procs = start_ranks("slurm_elastic.train.regroup", ["-m", "multigpu_elastic", "2", "1", "--snapshot_path",
                                                          str(tmp_path / "snapshot.pt")],
                        world_size=3, job_id="315",
                        extra_env={**_tutorial_env(tmp_path), "TUTORIAL_BATCH_DELAY": "0.05"})
    head = _output_until(procs[0], "[RANK0] Epoch 0")
    time.sleep(1.0)
    procs[2].kill()
    results = wait_ranks(procs, timeout=600)
    outs = ["".join(head) + results[0].stdout, results[1].stdout]
    if all(r.returncode == 86 and "not every survivor can go on in its process" in out
           for r, out in zip(results[:2], outs)):
        # The designed fallback when a survivor's training thread is not back within the regroup deadline
        # (liveness timeout + 2 s): seen once in CI with four test workers and two other Slurms on two cores.
        # Both committed and exit for the relaunch together; the kept path itself is asserted by
        # tests/train/test_regroup.py and the live tests.
        from slurm_elastic import jobfiles

        reports = [jobfiles.PeerLostReport.parse(p.read_bytes())
                   for p in (tmp_path / "ck" / "315").glob("peer-lost-315-0-*.json")]
        assert [r.commit for r in reports] == ["done"], (reports, outs[0][-3000:])
        return
    for rank, (r, out) in enumerate(zip(results[:2], outs)):
        assert r.returncode == 0, out[-3000:]
        assert f"rank {rank} goes on as rank {rank} of 2" in out, out[-3000:]
        assert f"[RANK{rank}] Epoch 1 | Batchsize: 4 | Steps: " in out, out[-3000:]    # the run's last epoch
