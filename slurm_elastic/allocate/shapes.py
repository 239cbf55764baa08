"""Turning GPU counts into request shapes Slurm understands: nodes x GPUs per node (cluster/shape.py's type).

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

from typing import Mapping

from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.errors import AllocationError
from slurm_elastic.spec import ElasticSpec


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


def shape_of(placement: Mapping[str, int], cpus_per_gpu: int, mem_per_gpu_mb: int) -> RequestShape | None:
    """The Slurm shape of a placement (None for a job that gets nothing)."""
    used = {n: g for n, g in placement.items() if g > 0}
    if not used:
        return None
    counts = set(used.values())
    if len(counts) != 1:
        raise AllocationError(f"placement {dict(used)} has unequal GPUs per node; Slurm's --gres is per node")
    return RequestShape(nodes=len(used), gpus_per_node=counts.pop(), cpus_per_gpu=int(cpus_per_gpu),
                        mem_per_gpu_mb=int(mem_per_gpu_mb))


def spanning_widths(gpus: int, node_sizes: set[int], whole_nodes_when_spanning: bool) -> list[int]:
    """GPUs per node W (largest first) with which `gpus` can span >= 2 nodes."""
    if whole_nodes_when_spanning:
        widths = [w for w in node_sizes if w > 0 and gpus % w == 0 and gpus // w >= 2]
    else:
        widths = [w for w in range(1, gpus // 2 + 1) if gpus % w == 0]
    return sorted(widths, reverse=True)


def never_placeable(spec: ElasticSpec, node_gpus: list[int], whole_nodes_when_spanning: bool) -> str | None:
    """Why no size the job allows has a shape on these nodes even with every GPU free, or None when one has."""
    sizes = {g for g in node_gpus if g > 0}
    biggest = max(sizes, default=0)

    def fits(gpus: int) -> bool:
        if gpus <= biggest:
            return True
        return any(sum(1 for g in node_gpus if (g == w if whole_nodes_when_spanning else g >= w)) >= gpus // w
                   for w in spanning_widths(gpus, sizes, whole_nodes_when_spanning))

    if not sizes or any(fits(g) for g in spec.allowed_gpus()):
        return None
    span = (f"whole nodes ({', '.join(f'{g}' for g in sorted(sizes))} GPUs each; Slurm's --gres is per node)"
            if whole_nodes_when_spanning else "the same GPUs on each of enough nodes")
    return (f"no size it allows ({spec.min_gpus}..{spec.max_gpus} GPUs) fits one node (at most {biggest} GPUs) "
            f"or spans {span}: it can never start on the nodes up now")


def request_shape(spec: ElasticSpec, gpus: int, placement: Mapping[str, int], node_sizes: set[int]) -> RequestShape:
    """The shape for `gpus`: the solver's placement, else the narrowest shape Slurm can express."""
    def shaped(nodes: int, per_node: int) -> RequestShape:
        return RequestShape(nodes=nodes, gpus_per_node=per_node, cpus_per_gpu=spec.cpus_per_gpu,
                            mem_per_gpu_mb=spec.mem_per_gpu_mb)

    if placement:
        s = shape_of(placement, spec.cpus_per_gpu, spec.mem_per_gpu_mb)
        if s is not None and s.gpus == gpus:
            return s
    sizes = {n for n in node_sizes if n > 0} or {gpus}
    if gpus <= max(sizes):
        return shaped(1, gpus)
    widths = spanning_widths(gpus, sizes, True) or spanning_widths(gpus, sizes, False)
    if widths:
        return shaped(gpus // widths[0], widths[0])
    return shaped(1, gpus)  # Slurm will keep it pending and say why
