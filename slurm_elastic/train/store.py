"""The checkpoint store: step directories of safetensors files, a manifest committed last, LATEST, retention."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as safetensors_load

from slurm_elastic.errors import CheckpointError
from slurm_elastic.train import protocol

log = logging.getLogger(__name__)

FORMAT = "slurm-elastic-ckpt/1"
DIR_MODE = 0o700
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors")
_REQUIRED = ("format", "step", "samples_consumed", "world_size", "global_batch", "model_fingerprint", "files")
# Lustre/GPFS like large sequential writes; 8 MiB matches a common stripe size.
_WRITE_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One data file of a step as the manifest lists it."""

    name: str
    size: int
    sha256: str
    rank: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256, "rank": self.rank}


@dataclass(frozen=True, slots=True)
class CompleteStep:
    """A step whose manifest was committed and whose files passed their checksums."""

    step: int
    path: str
    manifest: Mapping[str, Any]


class CheckpointStore:
    """`<ckpt_root>/<job-key>/step-<N>/`: data files first, `manifest.json` last, then `LATEST`."""

    def __init__(self, job_dir: str, *, keep: int = 2) -> None:
        if keep < 1:
            raise CheckpointError(f"retention must keep at least 1 complete checkpoint, got {keep}")
        self.job_dir = os.path.abspath(job_dir)
        self.keep = keep

    # -- writing ---------------------------------------------------------------------
    def ensure_job_dir(self) -> None:
        make_private_dirs(self.job_dir)

    def step_path(self, step: int) -> str:
        return os.path.join(self.job_dir, protocol.step_dir_name(step))

    def begin_step(self, step: int) -> str:
        path = self.step_path(step)
        make_private_dirs(path)
        return path

    def write_tensors(self, step: int, name: str, tensors: Mapping[str, torch.Tensor], *, rank: int) -> FileRecord:
        """Stream `tensors` as safetensors to `<step dir>/<name>`; durable (fsynced) when this returns."""
        check_file_name(name)
        size, digest = write_safetensors(os.path.join(self.step_path(step), name), tensors)
        return FileRecord(name=name, size=size, sha256=digest, rank=rank)

    def commit(self, step: int, manifest: Mapping[str, Any]) -> None:
        """Write the manifest (the commit point), then LATEST, then apply retention."""
        path = self.step_path(step)
        # The data files were renamed into place by other ranks; one directory
        # fsync here makes all of their names durable before the manifest exists.
        fsync_dir(path)
        body = dict(manifest)
        body["format"] = FORMAT
        body["step"] = int(step)
        atomic_write(os.path.join(path, protocol.MANIFEST_FILE), _dump(body))
        atomic_write(os.path.join(self.job_dir, protocol.LATEST_FILE),
                     (protocol.step_dir_name(step) + "\n").encode())
        self.apply_retention()

    def discard_step(self, step: int) -> None:
        """Remove an uncommitted step directory (after a failed write); never a committed one."""
        path = self.step_path(step)
        if os.path.exists(os.path.join(path, protocol.MANIFEST_FILE)):
            return
        shutil.rmtree(path, ignore_errors=True)

    def apply_retention(self) -> None:
        committed = self.committed_steps()
        for step in committed[self.keep:]:
            # Un-commit first: rmtree removes files in directory order, and a crash halfway must
            # leave an uncommitted leftover (ignored, collected later), never a manifest whose files are gone.
            _unlink_quietly(os.path.join(self.step_path(step), protocol.MANIFEST_FILE))
            shutil.rmtree(self.step_path(step), ignore_errors=True)
        newest = committed[0] if committed else None
        for step, name in self._step_dirs():
            # Uncommitted directories older than the newest commit are leftovers of
            # failed or interrupted writes; newer ones may still be in progress.
            if newest is not None and step < newest and step not in committed:
                shutil.rmtree(os.path.join(self.job_dir, name), ignore_errors=True)
        # Temp files of a writer killed mid-write (LATEST, shards of a step rewritten after the
        # crash) would otherwise pile up one per crash: the job directory and committed steps are
        # written by this process alone now, so a temp file of another process there is dead.
        for directory in [self.job_dir] + [self.step_path(s) for s in committed[:self.keep]]:
            _remove_dead_temps(directory)

    def append_metrics(self, row: Mapping[str, Any]) -> None:
        line = json.dumps(dict(row), sort_keys=True) + "\n"
        # 0600 like every other file of the job: the umask would leave it readable by others.
        with open(os.path.join(self.job_dir, protocol.METRICS_FILE), "a", encoding="utf-8",
                  opener=lambda path, flags: os.open(path, flags, 0o600)) as f:
            f.write(line)

    # -- reading ---------------------------------------------------------------------
    def _check_model(self, step: int, manifest: dict, model_fingerprint: str | None) -> None:
        """A checkpoint of another model is an error, never a silent fallback to an older step."""
        if model_fingerprint is not None and manifest["model_fingerprint"] != model_fingerprint:
            raise CheckpointError(
                f"{self.step_path(step)} was written by a different model (fingerprint "
                f"{manifest['model_fingerprint'][:12]} != {model_fingerprint[:12]}); point "
                f"{protocol.CKPT_DIR_ENV} elsewhere or remove that directory")

    def committed_steps(self) -> list[int]:
        """Steps with a manifest, newest first (checksums not yet verified)."""
        return sorted((s for s, name in self._step_dirs()
                       if os.path.isfile(os.path.join(self.job_dir, name, protocol.MANIFEST_FILE))), reverse=True)

    def latest_pointer(self) -> int | None:
        try:
            with open(os.path.join(self.job_dir, protocol.LATEST_FILE), encoding="utf-8") as f:
                return protocol.parse_step_dir_name(f.read().strip())
        except OSError:
            return None

    def read_manifest(self, step: int) -> dict[str, Any]:
        path = os.path.join(self.step_path(step), protocol.MANIFEST_FILE)
        try:
            with open(path, "rb") as f:
                manifest = json.loads(f.read().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable manifest ({exc})") from exc
        validate_manifest(manifest, path)
        if manifest["step"] != step:
            raise CheckpointError(f"{path}: manifest says step {manifest['step']} but lives in "
                                  f"{protocol.step_dir_name(step)}")
        return manifest

    def verify(self, step: int) -> dict[str, Any]:
        """The manifest of `step` after checking every file's size and sha256."""
        manifest = self.read_manifest(step)
        for rec in manifest["files"]:
            self._read_verified(step, rec)
        return manifest

    def newest_complete(self, *, model_fingerprint: str | None = None) -> CompleteStep | None:
        """The newest step that verifies; damaged steps are skipped with a warning.

        A step written by a different model (fingerprint mismatch) is an error,
        not a fallback: silently training from an older step of some other
        model would be worse than stopping.
        """
        for step in self.committed_steps():
            try:
                manifest = self.verify(step)
            except CheckpointError as exc:
                log.warning("skipping damaged checkpoint: %s", exc)
                continue
            self._check_model(step, manifest, model_fingerprint)
            return CompleteStep(step=step, path=self.step_path(step), manifest=manifest)
        return None

    def candidates(self, *, model_fingerprint: str | None = None) -> list[int]:
        """Committed steps, newest first, whose manifest is sound and whose files have the listed
        sizes. Cheap (no reading of data); `read_tensors` checks the sha256 while loading."""
        out = []
        for step in self.committed_steps():
            try:
                manifest = self.read_manifest(step)
                for rec in manifest["files"]:
                    path = os.path.join(self.step_path(step), rec["name"])
                    try:
                        size = os.stat(path).st_size
                    except OSError:
                        raise CheckpointError(f"{path}: missing") from None
                    if size != rec["size"]:
                        raise CheckpointError(f"{path}: size {size} != {rec['size']} in the manifest (truncated?)")
            except CheckpointError as exc:
                log.warning("skipping damaged checkpoint: %s", exc)
                continue
            self._check_model(step, manifest, model_fingerprint)
            out.append(step)
        return out

    def read_tensors(self, step: int, record: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        data = self._read_verified(step, record)
        try:
            return safetensors_load(data)
        except Exception as exc:   # safetensors raises its own error types
            raise CheckpointError(f"{record['name']} of step {step}: not a valid safetensors file ({exc})") from exc

    def iter_tensors(self, complete: CompleteStep) -> Iterator[tuple[str, torch.Tensor]]:
        for rec in complete.manifest["files"]:
            yield from self.read_tensors(complete.step, rec).items()

    def _read_verified(self, step: int, rec: Mapping[str, Any]) -> bytes:
        name = rec["name"]
        check_file_name(name)
        path = os.path.join(self.step_path(step), name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise CheckpointError(f"{path}: missing or unreadable ({exc.strerror})") from exc
        if len(data) != rec["size"]:
            raise CheckpointError(f"{path}: size {len(data)} != {rec['size']} in the manifest (truncated?)")
        if hashlib.sha256(data).hexdigest() != rec["sha256"]:
            raise CheckpointError(f"{path}: sha256 mismatch (damaged)")
        _check_safetensors_layout(data, path)
        return data

    def _step_dirs(self) -> list[tuple[int, str]]:
        try:
            names = os.listdir(self.job_dir)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            step = protocol.parse_step_dir_name(name)
            if step is not None and os.path.isdir(os.path.join(self.job_dir, name)):
                out.append((step, name))
        return out


def validate_manifest(manifest: Any, where: str) -> None:
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: manifest is not a JSON object")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise CheckpointError(f"{where}: not a slurm-elastic manifest (missing {', '.join(missing)})")
    if manifest["format"] != FORMAT:
        raise CheckpointError(f"{where}: unknown format {manifest['format']!r} (this version reads {FORMAT})")
    for key in ("step", "samples_consumed", "world_size", "global_batch"):
        if not isinstance(manifest[key], int) or isinstance(manifest[key], bool) or manifest[key] < 0:
            raise CheckpointError(f"{where}: {key} must be a non-negative integer")
    files = manifest["files"]
    if not isinstance(files, list) or not files:
        raise CheckpointError(f"{where}: manifest lists no files")
    seen = set()
    for rec in files:
        if not isinstance(rec, dict) or not {"name", "size", "sha256"} <= rec.keys():
            raise CheckpointError(f"{where}: malformed file entry {rec!r}")
        check_file_name(rec["name"])
        if rec["name"] in seen:
            raise CheckpointError(f"{where}: file {rec['name']!r} listed twice")
        seen.add(rec["name"])
        if not isinstance(rec["size"], int) or not isinstance(rec["sha256"], str):
            raise CheckpointError(f"{where}: malformed file entry {rec!r}")


def _check_safetensors_layout(data: bytes, where: str) -> None:
    """Header length, JSON header and data extent agree: catches foreign bytes whose checksum was forged."""
    if len(data) < 8:
        raise CheckpointError(f"{where}: not a safetensors file (too short)")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8 or n > 100 << 20:
        raise CheckpointError(f"{where}: not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{where}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: not a safetensors file (header is not an object)")
    end = max((v["data_offsets"][1] for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v), default=0)
    if 8 + n + end != len(data):
        raise CheckpointError(f"{where}: safetensors data extent does not match the file size")


def check_file_name(name: Any) -> None:
    """Manifest file names are bare names: no separators, no '..', nothing hidden."""
    if not isinstance(name, str) or not _FILE_NAME_RE.fullmatch(name) or ".." in name:
        raise CheckpointError(f"refusing checkpoint file name {name!r}: only plain *.safetensors names "
                              f"inside the step directory are allowed")


def make_private_dirs(path: str) -> None:
    """mkdir -p with 0700 on every directory this call creates (existing ones are left alone)."""
    path = os.path.abspath(path)
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for p in reversed(missing):
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(p):
                raise CheckpointError(f"{p} exists and is not a directory") from None
            continue
        os.chmod(p, DIR_MODE)  # the umask may have removed bits we do not want anyway; make it exact


def atomic_write(path: str, data: bytes, *, sync_dir: bool = True) -> None:
    """temp name, write, fsync, rename, (fsync the directory): readers see all or nothing."""
    tmp = f"{path}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        for start in range(0, len(view), _WRITE_CHUNK):
            _write_all(fd, view[start:start + _WRITE_CHUNK])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if sync_dir:
        fsync_dir(os.path.dirname(path))


def write_safetensors(path: str, tensors: Mapping[str, torch.Tensor]) -> tuple[int, str]:
    """Write the safetensors format straight from the tensors' memory: no serialised copy
    in RAM, and os.write/hashlib release the GIL so training threads keep running."""
    header: dict[str, Any] = {}
    buffers: list[memoryview] = []
    offset = 0
    for key in sorted(tensors):
        t = tensors[key].detach()
        if t.device.type != "cpu":
            raise CheckpointError(f"tensor {key!r} is on {t.device}; snapshots must be on the host")
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        buffers.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b""))
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format wants the data 8-byte aligned
    prefix = len(head).to_bytes(8, "little") + head
    sha = hashlib.sha256(prefix)
    tmp = f"{path}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    # Hashing runs in a second thread, in order, while this one writes: the file
    # costs max(hash, write) instead of their sum (both release the GIL).
    hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-sha256")
    try:
        _write_all(fd, memoryview(prefix))
        pending = []
        for buf in buffers:
            for start in range(0, len(buf), _WRITE_CHUNK):
                chunk = buf[start:start + _WRITE_CHUNK]
                pending.append(hasher.submit(sha.update, chunk))
                _write_all(fd, chunk)
        for fut in pending:
            fut.result()
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    finally:
        hasher.shutdown(wait=True)
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return len(prefix) + offset, sha.hexdigest()


def _write_all(fd: int, chunk: memoryview) -> None:
    while chunk:
        n = os.write(fd, chunk)
        chunk = chunk[n:]


_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some network filesystems refuse fsync on a directory; the rename is still atomic.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _remove_dead_temps(directory: str) -> None:
    mine = f".tmp-{os.getpid()}-"
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if ".tmp-" in name and mine not in name:
            _unlink_quietly(os.path.join(directory, name))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _dump(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")
