"""Shapes Slurm understands: equal GPUs per node when spanning, whole nodes by default."""

from __future__ import annotations

import pytest

from slurm_elastic.allocate import AllocationProblem, JobRequest, NodeCapacity, Policy, request_shape, shape_of, solve
from slurm_elastic.allocate.shapes import placement_is_valid_shape, spanning_widths
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.errors import AllocationError
from slurm_elastic.spec import ElasticSpec


def test_valid_shapes():
    sizes = {"a": 4, "b": 4, "c": 2}
    assert placement_is_valid_shape({"a": 3}, sizes, True)
    assert placement_is_valid_shape({"a": 4, "b": 4}, sizes, True)
    assert not placement_is_valid_shape({"a": 3, "b": 3}, sizes, True)     # not whole nodes
    assert placement_is_valid_shape({"a": 3, "b": 3}, sizes, False)
    assert not placement_is_valid_shape({"a": 4, "c": 2}, sizes, False)    # unequal per node


def test_spanning_widths():
    assert spanning_widths(16, {4, 8}, True) == [8, 4]
    assert spanning_widths(6, {4}, True) == []
    assert spanning_widths(6, {4}, False) == [3, 2, 1]


@pytest.mark.parametrize("mode", ["exact", "two-stage"])
def test_six_gpus_on_four_gpu_nodes_needs_partial_nodes(mode):
    nodes = (NodeCapacity("a", 4, 32, 64000), NodeCapacity("b", 4, 32, 64000))
    job = JobRequest("j", 6, 6)
    whole = solve(AllocationProblem((job,), nodes, Policy()), mode=mode)
    assert whole.gpus["j"] == 0 and whole.unplaceable and whole.unplaceable[0].key == "j"
    partial = solve(AllocationProblem((job,), nodes, Policy(whole_nodes_when_spanning=False)), mode=mode)
    assert partial.placement["j"] == {"a": 3, "b": 3}


@pytest.mark.parametrize("mode", ["exact", "two-stage"])
def test_spanning_job_gets_equal_gpus_per_node(mode):
    # 4+2 would fit the GPUs but is no Slurm shape; 3+3 on the two big nodes is
    nodes = (NodeCapacity("a", 4, 32, 64000), NodeCapacity("b", 2, 32, 64000), NodeCapacity("c", 4, 32, 64000))
    job = JobRequest("j", 6, 6)
    alloc = solve(AllocationProblem((job,), nodes, Policy(whole_nodes_when_spanning=False)), mode=mode)
    assert sorted(alloc.placement["j"].values()) in ([3, 3], [2, 2, 2])


def test_shape_of():
    shape = shape_of({"b": 4, "a": 4, "c": 0}, 8, 32000)
    assert shape == RequestShape(nodes=2, gpus_per_node=4, cpus_per_gpu=8, mem_per_gpu_mb=32000)
    assert shape.gpus == 8
    assert shape_of({}, 1, 1) is None
    with pytest.raises(AllocationError):
        shape_of({"a": 4, "b": 2}, 1, 1)


def test_request_shape_from_placement_else_narrowest():
    spec = ElasticSpec(1, 16, cpus_per_gpu=3, mem_per_gpu_mb=2000)
    # the solver's placement wins when it gives the count asked for
    assert request_shape(spec, 4, {"a": 2, "b": 2}, {4}) == RequestShape(2, 2, 3, 2000)
    # no placement (a job sent back to the queue, a new submission): one node when it fits ...
    assert request_shape(spec, 3, {}, {4}) == RequestShape(1, 3, 3, 2000)
    # ... else whole nodes of a size that divides the count
    assert request_shape(spec, 8, {}, {4}) == RequestShape(2, 4, 3, 2000)
    # a placement of another count is not this request's shape
    assert request_shape(spec, 8, {"a": 2}, {4}) == RequestShape(2, 4, 3, 2000)
