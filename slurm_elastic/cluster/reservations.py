"""Slurm's advance reservations' windows, as `scontrol -o show reservation` prints them.

A job submitted into a reservation may start only inside its window; one requeued after the
window has closed cannot start in it again, so an elastic job's requeues end with its reservation.
A job outside a reservation may start on its nodes only if its time limit ends before the window
opens (an unlimited job: never while the reservation is to come): a maintenance reservation
announced ahead blocks the requeue of every such job on its nodes (`blocking`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Mapping, Protocol, runtime_checkable

from slurm_elastic.cluster.slurm_values import expand_hostlist

_FIELD = re.compile(r"(?:^|\s)(ReservationName|StartTime|EndTime|Nodes|State)=(\S*)")


@dataclass(frozen=True, slots=True)
class AdvanceReservation:
    """One reservation's window (seconds since the epoch; None: Slurm printed no time), its nodes, and
    whether Slurm has it ACTIVE now."""

    name: str
    start_at: float | None
    end_at: float | None
    nodes: tuple[str, ...] = ()
    active: bool = False


def _timestamp(text: str) -> float | None:
    """Slurm's local 'YYYY-MM-DDTHH:MM:SS'; anything else ('Unknown', 'None') is no time."""
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def parse_reservations(text: str) -> tuple[AdvanceReservation, ...]:
    """`scontrol -o show reservation`: one line per reservation; 'No reservations in the system' when none."""
    out = []
    for line in text.splitlines():
        fields = dict(_FIELD.findall(line))
        if "ReservationName" in fields:
            out.append(AdvanceReservation(fields["ReservationName"], _timestamp(fields.get("StartTime", "")),
                                          _timestamp(fields.get("EndTime", "")),
                                          expand_hostlist(fields.get("Nodes")), fields.get("State") == "ACTIVE"))
    return tuple(out)


def open_nodes(windows: Mapping[str, AdvanceReservation] | None, names: str) -> frozenset[str]:
    """The nodes of the named reservations (a comma list) that Slurm has active now: where a job in them may
    start. None windows (not readable) or a closed or unknown reservation: none."""
    out: set[str] = set()
    for name in (n for n in names.split(",") if n):
        window = (windows or {}).get(name)
        if window is not None and window.active:
            out.update(window.nodes)
    return frozenset(out)


# A requeued job starts some time after the controller plans it; its time limit runs from then.
START_SLACK_S = 300.0


def blocking(windows: Mapping[str, AdvanceReservation] | None, own: str, now: float,
             time_limit_s: float | None, slack_s: float = START_SLACK_S) -> dict[str, AdvanceReservation]:
    """Node -> the reservation that keeps a job (re)started now off it: one that is not the job's own
    (`own`, a comma list), not over, and active or opening before the job's time limit would end
    (`time_limit_s` None: unlimited, so any reservation still to come) if it started `slack_s` from now
    (Slurm's own test, at the start, is `slack_s` 0)."""
    mine = {n for n in own.split(",") if n}
    out: dict[str, AdvanceReservation] = {}
    for window in sorted((windows or {}).values(), key=lambda r: (r.start_at or 0.0, r.name)):
        if window.name in mine or (window.end_at is not None and window.end_at <= now):
            continue
        opens = window.start_at
        if window.active or (opens is not None and (time_limit_s is None
                                                    or opens < now + time_limit_s + slack_s)):
            for node in window.nodes:
                out.setdefault(node, window)
    return out


@runtime_checkable
class ReservationReader(Protocol):
    """A backend that can read the reservations (the wrapper says when one ends a job's requeues)."""

    def reservations(self) -> tuple[AdvanceReservation, ...]: ...
