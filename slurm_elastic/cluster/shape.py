"""The request shape: what size a job asks Slurm for, from the solver's answer to the update, journal and status.

One type carries it through every layer (allocate/shapes.py makes it, control/plan.py holds it,
the journal stores it, each backend spells it for its Slurm), so a new field is added once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

from slurm_elastic.errors import ElasticError

_FIELDS = ("nodes", "gpus_per_node", "cpus_per_gpu", "mem_per_gpu_mb")


class ShapeError(ElasticError):
    """A stored request shape (a journal row) is not one this version can act on."""


@dataclass(frozen=True, slots=True)
class RequestShape:
    """`nodes` x `gpus_per_node` GPUs, with CPUs and memory per GPU (Slurm's --gres is per node).

    No node list: a plan names the nodes beside it (control/plan.py `placed_on`, Backend.set_resources).
    """

    nodes: int
    gpus_per_node: int
    cpus_per_gpu: int
    mem_per_gpu_mb: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}"

    def to_json(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name in _FIELDS}

    def dumps(self) -> str:
        """The stored form (the journal's `shape` column): compact JSON with sorted keys."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, value: Mapping[str, object]) -> RequestShape:
        """The shape of a stored mapping; every field an int >= 1 (GPUs per node >= 0), nothing else."""
        if not isinstance(value, Mapping):
            raise ShapeError(f"a request shape must be an object, got {type(value).__name__}")
        if set(value) != set(_FIELDS):
            raise ShapeError(f"a request shape has the fields {', '.join(_FIELDS)}, got {', '.join(sorted(value))}")
        sizes: dict[str, int] = {}
        for name in _FIELDS:
            v = value[name]
            least = 0 if name == "gpus_per_node" else 1   # a job without GPUs is submitted without --gres
            if type(v) is not int or v < least:           # not bool, float or str: the writer wrote ints
                raise ShapeError(f"request shape field {name} must be an integer >= {least}, got {v!r}")
            sizes[name] = v
        return cls(**sizes)

    @classmethod
    def loads(cls, text: str) -> RequestShape:
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise ShapeError(f"a stored request shape is not JSON ({exc}): {str(text)[:80]!r}") from None
        return cls.from_json(value)
