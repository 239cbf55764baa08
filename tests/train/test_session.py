"""ElasticSession in one process: signal path, restore, fallback, full disk, batch geometry."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from slurm_elastic.errors import CheckpointError, ElasticError
from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.environment import JobEnvironment
from slurm_elastic.train.session import ElasticSession

from .launch import run_ranks

ENV = JobEnvironment(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1,
                     master_addr="127.0.0.1", master_port=1, job_id="55", job_name="t", restart_count=0,
                     launcher="single")
X = torch.randn(64, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
Y = X.sum(1, keepdim=True)


def _model(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 1)).double()


def _train(root: Path, steps: int, *, signal_at: int | None = None, every: int | None = None, width: int = 16,
           restart: int = 0, micro: int = 4, signum: int = signal.SIGUSR2) -> tuple[ElasticSession, nn.Module, list[float]]:
    env = JobEnvironment(**{**{f: getattr(ENV, f) for f in ENV.__slots__}, "restart_count": restart})
    losses: list[float] = []
    model = _model(width)
    with ElasticSession(ckpt_dir=str(root), env=env, every_steps=every, metrics_every_s=0.0,
                        wait_for_previous=True, fast_exit=False) as s:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        s.attach(model, opt, global_batch=16, micro_batch=micro, dataset_size=len(X), group_bytes=1)
        while not s.done(steps):
            total = 0.0
            for idx in s.micro_batches():
                loss = (model(X[idx]) - Y[idx]).pow(2).sum()
                (loss / 16).backward()
                total += float(loss.detach())
            s.optimizer_step()
            losses.append(total / 16)
            if signal_at is not None and s.step == signal_at:
                os.kill(os.getpid(), signum)
    return s, model, losses


def test_signal_commits_acknowledges_and_exits_85_with_no_step_lost(tmp_path: Path) -> None:
    _, ref_model, ref = _train(tmp_path / "a", 10)
    with pytest.raises(SystemExit) as info:
        _train(tmp_path / "b", 10, signal_at=4)
    assert info.value.code == protocol.REQUEUE_EXIT_CODE
    job = tmp_path / "b" / "55"
    ack = json.loads((job / protocol.ack_file_name("55", 0)).read_text())
    # the handler ran after step 4's agreement, so step 5 completed; its checkpoint pass is step 6's forward
    assert ack["step"] == 5 and ack["committed"] is True
    manifest = json.loads((job / protocol.step_dir_name(5) / protocol.MANIFEST_FILE).read_text())
    assert manifest["step"] == 5 and manifest["samples_consumed"] == 80
    s, model, tail = _train(tmp_path / "b", 10, restart=1)
    assert s.restored_step == 5
    assert tail == pytest.approx(ref[5:], rel=1e-12)
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_sigterm_commits_like_the_checkpoint_signal_and_the_old_handler_is_back(tmp_path: Path) -> None:
    """Slurm's SIGTERM (a preemption's GraceTime on 22.05, scancel) ends the loop with a commit, not a kill."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        _train(tmp_path, 10, signal_at=4, signum=signal.SIGTERM)
    assert info.value.code == protocol.REQUEUE_EXIT_CODE
    ack = json.loads((tmp_path / "55" / protocol.ack_file_name("55", 0)).read_text())
    assert ack["step"] == 5 and ack["committed"] is True
    assert signal.getsignal(signal.SIGTERM) == before


def test_periodic_checkpoints_and_retention(tmp_path: Path) -> None:
    _train(tmp_path, 12, every=3)
    job = tmp_path / "55"
    # periodic snapshots at 3, 6, 9, 12; the one armed at 12 is committed when the session closes
    assert sorted(p.name for p in job.glob("step-*")) == [protocol.step_dir_name(9), protocol.step_dir_name(12)]
    assert (job / protocol.LATEST_FILE).read_text().strip() == protocol.step_dir_name(12)


def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path: Path) -> None:
    _train(tmp_path, 12, every=3)
    job = tmp_path / "55"
    victim = sorted((job / protocol.step_dir_name(12)).glob("*.safetensors"))[0]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0x40          # same size: found only by the sha256 check while loading
    victim.write_bytes(bytes(raw))
    s, _, _ = _train(tmp_path, 12)
    assert s.restored_step == 9


def test_checkpoint_of_a_different_model_is_refused(tmp_path: Path) -> None:
    _train(tmp_path, 3, every=3)
    with pytest.raises(CheckpointError, match="different model"):
        _train(tmp_path, 6, width=32)


@pytest.fixture
def tiny_fs(tmp_path: Path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    # A real full filesystem: a 96 KiB tmpfs (root only; skipped elsewhere).
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_keeps_training_and_previous_checkpoint(tiny_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    # width 160: about 30 KiB of parameters + 30 KiB of momentum per checkpoint, so
    # one fits in 96 KiB and a second one does not.
    caplog.set_level(logging.ERROR)
    _, _, ref = _train(tiny_fs.parent / "ref", 9, width=160)
    s, _, losses = _train(tiny_fs, 9, every=3, width=160)
    assert losses == pytest.approx(ref, rel=1e-12)       # training carried on unharmed
    assert any("No space left" in r.getMessage() or "not committed" in r.getMessage() for r in caplog.records)
    assert s.last_committed_step == 3
    job = tiny_fs / "55"
    assert (job / protocol.LATEST_FILE).read_text().strip() == protocol.step_dir_name(3)
    assert [p.name for p in job.glob("step-*")] == [protocol.step_dir_name(3)]
    s2, _, _ = _train(tiny_fs, 9, width=160)
    assert s2.restored_step == 3


def test_checkpoint_now_commits_the_current_step(tmp_path: Path) -> None:
    model = _model()
    with ElasticSession(ckpt_dir=str(tmp_path), env=ENV, fast_exit=False) as s:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        s.attach(model, opt, global_batch=16, micro_batch=16, dataset_size=len(X))
        for _ in range(3):
            for idx in s.micro_batches():
                (model(X[idx]) - Y[idx]).pow(2).mean().backward()
            s.optimizer_step()
        s.user_state["note"] = "kept"
        s.checkpoint_now()
        assert s.last_committed_step == 3
    manifest = json.loads((tmp_path / "55" / protocol.step_dir_name(3) / protocol.MANIFEST_FILE).read_text())
    assert manifest["user_state"] == {"note": "kept"} and manifest["optimizer"]["class"] == "SGD"
    assert manifest["optimizer"]["param_groups"][0]["lr"] == 0.05
    with ElasticSession(ckpt_dir=str(tmp_path), env=ENV, fast_exit=False) as s2:
        m2 = _model()
        assert s2.attach(m2, torch.optim.SGD(m2.parameters(), lr=0.9), global_batch=16, micro_batch=16,
                         dataset_size=len(X)) == 3
        assert s2.user_state == {"note": "kept"}
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_a_session_writes_the_chosen_checksum_and_a_default_session_restores_it(tmp_path: Path) -> None:
    model = _model()
    with ElasticSession(ckpt_dir=str(tmp_path), env=ENV, fast_exit=False, checksum="sha256") as s:
        s.attach(model, torch.optim.SGD(model.parameters(), lr=0.05), global_batch=16, micro_batch=16,
                 dataset_size=len(X))
        for idx in s.micro_batches():
            (model(X[idx]) - Y[idx]).pow(2).mean().backward()
        s.optimizer_step()
        s.checkpoint_now()
    manifest = json.loads((tmp_path / "55" / protocol.step_dir_name(1) / protocol.MANIFEST_FILE).read_text())
    assert all("sha256" in f and "xxh3_128" not in f for f in manifest["files"])
    with ElasticSession(ckpt_dir=str(tmp_path), env=ENV, fast_exit=False) as s2:
        m2 = _model()
        assert s2.attach(m2, torch.optim.SGD(m2.parameters(), lr=0.05), global_batch=16, micro_batch=16,
                         dataset_size=len(X)) == 1
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_a_whole_model_saved_or_copied_after_attach_carries_inert_hooks(tmp_path: Path) -> None:
    """`torch.save(model)` (upstream word_language_model saves its best model so, and loads it back with
    torch's default weights_only=True and its own classes allowed) and an EMA's deepcopy work once the
    session has hooked the model; the copies carry nothing of the session, the model still checkpoints."""
    import copy
    import io

    model = _model()
    with ElasticSession(ckpt_dir=str(tmp_path), env=ENV, fast_exit=False) as s:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        s.attach(model, opt, global_batch=16, micro_batch=16, dataset_size=len(X))
        for idx in s.micro_batches():
            (model(X[idx]) - Y[idx]).pow(2).mean().backward()
        s.optimizer_step()
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        with torch.serialization.safe_globals([nn.Sequential, nn.Linear, nn.Tanh]):   # the model's own classes
            loaded = torch.load(buf)
        twin = copy.deepcopy(model)
        copy.deepcopy(opt)
        for other in (loaded, twin):
            assert torch.equal(other(X[:4]), model(X[:4]))
            for a, b in zip(other.parameters(), model.parameters()):
                assert torch.equal(a, b)
        s.checkpoint_now()
        assert s.last_committed_step == 1


def test_a_loop_that_declares_its_length_tells_the_controller(tmp_path: Path) -> None:
    """ElasticSession(total_steps=N) (or session.total_steps = N once known): every metrics row carries it
    (the controller's remaining work, docs/controller.md); a length that is no positive int is refused."""
    model = _model()
    with ElasticSession(ckpt_dir=str(tmp_path), env=ENV, metrics_every_s=0.0, fast_exit=False, total_steps=5) as s:
        s.attach(model, torch.optim.SGD(model.parameters(), lr=0.05), global_batch=16, micro_batch=16,
                 dataset_size=len(X))
        while not s.done(3):
            for idx in s.micro_batches():
                (model(X[idx]) - Y[idx]).pow(2).mean().backward()
            s.optimizer_step()
        s.total_steps = 9          # known later: the next rows say so
        for idx in s.micro_batches():
            (model(X[idx]) - Y[idx]).pow(2).mean().backward()
        s.optimizer_step()
    lines = (tmp_path / "55" / protocol.METRICS_FILE).read_text().splitlines()
    assert [protocol.MetricsRow.parse_line(x).total_steps for x in lines] == [5, 5, 5, 9]
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ElasticError, match="total_steps"):
            ElasticSession(ckpt_dir=str(tmp_path / "bad"), env=ENV, total_steps=bad)


def test_a_loop_that_decides_ddp_from_rank_finds_it_and_one_whose_ranks_never_average_is_stopped(
        tmp_path: Path) -> None:
    """nanoGPT decides whether it runs distributed from RANK; the session exported it only for ElasticLoop,
    so under ElasticSession each rank trained a model of its own, and the checkpoint stitched layers of
    different models together (found converting nanoGPT by the docs alone). RANK is set now, and ranks
    that never average their gradients stop with one line saying so, even behind a warmup's zero learning
    rate at the first step."""
    env = {"SLURM_ELASTIC_CKPT_DIR": str(tmp_path / "a")}
    results = run_ranks("tests.train.rank_env_trainer", [], world_size=2, job_id="71", extra_env=env)
    for r in results:
        assert r.returncode == 0 and "ddp True RANK" in r.stdout and "trained" in r.stdout, r.stdout[-3000:]
    env = {"SLURM_ELASTIC_CKPT_DIR": str(tmp_path / "b")}
    results = run_ranks("tests.train.rank_env_trainer", ["--never-ddp", "--warmup-zero-lr"], world_size=2,
                        job_id="72", extra_env=env)
    for r in results:
        assert r.returncode != 0 and "trained" not in r.stdout, r.stdout[-3000:]
        assert "the 2 ranks hold different weights: their gradients are not averaged" in r.stdout, r.stdout[-3000:]


def test_an_amp_loop_steps_through_its_grad_scaler_and_a_step_with_inf_gradients_changes_no_weight(
        tmp_path: Path) -> None:
    """An AMP loop (nanoGPT's float16 path) steps with scaler.step(optimizer): optimizer_step(scaler) does,
    so a step whose gradients overflowed is skipped and the scale backs off, as the loop meant."""
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    with ElasticSession(ckpt_dir=str(tmp_path), env=ENV, fast_exit=False) as s:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        s.attach(model, opt, global_batch=16, micro_batch=16, dataset_size=len(X))
        for overflow in (True, False):
            before = [p.detach().clone() for p in model.parameters()]
            for idx in s.micro_batches():
                scaler.scale((model(X[idx]) - Y[idx]).pow(2).mean()).backward()
            if overflow:
                next(model.parameters()).grad[0, 0] = float("inf")
            s.optimizer_step(scaler)
            moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            assert moved is not overflow, overflow
        assert s.step == 2 and scaler.get_scale() == 2.0 ** 9
