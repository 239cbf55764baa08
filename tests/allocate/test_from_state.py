"""problem_from_state: capacity for elastic work and elastic jobs from a Slurm snapshot."""

from __future__ import annotations

from slurm_elastic.allocate import LinearThroughput, Policy, solve
from slurm_elastic.allocate.from_state import problem_from_state
from slurm_elastic.cluster.model import ClusterState, Job, JobState, Node, NodeFlag, NodeState
from slurm_elastic.spec import ElasticSpec


def state() -> ClusterState:
    nodes = (
        Node("gpu1", NodeState.MIXED, cpus=64, cpus_alloc=40, mem_mb=512_000, mem_alloc_mb=300_000, gpus=8,
             gpus_alloc=6),
        Node("gpu2", NodeState.ALLOCATED, cpus=64, cpus_alloc=16, mem_mb=512_000, mem_alloc_mb=64_000, gpus=8,
             gpus_alloc=8),
        Node("gpu3", NodeState.DOWN, cpus=64, mem_mb=512_000, gpus=8),
        Node("gpu4", NodeState.IDLE, flags=frozenset({NodeFlag.DRAIN}), cpus=64, mem_mb=512_000, gpus=8),
        Node("gpu5", NodeState.IDLE, cpus=64, mem_mb=512_000, gpus=8),
    )
    spec = ElasticSpec(2, 16, cpus_per_gpu=4, mem_per_gpu_mb=32_000, weight=2.0)
    jobs = (
        # non-elastic job on gpu1: its use is not for elastic work
        Job(1, "u", "fixed", JobState.RUNNING, nodes=("gpu1",), gpus_per_node=2, cpus_per_node=24,
            mem_per_node_mb=200_000),
        # elastic job running on gpu1 + gpu2 (4 each) and one on the now-down gpu3
        Job(2, "u", "el", JobState.RUNNING, nodes=("gpu1", "gpu2"), num_nodes=2, gpus_per_node=4,
            cpus_per_node=16, mem_per_node_mb=128_000, spec=spec),
        Job(3, "u", "el2", JobState.RUNNING, nodes=("gpu3",), gpus_per_node=4, spec=ElasticSpec(1, 8)),
        Job(4, "u", "pending", JobState.PENDING, spec=ElasticSpec(4, 8, gpu_step=4)),
        Job(5, "u", "done", JobState.COMPLETED, nodes=("gpu5",), gpus_per_node=8, spec=ElasticSpec(1, 8)),
        Job(6, "u", "old", JobState.COMPLETED, nodes=("gpu5",), gpus_per_node=8, cpus_per_node=64),
    )
    return ClusterState(nodes, jobs, taken_at=0.0)


def test_capacity_subtracts_only_active_non_elastic_use():
    p = problem_from_state(state(), Policy())
    cap = {n.name: (n.gpus, n.cpus, n.mem_mb) for n in p.nodes}
    assert cap == {
        "gpu1": (6, 40, 312_000),       # 8/64/512000 minus the fixed job; the elastic job's share stays free
        "gpu2": (8, 64, 512_000),
        "gpu3": (0, 0, 0),              # down
        "gpu4": (0, 0, 0),              # drained
        "gpu5": (8, 64, 512_000),       # finished jobs hold nothing
    }


def test_elastic_jobs_with_current_placement():
    p = problem_from_state(state(), Policy(), restart_cost={"2": 90.0},
                           throughput=lambda job: LinearThroughput(per_gpu=3.0) if job.job_id == 2 else None)
    jobs = {j.key: j for j in p.jobs}
    assert set(jobs) == {"2", "3", "4"}
    assert dict(jobs["2"].current) == {"gpu1": 4, "gpu2": 4}
    assert (jobs["2"].min_gpus, jobs["2"].max_gpus, jobs["2"].cpus_per_gpu, jobs["2"].weight) == (2, 16, 4, 2.0)
    assert jobs["2"].restart_cost_s == 90.0 and jobs["3"].restart_cost_s == 30.0
    assert jobs["2"].throughput(8) == 24.0 and jobs["3"].throughput is None
    assert dict(jobs["3"].current) == {"gpu3": 4} and dict(jobs["4"].current) == {}
    assert jobs["4"].gpu_step == 4


def test_solving_a_snapshot_keeps_jobs_off_unavailable_nodes():
    alloc = solve(problem_from_state(state()))
    for key, where in alloc.placement.items():
        assert not {"gpu3", "gpu4"} & set(where), (key, where)
    d3 = next(d for d in alloc.decisions if d.key == "3")
    assert d3.gpus_before == 4
    assert "gpu3 gives nothing now" in d3.reason


def test_a_completing_node_takes_no_new_placement_and_keeps_the_elastic_jobs_on_it():
    """Slurm starts nothing on a COMPLETING node. Found by a fault probe: after a slurmctld restart one node
    stayed IDLE+COMPLETING with no job on it, the controller kept naming it in pending jobs' node lists,
    and they waited until an admin restarted its slurmd."""
    from slurm_elastic.allocate.from_state import capacity_from_state

    nodes = (Node("a", NodeState.IDLE, flags=frozenset({NodeFlag.COMPLETING}), cpus=8, mem_mb=8000, gpus=4),
             Node("b", NodeState.MIXED, flags=frozenset({NodeFlag.COMPLETING}), cpus=8, mem_mb=8000, gpus=4,
                  gpus_alloc=2),
             Node("c", NodeState.IDLE, cpus=8, mem_mb=8000, gpus=4))
    jobs = (Job(1, "u", "el", JobState.RUNNING, nodes=("b",), gpus_per_node=2, spec=ElasticSpec(1, 4)),
            Job(2, "u", "queued", JobState.PENDING, spec=ElasticSpec(4, 4)))
    cap = {n.name: n.gpus for n in capacity_from_state(ClusterState(nodes, jobs, taken_at=0.0))}
    assert cap == {"a": 0, "b": 2, "c": 4}
    answer = solve(problem_from_state(ClusterState(nodes, jobs, taken_at=0.0), Policy()))
    assert answer.placement["2"] == {"c": 4} and answer.gpus["1"] >= 2 and set(answer.placement["1"]) <= {"b", "c"}
