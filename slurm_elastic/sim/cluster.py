"""The simulated cluster: node specs (`16x4`, heterogeneous groups) and node failure/repair schedules."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from slurm_elastic.errors import TraceError
from slurm_elastic.sim.tables import number, read_rows

# Per-GPU share of a g4dn.12xlarge (48 vCPU, 192 GiB, 4 T4), where the Pollux traces were measured.
DEFAULT_CPUS_PER_GPU = 12
DEFAULT_MEM_PER_GPU_MB = 48 * 1024


@dataclass(frozen=True, slots=True)
class SimNode:
    name: str
    gpus: int
    cpus: int
    mem_mb: int


def parse_cluster(text: str) -> tuple[SimNode, ...]:
    """`16x4` = 16 nodes of 4 GPUs; groups joined by commas, each `NxG[:CPUS[:MEM_GB]]` (e.g. `8x4,4x8:64:512`)."""
    nodes: list[SimNode] = []
    for group in text.split(","):
        group = group.strip()
        m = re.fullmatch(r"([0-9]+)x([0-9]+)(?::([0-9]+))?(?::([0-9]+))?", group)
        if not m:
            raise TraceError(f"bad cluster spec {group!r} (expected NODESxGPUS[:CPUS[:MEM_GB]], e.g. 16x4 or 8x4,4x8:64:512)")
        count, gpus = int(m.group(1)), int(m.group(2))
        if count < 1 or gpus < 1:
            raise TraceError(f"cluster spec {group!r}: node count and GPUs per node must be >= 1")
        cpus = int(m.group(3)) if m.group(3) else gpus * DEFAULT_CPUS_PER_GPU
        mem = int(m.group(4)) * 1024 if m.group(4) else gpus * DEFAULT_MEM_PER_GPU_MB
        for _ in range(count):
            nodes.append(SimNode(f"n{len(nodes):03d}", gpus, cpus, mem))
    if not nodes:
        raise TraceError("the cluster has no nodes")
    return tuple(nodes)


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """A node goes down at `time_s` for `down_s` seconds (it is repaired after)."""

    time_s: float
    node: str
    down_s: float


@dataclass(frozen=True, slots=True)
class FailureSchedule:
    """Where node failures come from: a fixed list, or one generated from a period or a rate."""

    events: tuple[NodeEvent, ...] = ()
    every_s: float = 0.0          # one failure every every_s (first at every_s)
    mtbf_s: float = 0.0           # or Poisson failures with this mean time between failures (cluster-wide)
    down_s: float = 600.0
    seed: int = 1

    def iterate(self, nodes: tuple[SimNode, ...]) -> Iterator[NodeEvent]:
        """Events in time order; the generated kinds never end (the engine stops when the jobs do)."""
        names = [n.name for n in nodes]
        if self.events:
            unknown = sorted({e.node for e in self.events} - set(names))
            if unknown:
                raise TraceError(f"failure events name unknown node(s) {', '.join(unknown)} "
                                 f"(the cluster has {names[0]} .. {names[-1]})")
            yield from sorted(self.events, key=lambda e: (e.time_s, e.node))
            return
        if self.every_s <= 0 and self.mtbf_s <= 0:
            return
        rng = random.Random(self.seed)
        t = 0.0
        while True:
            t += self.every_s if self.every_s > 0 else rng.expovariate(1.0 / self.mtbf_s)
            yield NodeEvent(t, rng.choice(names), self.down_s)


def parse_failures(text: str | None) -> FailureSchedule:
    """`every:7200:600[:seed]`, `mtbf:36000:600[:seed]` (seconds), or a CSV file `time_s,node,down_s`."""
    if not text:
        return FailureSchedule()
    m = re.fullmatch(r"(every|mtbf):([0-9.]+):([0-9.]+)(?::([0-9]+))?", text.strip())
    if m:
        period, down = float(m.group(2)), float(m.group(3))
        if not (math.isfinite(period) and period > 0 and math.isfinite(down) and down >= 0):
            raise TraceError(f"failure spec {text!r}: period must be > 0 and downtime >= 0 seconds")
        seed = int(m.group(4)) if m.group(4) else 1
        if m.group(1) == "every":
            return FailureSchedule(every_s=period, down_s=down, seed=seed)
        return FailureSchedule(mtbf_s=period, down_s=down, seed=seed)
    path = Path(text)
    if not path.exists():
        raise TraceError(f"failures {text!r}: neither a spec (every:PERIOD_S:DOWN_S, mtbf:MTBF_S:DOWN_S) "
                         f"nor an existing CSV file")
    events = []
    for line, row in read_rows(path, ("time_s", "node", "down_s")):
        if not row["node"]:
            raise TraceError(f"{path}:{line}: empty node name")
        events.append(NodeEvent(number(path, line, "time_s", row["time_s"]), row["node"],
                                number(path, line, "down_s", row["down_s"])))
    return FailureSchedule(events=tuple(events))
