"""What the live tests read back from a running job's files: JSON lines (a loss log, metrics) and the ACK of a
commit, each tolerating a file still being written."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_elastic import jobfiles as shim


def json_lines(path: Path) -> list[dict]:
    """Every complete JSON line of `path` ([] while it does not exist; a line being written is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def read_ack(job_dir: Path, job_id: int, restart: int) -> shim.Ack | None:
    """The job's ACK for `restart` (None until it is written whole)."""
    try:
        return shim.Ack.parse(json.loads((job_dir / shim.ack_file_name(job_id, restart)).read_bytes()))
    except (OSError, ValueError):
        return None
