"""Checkpoint crash consistency: SIGKILL at random points, bit flips and truncation, a full filesystem, shared roots.

The unit tests in tests/train/ check each safeguard once; these inject the
faults many times at random, seeded points (the seed is printed and recorded;
set SLURM_ELASTIC_RELIABILITY_SEED to replay a run).
"""

from __future__ import annotations

import collections
import json
import logging
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_elastic.errors import CheckpointError
from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.store import CheckpointStore

from . import ckpt_writer

SEED_ENV = "SLURM_ELASTIC_RELIABILITY_SEED"
JOB = "77"


def _base_seed() -> int:
    seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(1 << 31))
    print(f"reliability seed: {seed} (replay with {SEED_ENV}={seed})")
    return seed


@pytest.fixture(scope="module")
def writer_context() -> multiprocessing.context.BaseContext:
    # A fork server that has imported torch once: each writer starts in milliseconds,
    # from a process that never ran a torch thread pool (fork of the test process could).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "slurm_elastic.train.session", ckpt_writer.__name__])
    return ctx


def _trace_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    text = path.read_text()
    # A SIGKILL cannot tear a short O_APPEND write, but be strict anyway: only whole lines count.
    return text.split("\n")[:-1]


def _check_store(store: CheckpointStore, committed_max: int | None, seed: int) -> int | None:
    """The invariants after a crash; returns the step a restore would use."""
    found = store.newest_complete(model_fingerprint=None)
    if committed_max is not None:
        assert found is not None, f"seed {seed}: step {committed_max} was committed but nothing restores"
        assert found.step >= committed_max, f"seed {seed}: committed step {committed_max} lost (restore {found.step})"
    for step in store.committed_steps():
        # A step with a manifest is complete: every file present with its checksum (no partial commit).
        store.verify(step)
    latest = store.latest_pointer()
    if latest is not None:
        assert latest in store.committed_steps(), f"seed {seed}: LATEST names step {latest}, which is not committed"
    return None if found is None else found.step


def _phase(line: str) -> str:
    kind = line.split(" ", 1)[0]
    return {"restored": "training (first step)", "write-begin": "writing a shard",
            "write-end": "between shards", "commit-begin": "committing (manifest, LATEST, retention)",
            "committed": "training", "discard": "discarding"}.get(kind, kind)


def test_sigkill_at_random_points_never_loses_a_committed_step(tmp_path: Path, writer_context: Any,
                                                               long_run: bool, figures: Any) -> None:
    kills = 200 if long_run else 20
    base = _base_seed()
    root = tmp_path / "ckpt"
    store = CheckpointStore(str(root / JOB), keep=1)
    committed_max: int | None = None
    expect_restore: int | None = None
    phases: collections.Counter[str] = collections.Counter()
    restores_valid = 0
    for i in range(kills):
        seed = base + i
        delay = random.Random(seed).uniform(0.0, 1.5)
        trace = tmp_path / f"trace-{i}"
        proc = writer_context.Process(target=ckpt_writer.train_forever, args=(str(root), JOB, str(trace), 1))
        proc.start()
        deadline = time.monotonic() + 120
        while not any(line.startswith("restored") for line in _trace_lines(trace)):
            assert proc.is_alive() or proc.exitcode is None, f"seed {seed}: writer died ({proc.exitcode})"
            assert time.monotonic() < deadline, f"seed {seed}: writer never started"
            time.sleep(0.01)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL, f"seed {seed}: writer ended on its own ({proc.exitcode})"
        lines = _trace_lines(trace)
        restored = lines[0].split()[1]
        assert restored == str(expect_restore), f"seed {seed}: restored {restored}, newest complete {expect_restore}"
        phases[_phase(lines[-1])] += 1
        for line in lines:
            if line.startswith("committed "):
                step = int(line.split()[1])
                committed_max = step if committed_max is None else max(committed_max, step)
        expect_restore = _check_store(store, committed_max, seed)
        restores_valid += 1
    # Temp files outside a step still being written: only the last kill's can be left (the next commit collects it).
    settled = [root / JOB] + [Path(store.step_path(s)) for s in store.committed_steps()]
    leftovers = [p.name for d in settled for p in d.glob("*.tmp-*")]
    step_dirs = [p.name for p in (root / JOB).iterdir() if p.name.startswith(protocol.STEP_DIR_PREFIX)]
    figures.put(kill_points=kills, restores_valid=restores_valid, committed_steps_lost=0,
                last_committed_step=committed_max, seed=base, kill_phase=dict(phases),
                temp_files_left=len(leftovers), step_dirs_left=len(step_dirs))
    assert committed_max is not None and committed_max > 0, "no checkpoint was ever committed: kills came too early"
    # Crashed writes leave no garbage behind once a newer step is committed (one in flight may remain).
    assert len(step_dirs) <= 3, step_dirs
    assert len(leftovers) <= 2, leftovers  # a LATEST temp and one shard temp of the last kill at most


def _commit(store: CheckpointStore, step: int, files: int = 3) -> None:
    store.begin_step(step)
    recs = []
    for f in range(files):
        t = torch.arange(257 * (f + 1), dtype=torch.float32) + step
        recs.append(store.write_tensors(step, f"group-{f:05d}.safetensors", {"w": t, "b": t[:7].clone()}, rank=0))
    store.commit(step, {"samples_consumed": step * 8, "world_size": 1, "global_batch": 8,
                        "model_fingerprint": "fp", "files": [r.to_json() for r in recs]})


def test_random_bit_flips_and_truncations_are_detected(tmp_path: Path, long_run: bool, figures: Any) -> None:
    trials = 400 if long_run else 60
    base = _base_seed()
    store = CheckpointStore(str(tmp_path / "job"), keep=3)
    store.ensure_job_dir()
    _commit(store, 1)
    _commit(store, 2)
    step2 = tmp_path / "job" / protocol.step_dir_name(2)
    pristine = {p.name: p.read_bytes() for p in step2.iterdir()}
    kinds: collections.Counter[str] = collections.Counter()
    for i in range(trials):
        rng = random.Random(base + i)
        name = rng.choice(sorted(n for n in pristine if n.endswith(".safetensors")))
        data = bytearray(pristine[name])
        kind = rng.choice(["flip", "flip-header", "truncate", "extend", "zero-fill"])
        if kind == "flip":
            pos = rng.randrange(len(data))
            data[pos] ^= 1 << rng.randrange(8)
        elif kind == "flip-header":
            pos = rng.randrange(min(len(data), 8 + int.from_bytes(data[:8], "little")))
            data[pos] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            data = data[:rng.randrange(len(data))]
        elif kind == "extend":
            data += bytes(rng.randrange(1, 64))
        else:
            start = rng.randrange(len(data))
            nonzero = any(data[start:start + 64])
            data[start:start + 64] = bytes(len(data[start:start + 64]))
            if not nonzero:
                data[start] = 1  # make sure the bytes change
        (step2 / name).write_bytes(bytes(data))
        kinds[kind] += 1
        found = store.newest_complete(model_fingerprint="fp")
        assert found is not None and found.step == 1, f"seed {base + i}: {kind} in {name} not detected"
        with pytest.raises(CheckpointError):
            store.verify(2)
        (step2 / name).write_bytes(pristine[name])
    assert store.newest_complete(model_fingerprint="fp").step == 2  # type: ignore[union-attr]
    figures.put(damaged_shards=trials, detected=trials, fell_back_to_previous=trials, seed=base, kinds=dict(kinds))


@pytest.fixture
def small_fs(tmp_path: Path) -> Any:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0755", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path, leave: int) -> None:
    """Fill the filesystem of `path` until about `leave` bytes are free."""
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    with open(path, "wb") as f:
        f.write(b"\xab" * max(free - leave, 0))


def test_full_filesystem_during_writes_keeps_training_and_the_previous_step(
        small_fs: Path, long_run: bool, figures: Any, caplog: pytest.LogCaptureFixture) -> None:
    rounds = 20 if long_run else 4
    base = _base_seed()
    root = small_fs / "ckpt"
    filler = small_fs / "filler"
    store = CheckpointStore(str(root / JOB), keep=1)
    last = ckpt_writer.train_forever(str(root), JOB, None, 1, steps=2)
    assert last == 2
    steps, failures = 2, 0
    for i in range(rounds):
        rng = random.Random(base + i)
        _fill(filler, rng.randrange(0, 400_000))
        before = store.newest_complete(model_fingerprint=None)
        assert before is not None
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            steps += 3
            committed = ckpt_writer.train_forever(str(root), JOB, None, 1, steps=steps)
        # Training went on to the target step whatever the disk did ...
        after = store.newest_complete(model_fingerprint=None)
        assert after is not None and after.step >= before.step, f"seed {base + i}: lost step {before.step}"
        if committed < steps:
            failures += 1
            # ... the failure was logged, and the previous complete step is what a restore finds.
            assert any("not committed" in r.getMessage() or "failed" in r.getMessage() for r in caplog.records), \
                f"seed {base + i}: a checkpoint failed silently"
        store.verify(after.step)
        filler.unlink()
        steps = max(steps, after.step)
    final = ckpt_writer.train_forever(str(root), JOB, None, 1, steps=steps + 2)
    assert final == steps + 2, "after space came back, checkpoints commit again"
    leftovers = [p.name for p in root.rglob("*.tmp-*")]
    figures.put(rounds=rounds, rounds_with_failed_writes=failures, previous_step_intact=rounds,
                temp_files_left=len(leftovers), seed=base)
    assert failures > 0, "the filesystem never filled up: the test did not test anything"


def test_a_filesystem_with_no_byte_free_at_start_keeps_training(small_fs: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The fixed case of the seeded one above (seed 177710381 left ~0 bytes): a restart on a full disk
    cannot write even its geometry file; it trains on from the last complete step, says so, commits nothing."""
    root, filler = small_fs / "ckpt", small_fs / "filler"
    assert ckpt_writer.train_forever(str(root), JOB, None, 1, steps=2) == 2
    _fill(filler, 0)
    with caplog.at_level(logging.ERROR):
        committed = ckpt_writer.train_forever(str(root), JOB, None, 1, steps=5)
    assert committed == 2, "nothing could be written: the last complete step stays 2"
    assert any("geometry.json not written" in r.getMessage() for r in caplog.records), caplog.text
    filler.unlink()
    assert ckpt_writer.train_forever(str(root), JOB, None, 1, steps=7) == 7


def test_two_jobs_with_the_same_name_and_root_never_mix(tmp_path: Path, writer_context: Any, figures: Any) -> None:
    root = tmp_path / "ckpt"
    procs = []
    for job in ("101", "102"):
        p = writer_context.Process(target=ckpt_writer.train_forever,
                                   args=(str(root), job, str(tmp_path / f"trace-{job}"), 2, "same-name", 12))
        p.start()
        procs.append(p)
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    manifests = 0
    for job in ("101", "102"):
        store = CheckpointStore(str(root / job))
        found = store.newest_complete(model_fingerprint=None)
        assert found is not None and found.step == 12
        for step in store.committed_steps():
            manifest = store.verify(step)
            manifests += 1
            assert manifest["job"]["id"] == job and manifest["job"]["key"] == job
            assert {p.name for p in Path(store.step_path(step)).iterdir()} == \
                {r["name"] for r in manifest["files"]} | {protocol.MANIFEST_FILE}
    a = CheckpointStore(str(root / "101"))
    b = CheckpointStore(str(root / "102"))
    ta = dict(a.iter_tensors(a.newest_complete()))  # type: ignore[arg-type]
    tb = dict(b.iter_tensors(b.newest_complete()))  # type: ignore[arg-type]
    assert ta.keys() == tb.keys() and any(not torch.equal(ta[k], tb[k]) for k in ta), "the two jobs' states mixed"
    figures.put(jobs=2, job_name="same-name", manifests_checked=manifests, foreign_files_found=0)
