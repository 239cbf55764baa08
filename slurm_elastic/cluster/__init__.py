"""Slurm as the controller sees it: the model, the Backend protocol and its implementations."""

from slurm_elastic.cluster.backend import Backend, SubmitDescription
from slurm_elastic.cluster.model import ClusterState, Job, JobState, Node, NodeFlag, NodeState, Resources
from slurm_elastic.cluster.shape import RequestShape

__all__ = ["Backend", "SubmitDescription", "ClusterState", "Job", "JobState", "Node", "NodeFlag",
           "NodeState", "RequestShape", "Resources"]
