"""Request shapes Slurm understands: a GPU count as nodes x GPUs per node, with CPUs and memory per GPU.

Slurm's `--gres=gpu:G` is per node, so a job spanning nodes gets the same G on
every node. The rule used everywhere in the allocator (solver, placement pass,
brute-force tests):

- one node: any allowed count that fits the node;
- several nodes: the same GPUs on every node, and with
  `Policy.whole_nodes_when_spanning` (the default) each node's every elastic
  GPU, so a 6-GPU job on 4-GPU nodes is not allowed (2 x 3 would leave a
  GPU stranded on each node); without it 2 x 3 is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from slurm_elastic.errors import AllocationError


@dataclass(frozen=True, slots=True)
class JobShape:
    """What the controller asks Slurm for: `nodes` x `gpus_per_node`, CPUs and memory per GPU."""

    nodes: int
    gpus_per_node: int
    cpus_per_gpu: int
    mem_per_gpu_mb: int
    nodelist: tuple[str, ...] = ()

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def sbatch_args(self) -> tuple[str, ...]:
        """The request as sbatch/scontrol options (`--gres` per node, which every Slurm since 22.05 accepts)."""
        return (f"--nodes={self.nodes}", f"--gres=gpu:{self.gpus_per_node}",
                f"--cpus-per-gpu={self.cpus_per_gpu}", f"--mem-per-gpu={self.mem_per_gpu_mb}M")


def placement_is_valid_shape(placement: Mapping[str, int], node_gpus: Mapping[str, int],
                             whole_nodes_when_spanning: bool) -> bool:
    """True when the per-node GPU counts form a shape Slurm can express (see module docstring)."""
    used = {n: g for n, g in placement.items() if g > 0}
    if len(used) <= 1:
        return True
    counts = set(used.values())
    if len(counts) != 1:
        return False
    if whole_nodes_when_spanning:
        return all(node_gpus.get(n, 0) == g for n, g in used.items())
    return True


def shape_of(placement: Mapping[str, int], cpus_per_gpu: int, mem_per_gpu_mb: int) -> JobShape | None:
    """The Slurm shape of a placement (None for a job that gets nothing)."""
    used = {n: g for n, g in placement.items() if g > 0}
    if not used:
        return None
    counts = set(used.values())
    if len(counts) != 1:
        raise AllocationError(f"placement {dict(used)} has unequal GPUs per node; Slurm's --gres is per node")
    return JobShape(nodes=len(used), gpus_per_node=counts.pop(), cpus_per_gpu=int(cpus_per_gpu),
                    mem_per_gpu_mb=int(mem_per_gpu_mb), nodelist=tuple(sorted(used)))


def spanning_widths(gpus: int, node_sizes: set[int], whole_nodes_when_spanning: bool) -> list[int]:
    """GPUs per node W (largest first) with which `gpus` can span >= 2 nodes."""
    if whole_nodes_when_spanning:
        widths = [w for w in node_sizes if w > 0 and gpus % w == 0 and gpus // w >= 2]
    else:
        widths = [w for w in range(1, gpus // 2 + 1) if gpus % w == 0]
    return sorted(widths, reverse=True)
