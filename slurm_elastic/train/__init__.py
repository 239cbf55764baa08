"""The torch training shim: elastic session, forward-layer checkpoints, the store and the sampler."""

from __future__ import annotations

from typing import Any

# Lazy exports: importing the package (or a torch-free part of it) must not pull in torch.
_EXPORTS = {
    "ElasticSession": "slurm_elastic.train.session",
    "ElasticLoop": "slurm_elastic.train.prepare",
    "LayerCheckpointer": "slurm_elastic.train.checkpointer",
    "CheckpointStore": "slurm_elastic.train.store",
    "ElasticSampler": "slurm_elastic.train.sampler",
    "BatchGeometry": "slurm_elastic.train.sampler",
    "JobEnvironment": "slurm_elastic.train.environment",
    "Regroup": "slurm_elastic.train.regroup",
}

__all__ = ["BatchGeometry", "CheckpointStore", "ElasticSampler", "ElasticSession", "JobEnvironment", "LayerCheckpointer",
           "Regroup"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'slurm_elastic.train' has no attribute {name!r}")
