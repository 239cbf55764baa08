"""The trace-driven what-if simulator and its baseline policies."""

from __future__ import annotations

from slurm_elastic.sim.cluster import FailureSchedule, NodeEvent, SimNode, parse_cluster, parse_failures
from slurm_elastic.sim.engine import RestartModel, SimConfig, SimResult, Simulation
from slurm_elastic.sim.jobs import SimJob
from slurm_elastic.sim.metrics import summarize
from slurm_elastic.sim.registry import POLICIES, make_policy

__all__ = [
    "FailureSchedule", "NodeEvent", "POLICIES", "RestartModel", "SimConfig", "SimJob", "SimNode",
    "SimResult", "Simulation", "make_policy", "parse_cluster", "parse_failures", "summarize",
]
