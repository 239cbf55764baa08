"""Slurm's partitions' time limits, as `scontrol -o show partition` prints them, and Slurm's time format."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from slurm_elastic.errors import SpecError

_UNLIMITED = ("UNLIMITED", "INFINITE")
_DURATION = re.compile(r"(?:(?P<d>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+))?")


def parse_duration(text: str, option: str) -> int | None:
    """Slurm's time format in seconds ('90' minutes, 'M:S', 'H:M:S', 'D-H', 'D-H:M', 'D-H:M:S'); None: unlimited."""
    value = text.strip()
    if value.upper() in _UNLIMITED:
        return None
    m = _DURATION.fullmatch(value)
    if m is None:
        raise SpecError(f"{option} {text!r}: expected minutes, M:S, H:M:S, D-H, D-H:M or D-H:M:S")
    days, a, b, c = (int(g) if g is not None else None for g in m.group("d", "a", "b", "c"))
    if days is not None:      # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = a, b or 0, c or 0
        total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    elif c is not None:       # H:M:S
        total = (a * 60 + b) * 60 + c
    elif b is not None:       # M:S
        total = a * 60 + b
    else:                     # minutes
        total = a * 60
    return total


@dataclass(frozen=True, slots=True)
class PartitionTimes:
    """One partition's time limits as `scontrol show partition` gives them (seconds; None: none / unlimited)."""

    name: str
    default_s: int | None
    max_s: int | None
    is_default: bool = False


_FIELD = re.compile(r"(?:^|\s)(PartitionName|Default|DefaultTime|MaxTime)=(\S*)")


def parse_partitions(text: str) -> tuple[PartitionTimes, ...]:
    """`scontrol -o show partition` (one line per partition, the same on every Slurm from 22.05 on)."""
    out = []
    for line in text.splitlines():
        fields = dict(_FIELD.findall(line))
        if "PartitionName" not in fields:
            continue
        times = {}
        for key in ("DefaultTime", "MaxTime"):
            raw = fields.get(key, "NONE")
            times[key] = None if raw.upper() in ("NONE", "N/A", "") else parse_duration(raw, key)
        out.append(PartitionTimes(fields["PartitionName"], times["DefaultTime"], times["MaxTime"],
                                  fields.get("Default", "NO").upper() == "YES"))
    return tuple(out)


@runtime_checkable
class PartitionReader(Protocol):
    """A backend that can read the partitions' time limits (the wrapper checks a job's --time against them)."""

    def partition_times(self) -> tuple[PartitionTimes, ...]: ...
