"""Speed models for traces without measured profiles: linear, Amdahl, and a measured speedup table."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from slurm_elastic.errors import TraceError


@dataclass(frozen=True, slots=True)
class AmdahlSpeed:
    """Speed relative to one GPU: Amdahl's law with a serial fraction, and a per-extra-node slowdown.

    `serial_fraction=0` and `node_penalty=0` is perfectly linear scaling.
    One work unit is one second of running on one GPU.
    """

    serial_fraction: float = 0.0
    node_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.serial_fraction < 1:
            raise TraceError(f"serial fraction must be in [0, 1), got {self.serial_fraction!r}")
        if not 0 <= self.node_penalty < 1:
            raise TraceError(f"node penalty must be in [0, 1), got {self.node_penalty!r}")

    def __call__(self, placement: tuple[int, ...]) -> float:
        gpus = sum(placement)
        if gpus <= 0:
            return 0.0
        s = self.serial_fraction
        speedup = 1.0 / (s + (1.0 - s) / gpus)
        return speedup * (1.0 - self.node_penalty) ** max(0, len(placement) - 1)


@dataclass(frozen=True, slots=True)
class TableSpeed:
    """Measured speedups at some GPU counts (relative to one GPU), linear in between, flat beyond the last.

    Written in traces as `1:1;2:1.9;4:3.5;8:6` (commas also work inside a quoted field); a count below the first point
    scales linearly from zero.
    """

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise TraceError("a speedup table needs at least one point")
        last_g = 0
        for g, s in self.points:
            if g <= last_g or not math.isfinite(s) or s <= 0:
                raise TraceError(f"speedup table points must have increasing GPU counts and positive "
                                 f"speedups, got {self.points!r}")
            last_g = g

    @classmethod
    def parse(cls, text: str) -> TableSpeed:
        points = []
        for part in text.replace(";", ",").split(","):
            part = part.strip()
            if not part:
                continue
            g, sep, s = part.partition(":")
            try:
                if not sep:
                    raise ValueError
                points.append((int(g), float(s)))
            except ValueError:
                raise TraceError(f"bad speedup point {part!r} (expected GPUS:SPEEDUP, e.g. '1:1;2:1.9;4:3.5')") from None
        return cls(tuple(points))

    def __call__(self, placement: tuple[int, ...]) -> float:
        gpus = sum(placement)
        if gpus <= 0:
            return 0.0
        counts = [g for g, _ in self.points]
        i = bisect.bisect_left(counts, gpus)
        if i < len(counts) and counts[i] == gpus:
            return self.points[i][1]
        if i == 0:
            g0, s0 = self.points[0]
            return s0 * gpus / g0
        if i == len(counts):
            return self.points[-1][1]
        (g0, s0), (g1, s1) = self.points[i - 1], self.points[i]
        return s0 + (s1 - s0) * (gpus - g0) / (g1 - g0)
