"""What the local cluster looks like now: node and cluster status, and `scontrol -o` text parsing."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# States in which a node has registered and can run jobs.
_SERVING = {"IDLE", "MIXED", "ALLOCATED", "COMPLETING"}
_NOT_SERVING_FLAGS = {"NOT_RESPONDING", "DRAIN", "FAIL", "POWERED_DOWN", "POWERING_DOWN"}


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """One node as Slurm and the process table see it."""

    name: str
    state: str  # Slurm's State=, e.g. IDLE, MIXED, DOWN+NOT_RESPONDING; STOPPED when slurmctld is not running
    gpus: int
    cpus: int
    memory_mb: int
    port: int
    spare: bool
    started: bool  # its slurmd is running
    slurmd_pid: int | None
    reason: str | None

    @property
    def serving(self) -> bool:
        """Registered and schedulable (IDLE/MIXED/ALLOCATED, not DOWN, not responding or drained)."""
        return node_state_serving(self.state)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "gpus": self.gpus,
            "cpus": self.cpus,
            "memory_mb": self.memory_mb,
            "port": self.port,
            "spare": self.spare,
            "started": self.started,
            "slurmd_pid": self.slurmd_pid,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """The whole local cluster: what `status --json` prints."""

    state_dir: Path
    slurm_conf: Path
    slurm_version: str
    running: bool  # slurmctld is running
    controller_pid: int | None
    controller_port: int
    munged_pid: int | None
    env_file: Path
    nodes: tuple[NodeStatus, ...]

    def node(self, name: str) -> NodeStatus:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "state_dir": str(self.state_dir),
            "slurm_conf": str(self.slurm_conf),
            "slurm_version": self.slurm_version,
            "running": self.running,
            "controller_pid": self.controller_pid,
            "controller_port": self.controller_port,
            "munged_pid": self.munged_pid,
            "env_file": str(self.env_file),
            "nodes": [node.to_dict() for node in self.nodes],
        }


def node_state_serving(state: str) -> bool:
    parts = state.upper().split("+")
    return parts[0] in _SERVING and not _NOT_SERVING_FLAGS.intersection(parts[1:])


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One `scontrol -o show ...` line -> {key: value}; the text format is the same on every version."""
    fields: dict[str, str] = {}
    # Values (Reason=...) may contain spaces; a new field starts at " Key=".
    for token in re.split(r" (?=[A-Za-z][A-Za-z0-9_:/]*=)", line.strip()):
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


def parse_scontrol_nodes(text: str) -> dict[str, dict[str, str]]:
    """`scontrol -o show node` (one line per node) -> {name: {key: value}}."""
    nodes: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if line.strip().startswith("NodeName="):
            fields = parse_scontrol_record(line)
            nodes[fields["NodeName"]] = fields
    return nodes
