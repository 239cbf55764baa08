"""Reading the simulator's CSV inputs strictly: required columns, numbers, and errors that name file and line."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Iterator

from slurm_elastic.errors import TraceError


def read_rows(path: Path, required: tuple[str, ...], *, delimiter: str = ",") -> Iterator[tuple[int, dict[str, str]]]:
    """Yield (line number, row) of a headed CSV, after checking the header has every required column."""
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    with handle:
        reader = csv.DictReader(handle, delimiter=delimiter)
        header = [h.strip() for h in (reader.fieldnames or [])]
        if not header:
            raise TraceError(f"{path}: empty file (expected a header with columns {', '.join(required)})")
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)} "
                             f"(found {', '.join(header)})")
        reader.fieldnames = header
        for row in reader:
            if None in row:
                raise TraceError(f"{path}:{reader.line_num}: more fields than the header has "
                                 f"({len(header)}); quote fields that contain the delimiter")
            yield reader.line_num, {k: (v or "").strip() for k, v in row.items() if k is not None}


def number(path: Path, line: int, column: str, text: str, *, minimum: float | None = 0.0) -> float:
    """A finite float from a cell, >= minimum when one is given."""
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{path}:{line}: column {column} is not a number: {text!r}") from None
    if not math.isfinite(value):
        raise TraceError(f"{path}:{line}: column {column} must be finite, got {text!r}")
    if minimum is not None and value < minimum:
        raise TraceError(f"{path}:{line}: column {column} must be >= {minimum:g}, got {text!r}")
    return value


def integer(path: Path, line: int, column: str, text: str, *, minimum: int = 1) -> int:
    value = number(path, line, column, text, minimum=None)
    if value != int(value) or value < minimum:
        raise TraceError(f"{path}:{line}: column {column} must be an integer >= {minimum}, got {text!r}")
    return int(value)
