"""Choosing the allocation: the L1-norm multi-resource MILP on HiGHS, Slurm request shapes, throughput models."""

from __future__ import annotations

from slurm_elastic.allocate.explain import render as render_explanation
from slurm_elastic.allocate.problem import (
    Allocation,
    AllocationProblem,
    JobDecision,
    JobRequest,
    NodeCapacity,
    Policy,
    ThroughputModel,
    Unplaceable,
)
from slurm_elastic.allocate.repair import RepairingSolver, repair
from slurm_elastic.allocate.shapes import request_shape, shape_of
from slurm_elastic.allocate.solver import greedy_baseline, solve
from slurm_elastic.allocate.throughput import (
    LinearThroughput,
    PiecewiseThroughput,
    fit_throughput,
    read_metrics,
    table_throughput,
    throughput_from_checkpoints,
)
from slurm_elastic.errors import AllocationError

__all__ = [
    "Allocation", "AllocationError", "AllocationProblem", "JobDecision", "JobRequest",
    "LinearThroughput", "NodeCapacity", "PiecewiseThroughput", "Policy", "RepairingSolver", "ThroughputModel",
    "Unplaceable", "fit_throughput", "greedy_baseline", "read_metrics", "render_explanation", "repair",
    "request_shape", "shape_of",
    "solve", "table_throughput", "throughput_from_checkpoints",
]
