"""The metrics row a job appends to `metrics.jsonl`, its one writer, and the file's bounded incremental reader."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields

from slurm_elastic.errors import JobFileRefused
from slurm_elastic.jobfiles.reading import field_float, field_int, load_json, open_user_file
from slurm_elastic.jobfiles.records import MAX_BATCH, MAX_STEP, MAX_TIME, MAX_WORLD

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 1 << 14
"""A row is a few hundred bytes; a longer line is not the shim's and is dropped (so is a partial line
growing past it, which keeps what the reader holds between reads bounded)."""

MAX_ROW_DEPTH = 2


@dataclass(frozen=True, slots=True)
class MetricsRow:
    """One line of `metrics.jsonl`: what the job measured since its previous row.

    grad_sqr (|E g|^2) and grad_var (the variance of one sample's gradient) come as a pair or not at all.
    """

    step: int
    time: float                        # unix time of the row
    gpus: int
    steps_per_s: float                 # over the window since the previous row (or since the restart)
    nodes: int = 1
    total_steps: int | None = None
    samples_per_s: float | None = None
    batch: int | None = None           # the global batch the steps were taken at
    grad_sqr: float | None = None
    grad_var: float | None = None
    in_place: int | None = None        # 1 on the first row after the ranks went on in their processes (a
                                       # regroup): the time since the previous row did no steps on that path

    def __post_init__(self) -> None:
        # The writers build rows from their own numbers; a row its reader would refuse is a bug there.
        _checked(self.fields())

    def fields(self) -> dict[str, float | int]:
        """The row's fields that are set (the JSON object of the line)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def to_line(self) -> bytes:
        """The row's line in metrics.jsonl (sorted keys, newline-terminated)."""
        return (json.dumps(self.fields(), sort_keys=True, allow_nan=False) + "\n").encode()

    @classmethod
    def from_value(cls, value: object) -> MetricsRow:
        """The row of one line's JSON value, every field typed and in range; JobFileRefused when not."""
        return cls(**_checked(value))

    @classmethod
    def parse_line(cls, line: bytes | str) -> MetricsRow:
        return cls.from_value(load_json(line, max_depth=MAX_ROW_DEPTH))


def _checked(value: object) -> dict:
    if not isinstance(value, dict):
        raise JobFileRefused("is not a JSON object")
    b = value
    row = dict(step=field_int(b, "step", 0, MAX_STEP), time=field_float(b, "time", 0.0, MAX_TIME),
               gpus=field_int(b, "gpus", 1, MAX_WORLD), steps_per_s=field_float(b, "steps_per_s", 0.0, 1e7),
               nodes=field_int(b, "nodes", 1, MAX_WORLD, optional=True) or 1,
               total_steps=field_int(b, "total_steps", 1, MAX_STEP, optional=True),
               samples_per_s=field_float(b, "samples_per_s", 0.0, 1e12, optional=True),
               batch=field_int(b, "batch", 1, MAX_BATCH, optional=True),
               # per-sample squared norms: any finite size a model's gradients can have
               grad_sqr=field_float(b, "grad_sqr", 0.0, 1e30, optional=True),
               grad_var=field_float(b, "grad_var", 0.0, 1e30, optional=True),
               in_place=field_int(b, "in_place", 1, 1, optional=True))
    if row["nodes"] > row["gpus"]:
        raise JobFileRefused(f"has {row['nodes']} nodes for {row['gpus']} GPUs")
    if (row["grad_sqr"] is None) != (row["grad_var"] is None):
        raise JobFileRefused("has only one of grad_sqr and grad_var")
    return row


def parse_row(value: object) -> MetricsRow | None:
    """The row of a line's JSON value, or None when the reader would refuse it."""
    try:
        return MetricsRow.from_value(value)
    except JobFileRefused:
        return None


@dataclass(slots=True)
class MetricsCursor:
    """Where the reader is in one growing metrics file (it reads only what was appended since).

    `partial` (an unfinished last line) never holds more than MAX_LINE_BYTES.
    """

    inode: tuple[int, int] = (0, 0)
    offset: int = 0
    partial: bytes = b""
    dropping: bool = False             # inside an over-long line: its bytes are skipped up to its newline
    from_start: bool = True            # False: a read skipped the file's beginning
    said_long: bool = False            # an over-long line was logged: later ones are only counted


@dataclass(slots=True)
class MetricsRead:
    """What one read of a metrics file gave."""

    cursor: MetricsCursor
    rows: list[MetricsRow] = field(default_factory=list)
    bad: int = 0                       # lines refused (not JSON, out of range, over-long)
    restarted: bool = False            # a new or truncated file: what was learnt from the old one is void
    absent: bool = False
    problem: str = ""                  # the file was not read (a link, a FIFO, another owner's)


def read_metrics(path: str, *, owner_uid: int | None, max_bytes: int, cursor: MetricsCursor | None = None,
                 dir_fd: int | None = None) -> MetricsRead:
    """The rows appended to `path` since `cursor`, validated; at most `max_bytes` (the newest) per call.

    Never raises for what the file holds: a hostile line is counted in `bad`,
    an over-long one also logged once; a file that cannot be taken in is `problem`.
    """
    cursor = cursor if cursor is not None else MetricsCursor()
    try:
        fd = open_user_file(path, owner_uid=owner_uid, dir_fd=dir_fd)
    except JobFileRefused as exc:
        return MetricsRead(cursor, problem=str(exc))
    if fd is None:
        return MetricsRead(MetricsCursor(), absent=True)
    out = MetricsRead(cursor)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != cursor.inode or st.st_size < cursor.offset:
            out.cursor = cursor = MetricsCursor(inode=(st.st_dev, st.st_ino))   # new or truncated: from the start
            out.restarted = True
        start, skipped = cursor.offset, False
        if st.st_size - start > max_bytes:
            start, skipped = st.st_size - max_bytes, True
        os.lseek(fd, start, os.SEEK_SET)
        data = os.read(fd, min(st.st_size - start, max_bytes))
    finally:
        os.close(fd)
    cursor.offset = start + len(data)
    if skipped:
        cursor.partial, cursor.dropping = b"", True    # the first bytes read end a line that was skipped
        cursor.from_start = False
    lines = data.split(b"\n")
    last = lines.pop()                                  # an unfinished last line waits for the writer
    for i, raw in enumerate(lines):
        if i == 0:
            if cursor.dropping:
                cursor.dropping = False
                if not skipped:
                    _dropped_long(path, out)
                continue
            raw = cursor.partial + raw
            cursor.partial = b""
        _take(raw, path, out)
    if cursor.dropping:
        return out
    pending = (cursor.partial + last) if not lines else last
    if len(pending) > MAX_LINE_BYTES:
        cursor.partial, cursor.dropping = b"", True
    else:
        cursor.partial = pending
    return out


def _dropped_long(path: str, out: MetricsRead) -> None:
    """Count an over-long line; log the first of the file only (a probe's file wrote 64 a cycle)."""
    out.bad += 1
    if not out.cursor.said_long:
        out.cursor.said_long = True
        log.warning("%s: dropped a line longer than %d bytes (further ones are counted, not logged)", path,
                    MAX_LINE_BYTES)


def _take(raw: bytes, path: str, out: MetricsRead) -> None:
    if not raw.strip():
        return
    if len(raw) > MAX_LINE_BYTES:
        _dropped_long(path, out)
        return
    try:
        out.rows.append(MetricsRow.parse_line(raw))
    except JobFileRefused:
        out.bad += 1
