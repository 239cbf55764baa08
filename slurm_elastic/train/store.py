"""The checkpoint store: step directories of safetensors files, a manifest committed last, LATEST, retention."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
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
# O_DIRECT wants buffer address, file offset and length aligned to the device's logical
# block; a page covers every block size in use (512 B, 4 KiB) and Lustre's page rule.
_DIRECT_ALIGN = 4096
# Files read at once on restore: enough to keep a disk or a parallel filesystem busy
# while others are being checksummed.
READ_WORKERS = 4

# The data files' checksum is for damage (a torn or truncated write, bit rot, a file from
# elsewhere), not for an adversary: whoever can rewrite a file can rewrite the manifest
# too. xxh3-128 costs about 0.04 CPU-seconds per GB here, sha256 (with SHA-NI) 0.55, and a
# checkpoint every step on a busy CPU pays that out of training's own time. Manifests
# name the algorithm per file, so either verifies; sha256 stays selectable.
CHECKSUMS: dict[str, Callable[..., Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
DEFAULT_CHECKSUM = "xxh3_128"


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One data file of a step as the manifest lists it."""

    name: str
    size: int
    checksum: str        # the algorithm, a key of CHECKSUMS
    digest: str
    rank: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, self.checksum: self.digest, "rank": self.rank}


@dataclass(frozen=True, slots=True)
class CompleteStep:
    """A step whose manifest was committed and whose files passed their checksums."""

    step: int
    path: str
    manifest: Mapping[str, Any]


class CheckpointStore:
    """`<ckpt_root>/<job-key>/step-<N>/`: data files first, `manifest.json` last, then `LATEST`."""

    def __init__(self, job_dir: str, *, keep: int = 2, checksum: str = DEFAULT_CHECKSUM) -> None:
        if keep < 1:
            raise CheckpointError(f"retention must keep at least 1 complete checkpoint, got {keep}")
        if checksum not in CHECKSUMS:
            raise CheckpointError(f"unknown checksum {checksum!r}; choose one of {', '.join(CHECKSUMS)}")
        self.job_dir = os.path.abspath(job_dir)
        self.keep = keep
        self.checksum = checksum

    # -- writing ---------------------------------------------------------------------
    def ensure_job_dir(self) -> None:
        make_private_dirs(self.job_dir)

    def step_path(self, step: int) -> str:
        return os.path.join(self.job_dir, protocol.step_dir_name(step))

    def begin_step(self, step: int) -> str:
        path = self.step_path(step)
        make_private_dirs(path)
        return path

    def write_tensors(self, step: int, name: str, tensors: Mapping[str, torch.Tensor] | TensorSource, *,
                      rank: int) -> FileRecord:
        """Stream `tensors` as safetensors to `<step dir>/<name>`; durable (fsynced) when this returns."""
        check_file_name(name)
        source = tensors if isinstance(tensors, TensorSource) else TensorSource(tensors)
        size, digest = write_safetensors(os.path.join(self.step_path(step), name), source, checksum=self.checksum)
        return FileRecord(name=name, size=size, checksum=self.checksum, digest=digest, rank=rank)

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

    def read_files(self, step: int, records: list[Mapping[str, Any]], *,
                   workers: int = READ_WORKERS) -> list[dict[str, torch.Tensor]]:
        """Every file's tensors, in the order of `records`, read and verified by a few threads:
        the reads and checksums release the GIL, so a step of many files loads in about the
        time of the disk rather than of one file after another. The first damage found raises."""
        if len(records) <= 1 or workers <= 1:
            return [self.read_tensors(step, rec) for rec in records]
        with ThreadPoolExecutor(min(workers, len(records)), thread_name_prefix="ckpt-read") as pool:
            return list(pool.map(lambda rec: self.read_tensors(step, rec), records))

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
        for algo in CHECKSUMS:
            if algo in rec and CHECKSUMS[algo](data).hexdigest() != rec[algo]:
                raise CheckpointError(f"{path}: {algo} mismatch (damaged)")
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
        sums = [k for k in CHECKSUMS if isinstance(rec, dict) and k in rec]
        if not isinstance(rec, dict) or not {"name", "size"} <= rec.keys() or not sums:
            raise CheckpointError(f"{where}: malformed file entry {rec!r} (needs name, size and one of "
                                  f"{', '.join(CHECKSUMS)})")
        check_file_name(rec["name"])
        if rec["name"] in seen:
            raise CheckpointError(f"{where}: file {rec['name']!r} listed twice")
        seen.add(rec["name"])
        if not isinstance(rec["size"], int) or isinstance(rec["size"], bool) or \
                not all(isinstance(rec[k], str) for k in sums):
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


class TensorSource:
    """The tensors of one file as the writer reads them: a mapping of host tensors.

    The checkpointer's subclass lets the writer read live parameters in place and
    swaps in a copy of any it has not read yet when the optimizer is about to
    change them; `hold` is where that handover is safe.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        for key, t in tensors.items():
            t = t.detach()
            if t.device.type != "cpu":
                raise CheckpointError(f"tensor {key!r} is on {t.device}; snapshots must be on the host")
            if t.dtype not in _DTYPE_NAMES:
                raise CheckpointError(f"tensor {key!r} has dtype {t.dtype}, which the store cannot write")
            self._tensors[key] = t if t.is_contiguous() else t.contiguous()

    def keys(self) -> list[str]:
        return sorted(self._tensors)

    def layout(self, key: str) -> tuple[torch.dtype, list[int], int]:
        t = self._tensors[key]
        return t.dtype, list(t.shape), t.numel() * t.element_size()

    @contextmanager
    def hold(self, key: str) -> Iterator[torch.Tensor]:
        """The tensor to read `key` from, unchanging until the block ends."""
        yield self._tensors[key]

    def release(self, key: str) -> None:
        """The writer has read all of `key`."""


def write_safetensors(path: str, source: TensorSource, *, checksum: str = DEFAULT_CHECKSUM) -> tuple[int, str]:
    """Write the safetensors format from the tensors' memory through one page-aligned
    staging buffer: hashed while it is hot in cache, written with O_DIRECT.

    O_DIRECT keeps checkpoints out of the page cache: a checkpoint every step would
    otherwise dirty gigabytes of cache per step, and the kernel's reclaim and
    writeback of it cost training several times the copy into the buffer. A
    filesystem that refuses O_DIRECT (ramfs, tmpfs before Linux 6.6, some FUSE mounts) is written through
    the page cache, with a warning once per directory. The copies into the buffer,
    os.write and the hash all release the GIL.
    """
    header: dict[str, Any] = {}
    offset = 0
    for key in source.keys():
        dtype, shape, nbytes = source.layout(key)
        header[key] = {"dtype": _DTYPE_NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format wants the data 8-byte aligned
    prefix = len(head).to_bytes(8, "little") + head
    digest = CHECKSUMS[checksum]()
    tmp = f"{path}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    fd = _open_for_data(tmp)
    out = _StagedFile(fd, digest, tmp)
    try:
        out.put_bytes(prefix)
        for key in source.keys():
            _, _, nbytes = source.layout(key)
            done = 0
            while done < nbytes:
                n = min(nbytes - done, out.room)
                with source.hold(key) as t:
                    out.copy_from(t.data_ptr() + done, n)
                done += n
                out.flush_if_full()      # outside `hold`: the disk write must not hold up training
            source.release(key)
        out.finish()
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
    return len(prefix) + offset, digest.hexdigest()


_NO_DIRECT_WARNED: set[str] = set()


def _open_for_data(path: str) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    _warn_no_direct(path, "open")
    # Some filesystems (ramfs) create the file before refusing O_DIRECT; the name is this
    # process's own temp name, so opening it again without O_EXCL is safe.
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)


def _warn_no_direct(path: str, how: str) -> None:
    where = os.path.dirname(os.path.dirname(path))   # the job directory: once per job, not per step
    if where not in _NO_DIRECT_WARNED:
        _NO_DIRECT_WARNED.add(where)
        log.warning("%s refuses O_DIRECT (at %s); checkpoints there go through the page cache", where, how)


class _Staging(threading.local):
    """One page-aligned buffer per writing thread, kept: mapping (and faulting in) a fresh
    one per file would cost more than the copies into it."""

    def get(self) -> tuple[memoryview, int]:
        if not hasattr(self, "buf"):
            self.buf = mmap.mmap(-1, _WRITE_CHUNK)      # anonymous maps are page-aligned
            self.view = memoryview(self.buf)
            self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        return self.view, self.addr


_STAGING = _Staging()


class _StagedFile:
    """Fills an aligned buffer, hashes it and writes it out whole; the tail goes out buffered."""

    def __init__(self, fd: int, digest: Any, path: str) -> None:
        self.fd = fd
        self.digest = digest
        self.path = path
        self.view, self.addr = _STAGING.get()
        self.fill = 0
        self.direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)

    @property
    def room(self) -> int:
        return _WRITE_CHUNK - self.fill

    def put_bytes(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = min(len(view), self.room)
            self.view[self.fill:self.fill + n] = view[:n]
            self.fill += n
            view = view[n:]
            self.flush_if_full()

    def copy_from(self, address: int, n: int) -> None:
        """Copy n bytes (at most `room`) from memory at `address`; ctypes.memmove drops the GIL."""
        if n > self.room:
            raise ValueError(f"{n} bytes do not fit the {self.room} left in the staging buffer")
        ctypes.memmove(self.addr + self.fill, address, n)
        self.fill += n

    def flush_if_full(self) -> None:
        if not self.room:
            self.digest.update(self.view[:self.fill])
            self._write(self.view[:self.fill])
            self.fill = 0

    def finish(self) -> None:
        if not self.fill:
            return
        aligned = self.fill - self.fill % _DIRECT_ALIGN
        self.digest.update(self.view[:self.fill])
        if aligned:
            self._write(self.view[:aligned])
        if aligned < self.fill:
            if self.direct:
                # The tail is shorter than a block: O_DIRECT cannot write it.
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False
            _write_all(self.fd, self.view[aligned:self.fill])
        self.fill = 0

    def _write(self, chunk: memoryview) -> None:
        try:
            _write_all(self.fd, chunk)
        except OSError as exc:
            # Some filesystems take O_DIRECT at open and refuse it at the first write.
            if not (self.direct and exc.errno == errno.EINVAL):
                raise
            _warn_no_direct(self.path, "write")
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
            _write_all(self.fd, chunk)


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
