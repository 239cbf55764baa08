"""Who writes a job directory: one incarnation of the job at a time, named in its owner file (a fencing token).

Two trainers can share a job key: a zombie incarnation on a partitioned node
after Slurm requeued the job elsewhere, or a job key reused on purpose. File
locks cannot be assumed on Lustre/GPFS, so the job directory holds
`writer.json`, written atomically by the incarnation that writes it now
(job id, restart count, a random id of the process). A newer incarnation
takes it over when it starts; every writer reads it again right before it
commits a step or deletes anything, and a writer that finds another there is
stale: it stops with StaleWriter instead of committing or deleting.
An incarnation of the same job with a lower restart count never takes over
from a higher one (it is the zombie, however late it starts).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from slurm_elastic.errors import CheckpointError
from slurm_elastic.train.jobdir import JobDir
from slurm_elastic.train.manifest import parse_json

log = logging.getLogger(__name__)

OWNER_FILE = "writer.json"
_OWNER_MAX_BYTES = 4096
_TAG_RE = re.compile(r"[^A-Za-z0-9._-]")


class StaleWriter(CheckpointError):
    """Another incarnation writes this job directory now; this one must stop without committing or deleting."""


@dataclass(frozen=True, slots=True)
class Incarnation:
    """One run of a job: its Slurm job id, its restart count, and a random id of the writing process."""

    job_id: str
    restart_count: int
    nonce: str

    @classmethod
    def of(cls, job_id: str, restart_count: int) -> Incarnation:
        """This process as an incarnation of `job_id`; every store of the process shares its random id."""
        return cls(str(job_id), int(restart_count), _process_nonce())

    @classmethod
    def from_environment(cls) -> Incarnation:
        from slurm_elastic.train.environment import JobEnvironment

        env = JobEnvironment.from_env()
        return cls.of(env.job_id, env.restart_count)

    @property
    def tag(self) -> str:
        """A file-name-safe name all ranks of this incarnation compute alike (no random part)."""
        return f"{_TAG_RE.sub('_', self.job_id)[:64]}.r{self.restart_count}"

    def describe(self) -> str:
        return f"job {self.job_id} restart {self.restart_count} ({self.nonce[:8]})"

    def to_json(self) -> dict[str, Any]:
        # host and pid are for the person reading the file; identity is job, restart and nonce.
        return {"job_id": self.job_id, "restart_count": self.restart_count, "nonce": self.nonce,
                "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}

    @classmethod
    def from_json(cls, obj: Any) -> Incarnation | None:
        if not (isinstance(obj, dict) and isinstance(obj.get("job_id"), str) and isinstance(obj.get("nonce"), str)
                and isinstance(obj.get("restart_count"), int) and not isinstance(obj["restart_count"], bool)
                and obj["restart_count"] >= 0):
            return None
        return cls(obj["job_id"], obj["restart_count"], obj["nonce"])


_NONCE: tuple[int, str] | None = None


def _process_nonce() -> str:
    global _NONCE
    if _NONCE is None or _NONCE[0] != os.getpid():   # a forked child is a different writer
        _NONCE = (os.getpid(), secrets.token_hex(8))
    return _NONCE[1]


def read_owner(jd: JobDir) -> Incarnation | None:
    """The incarnation named in the owner file; None when there is none (or it is unreadable)."""
    try:
        data = jd.read_file(jd.fd, OWNER_FILE, jd.where(OWNER_FILE), limit=_OWNER_MAX_BYTES)
        owner = Incarnation.from_json(parse_json(data, jd.where(OWNER_FILE)))
    except FileNotFoundError:
        return None
    except (OSError, CheckpointError) as exc:
        log.warning("ignoring unreadable owner file: %s", exc)
        return None
    if owner is None:
        log.warning("ignoring %s: not an owner record", jd.where(OWNER_FILE))
    return owner


def claim(jd: JobDir, me: Incarnation) -> None:
    """Make `me` the job directory's writer. StaleWriter when a later incarnation of the same job holds it."""
    owner = read_owner(jd)
    if owner == me:
        return
    if owner is not None and owner.job_id == me.job_id and owner.restart_count > me.restart_count:
        raise StaleWriter(f"{jd.path} is written by {owner.describe()}; this process ({me.describe()}) is an "
                          f"older incarnation and stops without writing")
    jd.write_atomic(jd.fd, OWNER_FILE, _owner_bytes(me))
    if owner is not None:
        log.info("%s: %s takes over from %s", jd.path, me.describe(), owner.describe())


def check_still_writer(jd: JobDir, me: Incarnation, action: str) -> None:
    """Before a commit or a deletion: `me` must still be the writer, else StaleWriter."""
    owner = read_owner(jd)
    if owner == me:
        return
    if owner is None:
        # The file is gone (only this user could remove it): claim again, with the same rule.
        claim(jd, me)
        return
    raise StaleWriter(f"{jd.path} is written by {owner.describe()} now; this process ({me.describe()}) is "
                      f"stale and stops before it would {action}")


def _owner_bytes(me: Incarnation) -> bytes:
    import json

    return (json.dumps(me.to_json(), sort_keys=True) + "\n").encode()
