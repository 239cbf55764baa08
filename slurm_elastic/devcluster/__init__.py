"""A real multi-node Slurm on loopback for tests, the demo and newcomers."""

from __future__ import annotations

from slurm_elastic.devcluster.layout import ClusterLayout, NodeSpec, default_state_dir
from slurm_elastic.devcluster.local import ClusterAlreadyUp, LocalCluster, UnknownNode
from slurm_elastic.devcluster.status import ClusterStatus, NodeStatus, node_state_serving
from slurm_elastic.devcluster.version import SlurmVersion, detect_version

__all__ = [
    "ClusterAlreadyUp",
    "ClusterLayout",
    "ClusterStatus",
    "LocalCluster",
    "NodeSpec",
    "NodeStatus",
    "SlurmVersion",
    "UnknownNode",
    "default_state_dir",
    "detect_version",
    "node_state_serving",
]
