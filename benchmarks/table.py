"""How every benchmark prints its rows: an aligned table for people, or `--json`, a JSON list for tools.

Rows are dicts whose keys carry their unit (`wall_s`, `size_mb`); the table's
columns are the keys of the rows in first-seen order unless chosen.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Iterable[str] | None = None) -> str:
    names = list(columns) if columns is not None else list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_cell(row.get(name)) for name in names] for row in rows]
    widths = [max([len(name), *(len(r[i]) for r in cells)]) for i, name in enumerate(names)]
    numeric = [all(isinstance(row.get(name), (int, float)) or row.get(name) is None for row in rows)
               for name in names]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(names), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def print_rows(rows: Sequence[dict[str, Any]], as_json: bool, columns: Iterable[str] | None = None,
               title: str | None = None) -> None:
    """Print rows as JSON (a list, nothing else on stdout) or as a table under an optional title."""
    if as_json:
        print(json.dumps(list(rows), indent=1))
        return
    if title:
        print(title)
    print(format_table(rows, columns))


def machine() -> str:
    """What a simulation's figures depend on beyond the code: the same code gave workload 1 (fixed batches)
    2370 s on one machine and 2450 s on another (docs/simulator.md, "One run is one draw"), so runs are
    compared on one machine and this line says which."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    libs = []
    for name in ("highspy", "numpy"):
        try:
            libs.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            libs.append(f"{name} not installed")
    return f"machine: {cpu}, Python {platform.python_version()}, " + ", ".join(libs)
