"""The checkpoint store: step directories of safetensors files, a manifest committed last, LATEST, retention.

Every name in the job directory is reached through a verified directory fd
(jobdir.JobDir), never through a link; every manifest and safetensors header
passes its schema (manifest.py) before restore uses it; and only the
incarnation named in the owner file (incarnation.py) commits or deletes.
A step is written into `writing-<step>-<incarnation tag>/`, this
incarnation's own directory, and renamed to `step-<N>/` when its manifest is
in place, so no two writers ever share a directory or overwrite a committed
step, and a failed write is removed without touching anyone else's files.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as safetensors_load

from slurm_elastic.errors import CheckpointError
from slurm_elastic import jobfiles as protocol
from slurm_elastic.jobfiles import MetricsRow
from slurm_elastic.train.incarnation import OWNER_FILE, Incarnation, StaleWriter, check_still_writer, claim
from slurm_elastic.train.jobdir import (
    DIR_MODE,
    FILE_MODE,
    JobDir,
    UnsafeJobDir,
    fsync_fd,
    open_private_dir,
    temp_name,
    write_atomic_at,
)
from slurm_elastic.train.manifest import (
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    FORMAT,
    MANIFEST_MAX_BYTES,
    check_file_name,
    check_safetensors_layout,
    parse_json,
    validate_file_record,
    validate_manifest,
)

__all__ = ["CHECKSUMS", "DEFAULT_CHECKSUM", "DIR_MODE", "FORMAT", "CheckpointStore", "CompleteStep", "FileRecord",
           "Incarnation", "StaleWriter", "TensorSource", "UnsafeJobDir", "check_file_name",
           "fsync_dir", "make_private_dirs", "validate_manifest", "write_safetensors"]

log = logging.getLogger(__name__)

# Lustre/GPFS like large sequential writes; 8 MiB matches a common stripe size.
_WRITE_CHUNK = 8 << 20
# O_DIRECT wants buffer address, file offset and length aligned to the device's logical
# block; a page covers every block size in use (512 B, 4 KiB) and Lustre's page rule.
_DIRECT_ALIGN = 4096
# Files read at once on restore: enough to keep a disk or a parallel filesystem busy
# while others are being checksummed.
READ_WORKERS = 4
WRITING_PREFIX = "writing-"
_WRITING_RE = re.compile(re.escape(WRITING_PREFIX) + r"([0-9]{10,18})-([A-Za-z0-9._-]{1,80})")
_LATEST_MAX_BYTES = 64
# Another job's writing directory (a job key reused) counts as abandoned after this long untouched:
# every file renamed into it updates its mtime, and no step takes hours between two files.
ABANDONED_AFTER_S = 6 * 3600
# Temp files of the job directory that the store itself writes (others' files are not its to collect).
_OWN_TEMPS = (protocol.LATEST_FILE + ".tmp-", OWNER_FILE + ".tmp-")


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


def writing_dir_name(step: int, tag: str) -> str:
    """Where incarnation `tag` writes `step` until it commits it."""
    return f"{WRITING_PREFIX}{int(step):010d}-{tag}"


def parse_writing_dir_name(name: str) -> tuple[int, str] | None:
    m = _WRITING_RE.fullmatch(name)
    return (int(m[1]), m[2]) if m else None


class CheckpointStore:
    """`<ckpt_root>/<job-key>/step-<N>/`: data files first, `manifest.json` last, then `LATEST`.

    `writer` names the incarnation this process is (default: from the job's
    environment); only the writer named in the job directory's owner file
    commits or deletes, see incarnation.py. Each rank of a job uses its own store.
    """

    def __init__(self, job_dir: str, *, keep: int = 2, checksum: str = DEFAULT_CHECKSUM,
                 writer: Incarnation | None = None) -> None:
        if keep < 1:
            raise CheckpointError(f"retention must keep at least 1 complete checkpoint, got {keep}")
        if checksum not in CHECKSUMS:
            raise CheckpointError(f"unknown checksum {checksum!r}; choose one of {', '.join(CHECKSUMS)}")
        self.job_dir = os.path.abspath(job_dir)
        self.keep = keep
        self.checksum = checksum
        self._writer = writer
        self._dir: JobDir | None = None
        self._dir_lock = threading.Lock()
        self._claimed = False
        self._writing: set[int] = set()       # steps this store began and has not committed or discarded
        self._last_commit: int | None = None
        self._warned: set[str] = set()

    # -- the job directory and who writes it ------------------------------------------------
    def _job(self, *, create: bool) -> JobDir | None:
        with self._dir_lock:
            if self._dir is None:
                self._dir = JobDir.open(self.job_dir, create=create)
            return self._dir

    def close(self) -> None:
        """Let go of the job directory (the store reopens and re-verifies it when used again)."""
        with self._dir_lock:
            if self._dir is not None:
                self._dir.close()
                self._dir = None

    def _job_or_fail(self) -> JobDir:
        jd = self._job(create=False)
        if jd is None:
            raise FileNotFoundError(errno.ENOENT, "no job directory", self.job_dir)
        return jd

    @property
    def writer(self) -> Incarnation:
        if self._writer is None:
            self._writer = Incarnation.from_environment()
        return self._writer

    def claim(self) -> None:
        """Become the job directory's writer (a newer incarnation takes over from an older one).

        Call it on the rank that commits before restoring, so a stale incarnation
        still running elsewhere stops at its next commit instead of racing this one.
        The first commit claims too when nobody called this.
        """
        claim(self._job(create=True), self.writer)   # type: ignore[arg-type]
        self._claimed = True

    def _check_writer(self, jd: JobDir, action: str) -> None:
        if not self._claimed:
            claim(jd, self.writer)
            self._claimed = True
        else:
            check_still_writer(jd, self.writer, action)

    # -- writing ---------------------------------------------------------------------------
    def ensure_job_dir(self) -> None:
        self._job(create=True)

    def step_path(self, step: int) -> str:
        """Where a committed step lives."""
        return os.path.join(self.job_dir, protocol.step_dir_name(step))

    def writing_path(self, step: int) -> str:
        """Where this incarnation writes `step` until it commits it."""
        return os.path.join(self.job_dir, writing_dir_name(step, self.writer.tag))

    def begin_step(self, step: int) -> str:
        """Create this incarnation's directory for `step` (every rank calls this); returns its path.

        A directory that cannot be made is logged, not raised: the writes into it fail
        and are reported, so that checkpoint is not committed and training goes on.
        """
        jd = self._job(create=True)
        assert jd is not None
        name = writing_dir_name(step, self.writer.tag)
        self._writing.add(step)
        try:
            os.close(jd.open_dir(name, create=True))
        except (OSError, CheckpointError) as exc:
            log.error("checkpoint of step %d: cannot create %s: %s", step, jd.where(name), exc)
        return jd.where(name)

    def write_tensors(self, step: int, name: str, tensors: Mapping[str, torch.Tensor] | TensorSource, *,
                      rank: int) -> FileRecord:
        """Stream `tensors` as safetensors to `<step dir>/<name>`; durable (fsynced) when this returns."""
        check_file_name(name)
        source = tensors if isinstance(tensors, TensorSource) else TensorSource(tensors)
        jd = self._job_or_fail()
        dfd = jd.open_dir(writing_dir_name(step, self.writer.tag))
        try:
            size, digest = write_safetensors(name, source, checksum=self.checksum, dir_fd=dfd, where=jd.path)
        finally:
            os.close(dfd)
        return FileRecord(name=name, size=size, checksum=self.checksum, digest=digest, rank=rank)

    def commit(self, step: int, manifest: Mapping[str, Any]) -> None:
        """Write the manifest, rename the step into place (the commit point), then LATEST, then retention.

        StaleWriter, before anything is committed or deleted, when another
        incarnation writes this job directory now. An OSError (a full disk, a
        non-directory where the step goes) leaves the step uncommitted.
        """
        jd = self._job_or_fail()
        self._check_writer(jd, f"commit step {step}")
        writing = writing_dir_name(step, self.writer.tag)
        body = dict(manifest)
        body["format"] = FORMAT
        body["step"] = int(step)
        listed = {rec["name"] for rec in body.get("files", ())} | {protocol.MANIFEST_FILE}
        dfd = jd.open_dir(writing)
        try:
            # Whatever the manifest does not list is a leftover of a killed process of this
            # incarnation (its temp files): a committed step holds exactly its files.
            for leftover in set(jd.names(dfd)) - listed:
                jd.unlink_quietly(dfd, leftover)
            # The data files were renamed into place by other ranks; one directory
            # fsync here makes all of their names durable before the manifest exists.
            fsync_fd(dfd)
            jd.write_atomic(dfd, protocol.MANIFEST_FILE, _dump(body))
        finally:
            os.close(dfd)
        self._check_writer(jd, f"commit step {step}")
        self._rename_into_place(jd, step, writing, body)
        self._writing.discard(step)
        self._last_commit = step if self._last_commit is None else max(self._last_commit, step)
        # LATEST is moved only by the current writer: a committer frozen after the check above and woken
        # once the next incarnation took over stops here, instead of pointing LATEST back at its older step.
        self._check_writer(jd, f"point {protocol.LATEST_FILE} at step {step}")
        # LATEST's directory fsync also makes the step's rename durable.
        jd.write_atomic(jd.fd, protocol.LATEST_FILE, (protocol.step_dir_name(step) + "\n").encode())
        self.apply_retention()

    def _rename_into_place(self, jd: JobDir, step: int, writing: str, body: Mapping[str, Any]) -> None:
        final = protocol.step_dir_name(step)
        try:
            os.rename(writing, final, src_dir_fd=jd.fd, dst_dir_fd=jd.fd)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                # ENOTDIR: a file or a link sits where the step goes; it is never replaced or followed.
                raise OSError(exc.errno, f"cannot commit: {exc.strerror}", jd.where(final)) from None
        if not self._is_committed(jd, final):
            # An uncommitted leftover under the final name (a crash halfway through retention): collect it.
            jd.remove_tree(final)
            os.rename(writing, final, src_dir_fd=jd.fd, dst_dir_fd=jd.fd)
            return
        try:
            existing = self.read_manifest(step)
        except CheckpointError as exc:
            # A damaged step of that number: this complete one takes its place.
            log.warning("replacing damaged checkpoint %s: %s", jd.where(final), exc)
            aside = writing_dir_name(step, self.writer.tag + "-damaged")
            jd.remove_tree(aside)
            os.rename(final, aside, src_dir_fd=jd.fd, dst_dir_fd=jd.fd)
            os.rename(writing, final, src_dir_fd=jd.fd, dst_dir_fd=jd.fd)
            jd.remove_tree(aside)
            return
        if all(existing.get(k) == body.get(k) for k in ("samples_consumed", "global_batch", "model_fingerprint")):
            # The same step of the same run (checkpoint_now right after a periodic checkpoint, or a
            # resume that commits the step it restored): that state is committed already.
            log.debug("step %d is committed already; keeping %s", step, jd.where(final))
            jd.remove_tree(writing)
            return
        raise FileExistsError(errno.EEXIST, "a different committed step of that number exists", jd.where(final))

    def discard_step(self, step: int) -> None:
        """Remove this incarnation's uncommitted directory of `step` (after a failed write); nothing else."""
        self._writing.discard(step)
        jd = self._job(create=False)
        if jd is not None:
            jd.remove_tree(writing_dir_name(step, self.writer.tag))

    def apply_retention(self) -> None:
        """Keep the newest `keep` committed steps at or below this writer's newest commit; collect leftovers.

        Only the current writer collects (StaleWriter otherwise), and never a step
        newer than its own newest commit: that may be another incarnation's.
        """
        jd = self._job(create=False)
        if jd is None:
            return
        self._check_writer(jd, "delete old checkpoints")
        committed = self.committed_steps()
        bound = self._last_commit if self._last_commit is not None else (committed[0] if committed else None)
        below = [s for s in committed if bound is not None and s <= bound]
        for step in below[self.keep:]:
            name = protocol.step_dir_name(step)
            # Un-commit first: rmtree removes files in directory order, and a crash halfway must
            # leave an uncommitted leftover (ignored, collected later), never a manifest whose files are gone.
            try:
                dfd = jd.open_dir(name)
            except (OSError, CheckpointError):
                continue
            try:
                jd.unlink_quietly(dfd, protocol.MANIFEST_FILE)
            finally:
                os.close(dfd)
            jd.remove_tree(name)
        newest = below[0] if below else None
        if newest is None:
            return
        for name in jd.names():
            st = jd.lstat(name)
            if st is None:
                continue
            step = protocol.parse_step_dir_name(name)
            writing = parse_writing_dir_name(name)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                # Uncommitted directories older than the newest commit are leftovers of failed,
                # interrupted or stale writes; newer ones may still be in progress.
                if step is not None and step < newest and step not in committed:
                    jd.remove_tree(name)
                elif writing is not None and writing[0] < newest and self._is_dead_writing(writing[1], st):
                    jd.remove_tree(name)
            elif stat.S_ISREG(st.st_mode) and name.startswith(_OWN_TEMPS) and f".tmp-{os.getpid()}-" not in name:
                # A LATEST or owner-file temp of a writer killed mid-write (this one is the writer now).
                jd.unlink_quietly(jd.fd, name)

    def _is_dead_writing(self, tag: str, st: os.stat_result) -> bool:
        """Whether a writing directory's incarnation can no longer commit it: this one (an aborted
        write), an older incarnation of the same job (fenced off), or one untouched for hours.
        A newer incarnation's may be in flight while it has not claimed the directory yet."""
        me = self.writer
        if tag == me.tag or tag.startswith(me.tag + "-"):   # this incarnation's (or a damaged step it moved aside)
            return True
        job, _, restart = tag.rpartition(".r")
        my_job = me.tag.rpartition(".r")[0]
        if job == my_job and restart.isdigit():
            return int(restart) < me.restart_count
        return time.time() - st.st_mtime > ABANDONED_AFTER_S

    def write_job_file(self, name: str, data: bytes) -> None:
        """Replace `name` in the job directory with `data` through the verified handle (temp name, fsync,
        rename; a link at `name` is replaced, never followed): the job's word to the controller (geometry,
        batch range, peer-lost report, ACK). Any rank may write these; no writer check (they are not state)."""
        if not name or "/" in name or name in (".", ".."):
            raise CheckpointError(f"{name!r} is not a file name in the job directory")
        jd = self._job(create=True)
        assert jd is not None
        jd.write_atomic(jd.fd, name, data)

    def append_metrics(self, row: MetricsRow) -> None:
        line = row.to_line()
        jd = self._job(create=True)
        assert jd is not None
        # 0600 like every other file of the job: the umask would leave it readable by others.
        fd = os.open(protocol.METRICS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     FILE_MODE, dir_fd=jd.fd)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    # -- reading ---------------------------------------------------------------------------
    def _check_model(self, step: int, manifest: dict, model_fingerprint: str | None) -> None:
        """A checkpoint of another model is an error, never a silent fallback to an older step."""
        if model_fingerprint is not None and manifest["model_fingerprint"] != model_fingerprint:
            raise CheckpointError(
                f"{self.step_path(step)} was written by a different model (fingerprint "
                f"{manifest['model_fingerprint'][:12]} != {model_fingerprint[:12]}); point "
                f"{protocol.CKPT_DIR_ENV} elsewhere or remove that directory")

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def _is_committed(self, jd: JobDir, name: str) -> bool:
        try:
            dfd = jd.open_dir(name)
        except (OSError, CheckpointError) as exc:
            if not isinstance(exc, FileNotFoundError):
                self._warn_once(name, "ignoring %s: %s", jd.where(name), exc)
            return False
        try:
            st = jd.lstat(protocol.MANIFEST_FILE, dfd)
            return st is not None and stat.S_ISREG(st.st_mode)
        finally:
            os.close(dfd)

    def committed_steps(self) -> list[int]:
        """Steps with a manifest, newest first (checksums not yet verified). Links and other
        users' entries are not steps."""
        jd = self._job(create=False)
        if jd is None:
            return []
        steps = []
        for name in jd.names():
            step = protocol.parse_step_dir_name(name)
            if step is not None and self._is_committed(jd, name):
                steps.append(step)
        return sorted(steps, reverse=True)

    def latest_pointer(self) -> int | None:
        """The step LATEST names; None when it is missing or not a step name (restore scans anyway)."""
        jd = self._job(create=False)
        if jd is None:
            return None
        try:
            data = jd.read_file(jd.fd, protocol.LATEST_FILE, jd.where(protocol.LATEST_FILE), limit=_LATEST_MAX_BYTES)
            return protocol.parse_step_dir_name(data.decode("ascii").strip())
        except (OSError, CheckpointError, UnicodeDecodeError) as exc:
            if not isinstance(exc, FileNotFoundError):
                self._warn_once("LATEST", "ignoring %s: %s", jd.where(protocol.LATEST_FILE), exc)
            return None

    @contextmanager
    def _step_dir(self, step: int) -> Iterator[tuple[JobDir, int, str]]:
        """The committed directory of `step`, or the one this store is still writing it in."""
        jd = self._job(create=False)
        if jd is None:
            raise CheckpointError(f"{self.step_path(step)}: missing (no job directory)")
        name = protocol.step_dir_name(step)
        try:
            try:
                dfd = jd.open_dir(name)
            except FileNotFoundError:
                if step not in self._writing:
                    raise
                name = writing_dir_name(step, self.writer.tag)
                dfd = jd.open_dir(name)
        except OSError as exc:
            raise CheckpointError(f"{jd.where(name)}: missing or unreadable ({exc.strerror})") from None
        try:
            yield jd, dfd, jd.where(name)
        finally:
            os.close(dfd)

    def read_manifest(self, step: int) -> dict[str, Any]:
        with self._step_dir(step) as (jd, dfd, where):
            path = os.path.join(where, protocol.MANIFEST_FILE)
            try:
                data = jd.read_file(dfd, protocol.MANIFEST_FILE, path, limit=MANIFEST_MAX_BYTES)
            except OSError as exc:
                raise CheckpointError(f"{path}: unreadable manifest ({exc.strerror})") from None
        manifest = parse_json(data, path)
        validate_manifest(manifest, path)
        if manifest["step"] != step:
            raise CheckpointError(f"{path}: manifest says step {manifest['step']} but lives in "
                                  f"{protocol.step_dir_name(step)}")
        return manifest

    def verify(self, step: int) -> dict[str, Any]:
        """The manifest of `step` after checking every file's size and checksum."""
        manifest = self.read_manifest(step)
        for rec in manifest["files"]:
            self._read_verified(step, rec)
        return manifest

    def _notice_latest(self, chosen: int | None) -> None:
        latest = self.latest_pointer()
        if latest is not None and (chosen is None or latest > chosen):
            log.warning("%s names %s, which is missing or damaged; restoring %s", protocol.LATEST_FILE,
                        protocol.step_dir_name(latest),
                        "nothing (a fresh start)" if chosen is None else protocol.step_dir_name(chosen))

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
            self._notice_latest(step)
            return CompleteStep(step=step, path=self.step_path(step), manifest=manifest)
        self._notice_latest(None)
        return None

    def candidates(self, *, model_fingerprint: str | None = None) -> list[int]:
        """Committed steps, newest first, whose manifest is sound and whose files have the listed
        sizes. Cheap (no reading of data); `read_tensors` checks the checksums while loading."""
        out = []
        for step in self.committed_steps():
            try:
                manifest = self.read_manifest(step)
                with self._step_dir(step) as (jd, dfd, where):
                    for rec in manifest["files"]:
                        path = os.path.join(where, rec["name"])
                        try:
                            size = jd.stat_file(dfd, rec["name"], path).st_size
                        except OSError:
                            raise CheckpointError(f"{path}: missing") from None
                        if size != rec["size"]:
                            raise CheckpointError(f"{path}: size {size} != {rec['size']} in the manifest (truncated?)")
            except CheckpointError as exc:
                log.warning("skipping damaged checkpoint: %s", exc)
                continue
            self._check_model(step, manifest, model_fingerprint)
            out.append(step)
        self._notice_latest(out[0] if out else None)
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
        validate_file_record(rec, f"step {step}")
        name = rec["name"]
        with self._step_dir(step) as (jd, dfd, where):
            path = os.path.join(where, name)
            try:
                # Never more than the manifest's size: a planted huge file is refused unread.
                data = jd.read_file(dfd, name, path, limit=rec["size"])
            except OSError as exc:
                raise CheckpointError(f"{path}: missing or unreadable ({exc.strerror})") from None
        if len(data) != rec["size"]:
            raise CheckpointError(f"{path}: size {len(data)} != {rec['size']} in the manifest (truncated?)")
        for algo in CHECKSUMS:
            if algo in rec and CHECKSUMS[algo](data).hexdigest() != rec[algo]:
                raise CheckpointError(f"{path}: {algo} mismatch (damaged)")
        check_safetensors_layout(data, path)
        return data


def make_private_dirs(path: str) -> None:
    """mkdir -p with 0700 on every directory this call creates; the last one must be this user's
    own and not writable by others (UnsafeJobDir otherwise: it is never used as it is)."""
    open_private_dir(path)


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


def write_safetensors(path: str, source: TensorSource, *, checksum: str = DEFAULT_CHECKSUM, dir_fd: int | None = None,
                      where: str | None = None) -> tuple[int, str]:
    """Write the safetensors format from the tensors' memory through one page-aligned
    staging buffer: hashed while it is hot in cache, written with O_DIRECT.

    O_DIRECT keeps checkpoints out of the page cache: a checkpoint every step would
    otherwise dirty gigabytes of cache per step, and the kernel's reclaim and
    writeback of it cost training several times the copy into the buffer. A
    filesystem that refuses O_DIRECT (ramfs, tmpfs before Linux 6.6, some FUSE mounts) is written through
    the page cache, with a warning once per directory. The copies into the buffer,
    os.write and the hash all release the GIL.

    With `dir_fd`, `path` is a name in that directory (nothing is reached through a
    link); `where` names the directory in the warning.
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
    # The warning about O_DIRECT names the job directory: once per job, not per step.
    where = where or os.path.dirname(os.path.dirname(os.path.abspath(path)))
    tmp = temp_name(path)
    fd = _open_for_data(tmp, dir_fd, where)
    out = _StagedFile(fd, digest, where)
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
        _unlink_quietly(tmp, dir_fd)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        _unlink_quietly(tmp, dir_fd)
        raise
    return len(prefix) + offset, digest.hexdigest()


_NO_DIRECT_WARNED: set[str] = set()


def _open_for_data(path: str, dir_fd: int | None, where: str) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_DIRECT, FILE_MODE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    _warn_no_direct(where, "open")
    # Some filesystems (ramfs) create the file before refusing O_DIRECT; the name is this
    # process's own temp name, so opening it again without O_EXCL is safe.
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE,
                   dir_fd=dir_fd)


def _warn_no_direct(where: str, how: str) -> None:
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

    def __init__(self, fd: int, digest: Any, where: str) -> None:
        self.fd = fd
        self.digest = digest
        self.where = where
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
            _warn_no_direct(self.where, "write")
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
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str, dir_fd: int | None = None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass


def _dump(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")
