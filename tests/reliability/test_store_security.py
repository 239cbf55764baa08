"""The checkpoint store under attack (issue 14): shared roots, two writers, hostile manifests, odd entries.

Each case is a class of the issue, not one example: a job directory another
real user prepared (directory, planted checkpoint, symbolic link), links
inside a job directory, a stale incarnation racing a newer one, hostile
manifests and safetensors headers (the restore falls back to the previous
complete step and training goes on), a regular file where a step directory
goes, a binary LATEST, a FIFO where a file goes.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import slurm_elastic
from slurm_elastic.errors import CheckpointError
from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.store import CHECKSUMS, CheckpointStore

from . import ckpt_writer

TESTS = Path(__file__).resolve().parents[1]
# Where the package under test lives (so a run against another checkout's package tests that one).
PACKAGE_ROOT = Path(slurm_elastic.__file__).resolve().parents[1]
VICTIM = "se-storesec-victim"
ATTACKER = "se-storesec-attacker"


# -- real users ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, Any]]:
    """Two real unprivileged users (the job's user and another one) who can run the training code."""
    sys.path.insert(0, str(TESTS))
    import users as user_tools  # tests/users.py

    why = user_tools.runnable_as_user()
    if why:
        pytest.skip(why)
    made = {}
    try:
        for name in (VICTIM, ATTACKER):
            made[name] = user_tools.user_python(name)
        yield made
    finally:
        for up in made.values():
            up.close()


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A site's shared checkpoint root: root-owned, mode 1777, in a directory every user can reach."""
    base = Path(tempfile.mkdtemp(prefix="se-storesec-", dir="/var/tmp"))
    os.chmod(base, 0o755)
    root = base / "scratch"
    root.mkdir()
    os.chmod(root, 0o1777)
    try:
        yield root
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _as_user(up: Any, code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    prelude = f"import sys; sys.path[:0] = [{up.seen(PACKAGE_ROOT)!r}, {up.seen(TESTS)!r}]; "
    return subprocess.run(up.argv(prelude + code), capture_output=True, text=True, cwd="/", timeout=timeout)


def _train_as(up: Any, root: Path, job: str, steps: int) -> subprocess.CompletedProcess[str]:
    return _as_user(up, "from reliability import ckpt_writer; "
                        f"print('last', ckpt_writer.train_forever({str(root)!r}, {job!r}, None, 2, steps={steps}))")


def _tree(path: Path) -> list[tuple[str, int, int]]:
    """(name, owner, mode) of everything under path (not following links)."""
    out = []
    for p in sorted(path.rglob("*")):
        st = p.lstat()
        out.append((str(p.relative_to(path)), st.st_uid, stat.S_IMODE(st.st_mode)))
    return out


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


# -- class 1: a shared root -------------------------------------------------------------------------
@pytest.mark.parametrize("prepared", ["empty-dir-0777", "planted-checkpoint", "symlink"])
def test_a_job_directory_another_user_prepared_is_refused_and_nothing_is_written(
        users: dict[str, Any], shared_root: Path, prepared: str, figures: Any) -> None:
    victim, attacker = users[VICTIM], users[ATTACKER]
    job = "4242"
    target = shared_root / job
    attacker_own = shared_root / "attacker-own"
    if prepared == "empty-dir-0777":
        proc = _as_user(attacker, f"import os; os.mkdir({str(target)!r}); os.chmod({str(target)!r}, 0o777)")
    elif prepared == "planted-checkpoint":
        # A complete checkpoint of the very same model, readable by the victim, for the victim's future job id.
        proc = _train_as(attacker, shared_root, job, 3)
        if proc.returncode == 0:
            proc = _as_user(attacker, f"import os; os.chmod({str(target)!r}, 0o755)")
    else:
        proc = _as_user(attacker, f"import os; os.mkdir({str(attacker_own)!r}); "
                                  f"os.chmod({str(attacker_own)!r}, 0o777); "
                                  f"os.symlink({str(attacker_own)!r}, {str(target)!r})")
    assert proc.returncode == 0, proc.stderr[-2000:]
    look_at = attacker_own if prepared == "symlink" else target
    before = _tree(look_at)

    ran = _train_as(victim, shared_root, job, 3)
    victim_uid = pwd.getpwnam(VICTIM).pw_uid
    after = _tree(look_at)
    figures.put(prepared=prepared, victim_exit=ran.returncode, refusal=_last_line(ran.stderr)[-300:])
    assert ran.returncode != 0, f"the victim trained in a directory {ATTACKER} prepared:\n{ran.stdout[-1500:]}"
    refusal = _last_line(ran.stderr)
    assert "UnsafeJobDir" in refusal and str(target) in refusal, ran.stderr[-3000:]
    assert ("another user prepared it" in refusal) if prepared != "symlink" else ("symbolic link" in refusal)
    assert after == before, "the victim's job wrote into the prepared directory"
    assert not [p for p in look_at.rglob("*") if p.lstat().st_uid == victim_uid]
    assert "last" not in ran.stdout, "the victim resumed from the planted checkpoint"


def test_a_root_that_anyone_may_rename_in_is_refused(users: dict[str, Any], shared_root: Path) -> None:
    os.chmod(shared_root, 0o777)    # world-writable, no sticky bit: anyone can rename the job's directory away
    ran = _train_as(users[VICTIM], shared_root, "4243", 2)
    assert ran.returncode != 0
    assert "without the sticky bit" in _last_line(ran.stderr), ran.stderr[-2000:]
    assert list(shared_root.iterdir()) == []


def test_the_victims_own_job_directory_is_private_and_its_steps_are_owner_checked(
        users: dict[str, Any], shared_root: Path) -> None:
    victim = users[VICTIM]
    ran = _train_as(victim, shared_root, "4244", 3)
    assert ran.returncode == 0 and "last 3" in ran.stdout, ran.stderr[-2000:]
    job = shared_root / "4244"
    uid = pwd.getpwnam(VICTIM).pw_uid
    assert job.stat().st_uid == uid and stat.S_IMODE(job.stat().st_mode) == 0o700
    # The attacker can neither list nor add anything.
    peek = _as_user(users[ATTACKER], f"import os; print(os.listdir({str(job)!r}))")
    assert peek.returncode != 0 and "PermissionError" in peek.stderr
    # A step directory handed to another user (as root could) is not the job's: restore notices and skips it.
    steps = sorted(p.name for p in job.glob("step-*"))    # 3 and the one before (a busy writer skips some)
    assert len(steps) == 2 and steps[-1] == protocol.step_dir_name(3), steps
    step3 = job / protocol.step_dir_name(3)
    os.chown(step3, pwd.getpwnam(ATTACKER).pw_uid, -1)
    os.chmod(step3, 0o755)           # readable, so it is the ownership check that refuses it
    check = _as_user(victim, "import logging; logging.basicConfig(); "
                             "from slurm_elastic.train.store import CheckpointStore; "
                             f"print('newest', CheckpointStore({str(job)!r}).newest_complete().step)")
    assert check.returncode == 0, check.stderr[-2000:]
    assert f"newest {protocol.parse_step_dir_name(steps[0])}" in check.stdout
    assert "belongs to" in check.stderr and ATTACKER in check.stderr, check.stderr[-2000:]
    assert f"LATEST names {protocol.step_dir_name(3)}, which is missing or damaged" in check.stderr


# -- class 1, inside the job directory: links are never followed --------------------------------------------
def _commit(store: CheckpointStore, step: int, files: int = 2) -> None:
    import torch

    store.begin_step(step)
    recs = [store.write_tensors(step, f"group-{f:05d}.safetensors", {"w": torch.full((64,), float(step + f))},
                                rank=0) for f in range(files)]
    store.commit(step, {"samples_consumed": step * 8, "world_size": 1, "global_batch": 8,
                        "model_fingerprint": "fp", "files": [r.to_json() for r in recs]})


def test_links_inside_a_job_directory_are_never_followed_read_or_deleted_through(tmp_path: Path,
                                                                               figures: Any) -> None:
    job = tmp_path / "job"
    outside = tmp_path / "outside"
    outside.mkdir()
    store = CheckpointStore(str(job), keep=5)
    store.ensure_job_dir()
    for step in (1, 2, 3):
        _commit(store, step)
    # step 3 becomes a link to a copy of itself outside the job directory; step 2's first data file a link too.
    shutil.move(str(job / protocol.step_dir_name(3)), str(outside / "step3"))
    os.symlink(outside / "step3", job / protocol.step_dir_name(3))
    data2 = job / protocol.step_dir_name(2) / "group-00000.safetensors"
    shutil.copy(data2, outside / "data2")
    data2.unlink()
    os.symlink(outside / "data2", data2)
    # a step the next writer will write goes through a link out of the root
    os.mkdir(outside / "step4")
    os.symlink(outside / "step4", job / protocol.step_dir_name(4))
    outside_before = _tree(outside)

    reader = CheckpointStore(str(job), keep=1)
    found = reader.newest_complete(model_fingerprint="fp")
    assert found is not None and found.step == 1, "a step was restored through a link"
    assert reader.candidates(model_fingerprint="fp") == [1]
    # Writing goes on: step 4 cannot be committed onto a link (and nothing is written through it); step 5 is,
    # and retention (keep=1) deletes nothing through the links.
    with pytest.raises(OSError):
        _commit(reader, 4)
    reader.discard_step(4)
    _commit(reader, 5)
    assert _tree(outside) == outside_before, "something outside the job directory was written or deleted"
    assert reader.newest_complete(model_fingerprint="fp").step == 5   # type: ignore[union-attr]
    figures.put(links_planted=3, followed=0, deleted_through_links=0)


# -- class 5: one writer per job directory -----------------------------------------------------------
def _writer_process(root: Path, job: str, restart: int, log_path: Path, steps: int = 10**9) -> subprocess.Popen:
    code = (f"import sys; sys.path[:0] = [{str(PACKAGE_ROOT)!r}, {str(TESTS)!r}]; "
            "import logging; logging.basicConfig(level=logging.WARNING); "
            "from reliability import ckpt_writer; "
            f"print('last', ckpt_writer.train_forever({str(root)!r}, {job!r}, None, 2, steps={steps}, "
            f"restart_count={restart}), flush=True)")
    return subprocess.Popen([sys.executable, "-c", code], stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            cwd="/")


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_stale_incarnation_stops_before_committing_and_deletes_nothing(tmp_path: Path, figures: Any) -> None:
    """A zombie (restart 0, still training on a 'partitioned node') and the requeued job (restart 1)."""
    root = tmp_path / "ckpt"
    job = "5150"
    store = CheckpointStore(str(root / job))
    zombie = _writer_process(root, job, 0, tmp_path / "zombie.log")
    newer = None
    try:
        _wait(lambda: len(store.committed_steps()) >= 2, 180, "the first incarnation's checkpoints")
        newer = _writer_process(root, job, 1, tmp_path / "newer.log")
        try:
            zombie.wait(180)
        except subprocess.TimeoutExpired:
            pytest.fail("the stale incarnation kept training (and committing) after the newer one took over")
        zombie_last = max(store.committed_steps())

        def newer_is_ahead() -> bool:
            assert newer.poll() is None, (tmp_path / "newer.log").read_text()[-3000:]
            steps = store.committed_steps()
            return bool(steps) and steps[0] > zombie_last + 2
        _wait(newer_is_ahead, 300, "the newer incarnation's checkpoints")
    finally:
        for proc in (zombie, newer):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
    zombie_log = (tmp_path / "zombie.log").read_text()
    newer_log = (tmp_path / "newer.log").read_text()
    figures.put(zombie_exit=zombie.returncode, zombie_last_step=zombie_last)
    assert zombie.returncode != 0 and "StaleWriter" in zombie_log and "stale" in zombie_log, zombie_log[-3000:]
    assert "Traceback" not in newer_log, newer_log[-3000:]
    # The newer incarnation's history is whole: its newest step verifies and says who wrote it.
    found = CheckpointStore(str(root / job)).newest_complete(model_fingerprint=None)
    assert found is not None and found.step > zombie_last
    assert found.manifest["job"]["restart_count"] == 1
    for step in store.committed_steps():
        store.verify(step)


def _writer_store(root: Path, job_id: str, restart: int, nonce: str, keep: int = 1) -> CheckpointStore:
    from slurm_elastic.train.incarnation import Incarnation

    return CheckpointStore(str(root), keep=keep, writer=Incarnation(job_id, restart, nonce))


def test_writer_identity_rules(tmp_path: Path) -> None:
    from slurm_elastic.train.incarnation import StaleWriter

    job = tmp_path / "job"
    old = _writer_store(job, "7", 0, "a" * 16)
    new = _writer_store(job, "7", 1, "b" * 16)
    _commit(old, 1)
    new.begin_step(2)           # the newer incarnation is writing step 2 ...
    new.claim()                 # ... and has taken over
    old.begin_step(2)
    with pytest.raises(StaleWriter, match="stale"):
        _commit(old, 2)
    with pytest.raises(StaleWriter):
        old.apply_retention()
    old.discard_step(2)         # its own directory only
    assert Path(new.writing_path(2)).is_dir(), "the stale writer removed the newer one's step in flight"
    _commit(new, 2)
    _commit(new, 3)
    assert new.committed_steps() == [3]
    # A late zombie (lower restart count of the same job) never takes over, however late it starts.
    late = _writer_store(job, "7", 0, "c" * 16)
    with pytest.raises(StaleWriter, match="older incarnation"):
        late.claim()
    # A new job reusing the key (SLURM_ELASTIC_JOB_KEY) takes over; the old job's writer stops.
    reuse = _writer_store(job, "8", 0, "d" * 16)
    _commit(reuse, 4)
    with pytest.raises(StaleWriter):
        _commit(new, 5)
    assert reuse.newest_complete(model_fingerprint="fp").step == 4   # type: ignore[union-attr]


# -- class 6: hostile manifests and headers fall back to the previous complete step ---------------------------
def _set(path: str, value: Any) -> Callable[[dict], None]:
    def apply(m: dict) -> None:
        obj = m
        keys = path.split(".")
        for k in keys[:-1]:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        obj[int(keys[-1]) if isinstance(obj, list) else keys[-1]] = value
    return apply


MANIFEST_ATTACKS: dict[str, Callable[[dict], Any]] = {
    "fingerprint-int": _set("model_fingerprint", 12345),
    "optimizer-list": _set("optimizer", []),
    "param-groups-dict": _set("optimizer.param_groups", {"lr": 1}),
    "lr-string": _set("optimizer.param_groups.0.lr", "fast"),
    "lr-negative": _set("optimizer.param_groups.0.lr", -1.0),
    "betas-huge": _set("optimizer.param_groups.0.betas", [5, 9]),
    "rng-string": _set("rng", "xyz"),
    "rng-torch-short": _set("rng.0.torch", "AAAA"),
    "rng-python-index": _set("rng.0.python.1.624", 10**6),
    "rng-numpy-name": _set("rng.0.numpy.0", "PCG64"),
    "scheduler-list": _set("scheduler", [1, 2]),
    "user-state-list": _set("user_state", [1]),
    "files-not-dicts": _set("files", ["group-00000.safetensors"]),
    "size-string": _set("files.0.size", "12"),
    "digest-int": lambda m: m["files"][0].update({k: 7 for k in CHECKSUMS if k in m["files"][0]}),
    "world-size-zero": _set("world_size", 0),
    "global-batch-float": _set("global_batch", 16.0),
    "sharded-string": _set("sharded", "yes"),
}
RAW_ATTACKS = {
    # Text a JSON encoder would never write: NaN, overflowing numbers, nesting that blows the stack.
    "lr-nan": lambda text: text.replace('"lr": 0.001', '"lr": NaN'),
    "lr-overflow": lambda text: text.replace('"lr": 0.001', '"lr": 1e999'),
    "deep-nesting": lambda text: text.replace('"user_state": {}', '"user_state": {"x": ' + "[" * 100000 +
                                              "]" * 100000 + "}"),
    "binary": lambda text: "\x00\xff" + text,
}


def _hostile_header(data: bytes, kind: str) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    key = next(k for k in header if k != "__metadata__")
    entry = header[key]
    if kind == "offsets-string":
        entry["data_offsets"] = "0,10"
    elif kind == "offsets-dict":
        entry["data_offsets"] = {"a": 1}
    elif kind == "offsets-one":
        entry["data_offsets"] = [0]
    elif kind == "offsets-negative":
        entry["data_offsets"] = [-8, entry["data_offsets"][1]]
    elif kind == "offsets-beyond":
        entry["data_offsets"] = [entry["data_offsets"][0], entry["data_offsets"][1] + 10**12]
    elif kind == "dtype-unknown":
        entry["dtype"] = "Q99"
    elif kind == "shape-mismatch":
        entry["shape"] = [1]
    elif kind == "shape-strings":
        entry["shape"] = ["x"]
    elif kind == "entry-list":
        header[key] = [1, 2]
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + data[8 + n:]


HEADER_ATTACKS = ["offsets-string", "offsets-dict", "offsets-one", "offsets-negative", "offsets-beyond",
                  "dtype-unknown", "shape-mismatch", "shape-strings", "entry-list"]


def _restore_after(tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], None]) -> None:
    """Steps 1 and 2 of a real run, `damage` applied to step 2, then a fresh run resumes and trains on."""
    root = tmp_path / "ckpt"
    assert ckpt_writer.train_forever(str(root), "9", None, 3, steps=2, wait=True) == 2
    damage(root / "9" / protocol.step_dir_name(2))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert ckpt_writer.train_forever(str(root), "9", None, 3, steps=4) == 4, "training did not go on"
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("restored step 1 ") for m in messages), messages[-20:]
    assert any(("step 2" in m or protocol.step_dir_name(2) in m) and ("skipping" in m or "unusable" in m)
               for m in messages), \
        "no log line says why step 2 was not used"


@pytest.mark.parametrize("attack", sorted(MANIFEST_ATTACKS) + sorted(RAW_ATTACKS))
def test_a_hostile_manifest_falls_back_to_the_previous_step(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                            attack: str) -> None:
    def damage(step_dir: Path) -> None:
        path = step_dir / protocol.MANIFEST_FILE
        if attack in MANIFEST_ATTACKS:
            manifest = json.loads(path.read_text())
            MANIFEST_ATTACKS[attack](manifest)
            path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        else:
            text = path.read_text()
            changed = RAW_ATTACKS[attack](text)
            assert changed != text, f"{attack}: the planted text did not apply"
            path.write_bytes(changed.encode("utf-8", "surrogateescape") if attack != "binary"
                             else b"\x00\xff" + text.encode())

    _restore_after(tmp_path, caplog, damage)


@pytest.mark.parametrize("attack", HEADER_ATTACKS)
def test_a_forged_safetensors_header_falls_back_to_the_previous_step(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture,
                                                                     attack: str) -> None:
    def damage(step_dir: Path) -> None:
        mpath = step_dir / protocol.MANIFEST_FILE
        manifest = json.loads(mpath.read_text())
        rec = manifest["files"][0]
        data = _hostile_header((step_dir / rec["name"]).read_bytes(), attack)
        (step_dir / rec["name"]).write_bytes(data)
        # The checksums and size are forged to match: only the header check stands in the way.
        rec.update(size=len(data), **{k: CHECKSUMS[k](data).hexdigest() for k in CHECKSUMS if k in rec})
        mpath.write_text(json.dumps(manifest))

    _restore_after(tmp_path, caplog, damage)


def test_what_a_real_run_commits_passes_the_schema(tmp_path: Path) -> None:
    """The schema is not stricter than the writer: every committed manifest of a run validates."""
    root = tmp_path / "ckpt"
    assert ckpt_writer.train_forever(str(root), "11", None, 3, steps=3, wait=True) == 3
    store = CheckpointStore(str(root / "11"), keep=3)
    assert [store.verify(s)["step"] for s in store.committed_steps()] == [3, 2, 1]


# -- class 9: odd entries where the store expects its own ---------------------------------------------
def test_a_regular_file_where_a_step_directory_goes_is_skipped_and_training_continues(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ckpt"
    assert ckpt_writer.train_forever(str(root), "12", None, 3, steps=2, wait=True) == 2
    (root / "12" / protocol.step_dir_name(3)).write_text("not a step\n")
    (root / "12" / protocol.step_dir_name(4)).symlink_to(tmp_path)
    with caplog.at_level(logging.ERROR):
        assert ckpt_writer.train_forever(str(root), "12", None, 3, steps=6, wait=True) == 6
    assert any("step 3" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)
    store = CheckpointStore(str(root / "12"), keep=3)
    assert store.committed_steps() == [6, 5, 2]
    assert (root / "12" / protocol.step_dir_name(3)).read_text() == "not a step\n"


@pytest.mark.parametrize("latest", [b"\xff\xfe\x00\x80binary", b"step-99999999999999999999999", b"x" * 10_000, b""])
def test_garbage_latest_is_ignored_and_the_steps_are_scanned(tmp_path: Path, latest: bytes) -> None:
    store = CheckpointStore(str(tmp_path / "job"), keep=3)
    store.ensure_job_dir()
    _commit(store, 1)
    _commit(store, 2)
    (tmp_path / "job" / protocol.LATEST_FILE).write_bytes(latest)
    reader = CheckpointStore(str(tmp_path / "job"), keep=3)
    assert reader.latest_pointer() is None
    assert reader.newest_complete(model_fingerprint="fp").step == 2   # type: ignore[union-attr]
    assert reader.candidates(model_fingerprint="fp") == [2, 1]


def test_a_fifo_where_a_file_goes_does_not_hang_the_restore(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "job"), keep=3)
    store.ensure_job_dir()
    _commit(store, 1)
    _commit(store, 2)
    step2 = tmp_path / "job" / protocol.step_dir_name(2)
    (step2 / protocol.MANIFEST_FILE).unlink()
    os.mkfifo(step2 / protocol.MANIFEST_FILE)
    (tmp_path / "job" / protocol.LATEST_FILE).unlink()
    os.mkfifo(tmp_path / "job" / protocol.LATEST_FILE)
    result: list[Any] = []

    def restore() -> None:
        try:
            reader = CheckpointStore(str(tmp_path / "job"), keep=3)
            result.append((reader.latest_pointer(), reader.newest_complete(model_fingerprint="fp")))
        except BaseException as exc:  # noqa: BLE001 - reported below
            result.append(exc)

    t = threading.Thread(target=restore, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "reading a FIFO in the job directory hangs the restore"
    assert not isinstance(result[0], BaseException), result[0]
    latest, found = result[0]
    assert latest is None and found is not None and found.step == 1


def test_a_step_whose_data_is_larger_than_listed_is_refused_unread(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "job"), keep=3)
    store.ensure_job_dir()
    _commit(store, 1)
    _commit(store, 2)
    rec = store.read_manifest(2)["files"][0]
    with open(tmp_path / "job" / protocol.step_dir_name(2) / rec["name"], "ab") as f:
        f.truncate(rec["size"] + (64 << 30))   # sparse: 64 GiB more than the manifest says
    with pytest.raises(CheckpointError, match="more than the"):
        store.read_tensors(2, rec)
    assert store.newest_complete(model_fingerprint="fp").step == 1   # type: ignore[union-attr]


def test_a_committer_woken_after_the_next_incarnation_took_over_does_not_move_latest_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """#25 item 6: frozen between its writer check and LATEST, the old committer wakes after the new
    incarnation committed step 8; LATEST must still name step 8, and the old one stops as stale."""
    from slurm_elastic.train.incarnation import StaleWriter
    from slurm_elastic.train.store import CheckpointStore

    job = tmp_path / "job"
    old = _writer_store(job, "7", 0, "a" * 16)
    new = _writer_store(job, "7", 1, "b" * 16)
    _commit(old, 4)
    rename = CheckpointStore._rename_into_place

    def freeze_then_wake(self, jd, step, writing, body):   # the old committer's step 5 renames, then it sleeps
        rename(self, jd, step, writing, body)
        if self is old:
            _commit(new, 8)                                  # meanwhile the next incarnation commits step 8

    monkeypatch.setattr(CheckpointStore, "_rename_into_place", freeze_then_wake)
    old.begin_step(5)
    with pytest.raises(StaleWriter, match="stale"):
        _commit(old, 5)
    assert new.latest_pointer() == 8
