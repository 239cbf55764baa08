"""The checkpoint store: commit protocol, verification, fallback, retention, hostile manifests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from slurm_elastic.errors import CheckpointError
from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.incarnation import OWNER_FILE
from slurm_elastic.train.store import CHECKSUMS, CheckpointStore, check_file_name


def _commit(store: CheckpointStore, step: int, fingerprint: str = "fp") -> None:
    store.begin_step(step)
    rec = store.write_tensors(step, "group-00000.safetensors", {"w": torch.full((4,), float(step))}, rank=0)
    store.commit(step, {"samples_consumed": step * 8, "world_size": 1, "global_batch": 8,
                        "model_fingerprint": fingerprint, "files": [rec.to_json()]})


def test_commit_writes_manifest_latest_and_private_dirs(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "root" / "job"), keep=2)
    store.ensure_job_dir()
    _commit(store, 3)
    assert store.latest_pointer() == 3
    found = store.newest_complete(model_fingerprint="fp")
    assert found is not None and found.step == 3
    assert torch.equal(store.read_tensors(3, found.manifest["files"][0])["w"], torch.full((4,), 3.0))
    for d in (tmp_path / "root", tmp_path / "root" / "job", tmp_path / "root" / "job" / protocol.step_dir_name(3)):
        assert os.stat(d).st_mode & 0o777 == 0o700, d
    assert not [p for p in (tmp_path / "root" / "job").rglob("*.tmp-*")]


def test_retention_keeps_newest_k_and_removes_stale_partials(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "job"), keep=2)
    store.ensure_job_dir()
    store.begin_step(1)          # an interrupted write that never committed
    for step in (2, 4, 6):
        _commit(store, step)
    assert store.committed_steps() == [6, 4]
    assert sorted(os.listdir(tmp_path / "job")) == [protocol.LATEST_FILE, protocol.step_dir_name(4),
                                                    protocol.step_dir_name(6), OWNER_FILE]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest-garbage", "manifest-truncated"])
def test_damaged_newest_step_falls_back_to_previous(tmp_path: Path, damage: str) -> None:
    store = CheckpointStore(str(tmp_path / "job"), keep=3)
    store.ensure_job_dir()
    _commit(store, 1)
    _commit(store, 2)
    step_dir = tmp_path / "job" / protocol.step_dir_name(2)
    data = step_dir / "group-00000.safetensors"
    manifest = step_dir / protocol.MANIFEST_FILE
    if damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:20])
    elif damage == "delete":
        data.unlink()
    elif damage == "manifest-garbage":
        manifest.write_bytes(b"\x00\xffnot json")
    else:
        manifest.write_text(manifest.read_text()[:40])
    found = store.newest_complete(model_fingerprint="fp")
    assert found is not None and found.step == 1


def test_foreign_directories_are_ignored_and_empty_store_is_fresh(tmp_path: Path) -> None:
    job = tmp_path / "job"
    (job / "step-0000000009").mkdir(parents=True)
    (job / "step-0000000009" / protocol.MANIFEST_FILE).write_text(json.dumps({"hello": "world"}))
    (job / "not-a-step").mkdir()
    (job / "step-xyz").mkdir()
    store = CheckpointStore(str(job))
    assert store.newest_complete(model_fingerprint="fp") is None


def test_manifest_of_a_different_model_is_an_error(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "job"))
    store.ensure_job_dir()
    _commit(store, 5, fingerprint="someone-else")
    with pytest.raises(CheckpointError, match="different model"):
        store.newest_complete(model_fingerprint="fp")


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "a/b.safetensors", "..safetensors",
                                  ".hidden.safetensors", "x.pt", "", 7])
def test_path_traversal_and_odd_names_in_manifest_are_refused(tmp_path: Path, name: object) -> None:
    with pytest.raises(CheckpointError):
        check_file_name(name)
    store = CheckpointStore(str(tmp_path / "job"))
    store.ensure_job_dir()
    _commit(store, 1)
    mpath = tmp_path / "job" / protocol.step_dir_name(1) / protocol.MANIFEST_FILE
    manifest = json.loads(mpath.read_text())
    manifest["files"][0]["name"] = name
    mpath.write_text(json.dumps(manifest))
    assert store.newest_complete(model_fingerprint="fp") is None


def test_pickle_payload_is_never_loaded(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "job"))
    store.ensure_job_dir()
    _commit(store, 1)
    step_dir = tmp_path / "job" / protocol.step_dir_name(1)
    evil = step_dir / "group-00000.safetensors"
    import pickle

    payload = pickle.dumps({"w": torch.zeros(4)})
    evil.write_bytes(payload)
    mpath = step_dir / protocol.MANIFEST_FILE
    manifest = json.loads(mpath.read_text())
    manifest["files"][0].update(size=len(payload), xxh3_128=CHECKSUMS["xxh3_128"](payload).hexdigest())
    mpath.write_text(json.dumps(manifest))
    # The checksums match, but the bytes are not safetensors: the step is not complete.
    assert store.newest_complete(model_fingerprint="fp") is None
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        store.read_tensors(1, manifest["files"][0])


def test_candidates_check_sizes_without_reading(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "job"), keep=3)
    store.ensure_job_dir()
    for step in (1, 2, 3):
        _commit(store, step)
    data = tmp_path / "job" / protocol.step_dir_name(3) / "group-00000.safetensors"
    data.write_bytes(data.read_bytes()[:-1])
    raw = bytearray((tmp_path / "job" / protocol.step_dir_name(2) / "group-00000.safetensors").read_bytes())
    raw[-1] ^= 1     # same size, wrong content: only the checksum at load time catches it
    (tmp_path / "job" / protocol.step_dir_name(2) / "group-00000.safetensors").write_bytes(bytes(raw))
    assert store.candidates(model_fingerprint="fp") == [2, 1]
    with pytest.raises(CheckpointError, match="xxh3_128 mismatch"):
        store.read_tensors(2, store.read_manifest(2)["files"][0])


@pytest.mark.parametrize("checksum", ["xxh3_128", "sha256"])
def test_files_are_written_with_o_direct_and_verified_by_their_named_checksum(tmp_path: Path, checksum: str) -> None:
    """Sizes that are not a multiple of the staging buffer or of a block: the unaligned tail."""
    import hashlib

    store = CheckpointStore(str(tmp_path / "job"), checksum=checksum)
    store.ensure_job_dir()
    writing = Path(store.begin_step(1))
    big = torch.arange((9 << 20) // 8 + 3, dtype=torch.float64)        # spans two staging buffers
    odd = torch.arange(7, dtype=torch.int16).reshape(7, 1).t()           # not contiguous
    rec = store.write_tensors(1, "group-00000.safetensors", {"big": big, "odd": odd, "empty": torch.zeros(0)},
                              rank=0)
    data = (writing / "group-00000.safetensors").read_bytes()
    assert rec.checksum == checksum and rec.size == len(data)
    want = hashlib.sha256(data).hexdigest() if checksum == "sha256" else CHECKSUMS["xxh3_128"](data).hexdigest()
    assert rec.digest == want and rec.to_json()[checksum] == want
    got = store.read_tensors(1, rec.to_json())
    assert torch.equal(got["big"], big) and torch.equal(got["odd"], odd) and got["empty"].numel() == 0


def test_a_filesystem_without_o_direct_is_written_through_the_page_cache_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import subprocess

    # ramfs refuses O_DIRECT at open (tmpfs takes it since Linux 6.6).
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a ramfs")
    try:
        store = CheckpointStore(str(mnt / "job"))
        store.ensure_job_dir()
        store.begin_step(1)
        t = torch.arange(100_003, dtype=torch.float32)
        with caplog.at_level("WARNING"):
            rec = store.write_tensors(1, "group-00000.safetensors", {"w": t}, rank=0)
            store.write_tensors(1, "group-00001.safetensors", {"w": t}, rank=0)
        assert torch.equal(store.read_tensors(1, rec.to_json())["w"], t)
        warnings = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
        assert len(warnings) == 1 and "page cache" in warnings[0] and str(mnt / "job") in warnings[0]
        store.close()     # the store holds the job directory open
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_unknown_checksum_is_refused() -> None:
    with pytest.raises(CheckpointError, match="unknown checksum 'md5'"):
        CheckpointStore("/nonexistent", checksum="md5")


def test_read_files_returns_every_file_in_order_and_raises_on_damage(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "job"))
    store.ensure_job_dir()
    writing = Path(store.begin_step(1))
    recs = [store.write_tensors(1, f"group-{i:05d}.safetensors", {"w": torch.full((1000,), float(i))}, rank=0).to_json()
            for i in range(6)]
    got = store.read_files(1, recs, workers=3)
    assert [float(t["w"][0]) for t in got] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    path = writing / "group-00004.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="group-00004.safetensors: xxh3_128 mismatch"):
        store.read_files(1, recs, workers=3)
