"""What the running daemon says of each user's jobs, for that user's `status`.

A user's `status` otherwise decides again in a dry run of its own, which
cannot read the daemon's journal: it knows no hysteresis under way, no node
kept off a job after its report, no size the job ran at before, and says
less than `admin rebalance --explain`. The daemon writes, after each cycle,
one file per user, `<daemon dir>/notes/<uid>.json`, with its note for each
of that user's jobs.

The file is owned by that user (mode 0400) in a directory only root writes
(0711: nobody lists whose files are there), so no user reads another's notes;
the daemon only ever replaces it, never reads it. What its owner may write
into it changes that owner's own view only.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import time
from pathlib import Path
from typing import Mapping

from slurm_elastic.control.state_dir import replace_file
from slurm_elastic.errors import JobFileRefused
from slurm_elastic.jobfiles import load_json, read_user_file

log = logging.getLogger(__name__)

NOTES_DIR = "notes"
NOTES_DIR_MODE = 0o711
MAX_NOTES_BYTES = 1 << 20


def write_notes(directory: Path, notes: Mapping[str, Mapping[int, str]], at: float) -> None:
    """Replace each user's notes file with `notes[user]` (job id -> note) as of `at`; remove the files of
    users with no job now. Only root can give each user a file of their own: otherwise nothing is written."""
    if os.geteuid() != 0:
        return
    path = directory / NOTES_DIR
    path.mkdir(mode=NOTES_DIR_MODE, exist_ok=True)
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(dir_fd, NOTES_DIR_MODE)
        keep = set()
        for user, jobs in notes.items():
            try:
                entry = pwd.getpwnam(user)
            except KeyError:
                continue
            name = f"{entry.pw_uid}.json"
            keep.add(name)
            body = json.dumps({"at": at, "notes": {str(job_id): note for job_id, note in jobs.items()}})
            replace_file(dir_fd, name, body.encode()[:MAX_NOTES_BYTES], 0o400, (entry.pw_uid, entry.pw_gid))
        for name in os.listdir(dir_fd):
            if name.endswith(".json") and name not in keep:
                os.unlink(name, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def read_notes(directory: Path, uid: int, *, max_age_s: float, now: float | None = None) -> dict[int, str] | None:
    """The daemon's notes on the jobs of user `uid`, if its file is that user's, whole and recent (written
    within `max_age_s`, not in the future); else None, and the caller decides in a dry run of its own."""
    now = time.time() if now is None else now
    try:
        data = read_user_file(str(directory / NOTES_DIR / f"{uid}.json"), owner_uid=uid, max_bytes=MAX_NOTES_BYTES,
                              what="notes file")
    except (JobFileRefused, OSError):
        return None
    if data is None:
        return None
    try:
        doc = load_json(data)
        at, notes = float(doc["at"]), doc["notes"]          # type: ignore[index]
        if not now - max_age_s <= at <= now + 5.0 or not isinstance(notes, dict):
            return None
        return {int(job_id): str(note) for job_id, note in notes.items()}
    except (JobFileRefused, ValueError, KeyError, TypeError, AttributeError):
        return None
