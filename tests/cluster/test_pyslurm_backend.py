"""pyslurm -> model translation and the backend's calls, against stand-ins for pyslurm 25.11.

pyslurm cannot be installed here (it builds only against Slurm 25.11), so the classes below
stand in for pyslurm.Node/Job/Nodes/Jobs/JobSubmitDescription. They carry the property names
and value shapes of pyslurm v25.11 (pyslurm/core/node.pyx, pyslurm/core/job/job.pyx): node
state as slurm_node_state_string_complete prints it, GRES as cstr.to_gres_dict returns it,
times as plain epoch ints, collections as MultiClusterMaps with values().
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slurm_elastic.cluster.model import JobState, NodeFlag, NodeState
from slurm_elastic.cluster.pyslurm_backend import (PyslurmBackend, job_from_pyslurm, node_from_pyslurm,
                                                   pyslurm_version, state_from_pyslurm)
from slurm_elastic.cluster.slurm_values import SlurmVersion
from slurm_elastic.errors import SlurmError, SlurmUnavailable, UnknownJob
from slurm_elastic.spec import ElasticSpec

from tests.cluster.captures import EXPECTED_JOBS, EXPECTED_NODES
from tests.cluster.test_parse_json import assert_job, assert_node


def fake_node(name, state, *, gres="gpu:4", alloc_cpus=0, alloc_mem=0, alloc_tres=None, reason=None):
    """Stand-in for pyslurm.Node (v25.11 property names)."""
    return SimpleNamespace(
        name=name, state=state, configured_gres={"gpu": 4} if gres else {}, total_cpus=8, effective_cpus=8,
        allocated_cpus=alloc_cpus, real_memory=16000, allocated_memory=alloc_mem,
        allocated_gres={k.replace("gres/", ""): v for k, v in (alloc_tres or {}).items() if "gres/" in k},
        partitions=["gpu"], reason=reason)


def fake_job(jid, name, state, *, reason="None", nodes=None, num_nodes=1, gres_per_node=None, cpus=1,
             mem_node=1024, restarts=0, priority=1, comment=None, start=None, mem_gpu=None, cpus_gpu=None):
    """Stand-in for pyslurm.Job (v25.11 property names)."""
    return SimpleNamespace(
        id=jid, name=name, user_name="root", user_id=0, state=state, state_reason=reason, allocated_nodes=nodes,
        num_nodes=num_nodes, gres_per_node=gres_per_node or {}, gpus={}, cpus=cpus, memory_per_node=mem_node,
        memory_per_cpu=None, memory_per_gpu=mem_gpu, cpus_per_gpu=cpus_gpu, requeue_count=restarts,
        is_requeueable=True, priority=priority, comment=comment, partition="gpu", submit_time=1796011840,
        start_time=start)


class FakeMap(dict):
    """Stand-in for pyslurm.xcollections.MultiClusterMap: {cluster: {key: obj}}, values() flattens."""

    def values(self):  # noqa: D401 - mimics MultiClusterMap.values()
        return [v for per_cluster in dict.values(self) for v in per_cluster.values()]


# The captures' cluster, as pyslurm would return it (to_gres_dict keeps 'gres/gpu' for 'gres/gpu:3').
NODES = [fake_node("n1", "MIXED", alloc_cpus=2, alloc_mem=1024, alloc_tres={"cpu": "2", "mem": "1G"}),
         fake_node("n2", "DOWN+NOT_RESPONDING", reason="Not responding"), fake_node("n3", "IDLE"),
         fake_node("n4", "IDLE")]
JOBS = [fake_job(1, "jobA", "RUNNING", nodes="n1", gres_per_node={"gres/gpu": 3}, cpus=2, restarts=1,
                 start=1796011853),
        fake_job(2, "jobB", "PENDING", reason="BeginTime", gres_per_node={"gres/gpu": 1}, restarts=1,
                 start=1796011961),
        fake_job(3, "jobC", "PENDING", reason="JobHeldUser", gres_per_node={"gpu": 1}, priority=0)]


def test_translation_gives_the_same_model_as_the_captures() -> None:
    state = state_from_pyslurm(NODES, JOBS, taken_at=1.0, slurm_version="25.11.2")
    jobs = {j.job_id: j for j in state.jobs}
    for jid, expected in EXPECTED_JOBS.items():
        assert_job(jobs[jid], expected)
    nodes = {n.name: n for n in state.nodes}
    for name, expected in EXPECTED_NODES.items():
        assert_node(nodes[name], expected)  # n1's 3 used GPUs come from jobA: its TRES lack gres/gpu


def test_translation_details() -> None:
    n = node_from_pyslurm(fake_node("n9", "IDLE+DRAIN", alloc_tres={"gres/gpu": "2"}))
    assert (n.state, n.flags, n.gpus_alloc) == (NodeState.IDLE, frozenset({NodeFlag.DRAIN}), 2)
    spec = ElasticSpec(2, 8, cpus_per_gpu=2, mem_per_gpu_mb=1000)
    j = job_from_pyslurm(fake_job(7, "e", "RUNNING", nodes="n[1-2]", num_nodes=2, gres_per_node={"gpu:a100": 2},
                                  cpus=8, mem_node=None, mem_gpu=1000, cpus_gpu=2, comment=spec.to_comment()))
    assert (j.nodes, j.num_nodes, j.gpus_per_node, j.cpus_per_node, j.mem_per_node_mb) == (("n1", "n2"), 2, 2, 4, 2000)
    assert j.spec == spec and j.cpus_per_gpu == 2 and j.mem_per_gpu_mb == 1000
    bad = job_from_pyslurm(fake_job(8, "b", "PENDING", comment="elastic:v1 gpus=0-1"))
    assert bad.spec is None and bad.spec_error


class FakeRPCError(Exception):
    """Stand-in for pyslurm.RPCError: str() is Slurm's own message."""


class FakeJobHandle:
    def __init__(self, module: "FakePyslurm", jid: int) -> None:
        self.m, self.id = module, jid

    def _record(self, what, *args, **kwargs):
        if self.id not in self.m.known:
            raise FakeRPCError("Invalid job id specified")
        self.m.log.append((what, self.id, args, kwargs))

    def hold(self):
        self._record("hold")

    def requeue(self, hold=False):
        self._record("requeue", hold=hold)

    def modify(self, desc):
        self._record("modify", desc.changes)

    def release(self):
        self._record("release")

    def send_signal(self, sig, steps="children"):
        self._record("send_signal", sig, steps=steps)

    def cancel(self):
        self._record("cancel")


class FakePyslurm:
    """Stand-in for the pyslurm module (Nodes, Jobs, Job, JobSubmitDescription, __version__)."""

    __version__ = "25.11.2"

    def __init__(self, down: bool = False) -> None:
        self.log: list = []
        self.known = {1, 2, 3}
        self.down = down
        outer = self

        class Nodes:
            @staticmethod
            def load():
                if outer.down:
                    raise FakeRPCError("Unable to contact slurm controller (connect failure)")
                return FakeMap({"elastic": {n.name: n for n in NODES}})

        class Jobs:
            @staticmethod
            def load():
                return FakeMap({"elastic": {j.id: j for j in JOBS}})

        class JobSubmitDescription:
            def __init__(self, **changes):
                self.changes = changes

        self.Nodes, self.Jobs, self.JobSubmitDescription = Nodes, Jobs, JobSubmitDescription

    def Job(self, jid):  # noqa: N802 - pyslurm's class name
        return FakeJobHandle(self, jid)


class RecordingCli:
    """Stand-in for the CLI backend where only scontrol's NumNodes update goes (recorded, not run)."""

    def __init__(self) -> None:
        self.runs: list[list[str]] = []

    def _run(self, argv, **kwargs):
        self.runs.append(list(argv))
        return ""


def test_backend_calls_pyslurm_as_documented() -> None:
    ps, cli = FakePyslurm(), RecordingCli()
    b = PyslurmBackend(ps, cli=cli)  # type: ignore[arg-type]
    state = b.snapshot()
    assert len(state.nodes) == 4 and len(state.jobs) == 3 and b.calls == 2
    assert state.slurm_version == "25.11.2"
    b.requeue_hold(1)
    b.set_resources(1, nodes=1, gpus_per_node=3, cpus_per_gpu=2, mem_per_gpu_mb=1000)
    b.release(1)
    b.signal(1, "USR2")
    b.hold(2)
    b.cancel(3)
    assert cli.runs == [["scontrol", "update", "JobId=1", "NumNodes=1-1"]]
    assert ps.log == [
        ("requeue", 1, (), {"hold": True}),
        ("modify", 1, ({"gres_per_node": "gpu:3", "cpus_per_gpu": 2, "memory_per_gpu": 1000, "begin_time": "now"},),
         {}),
        ("release", 1, (), {}), ("send_signal", 1, ("SIGUSR2",), {"steps": "all"}), ("hold", 2, (), {}),
        ("cancel", 3, (), {})]


def test_backend_errors_are_typed_with_slurms_message() -> None:
    b = PyslurmBackend(FakePyslurm(), cli=RecordingCli())  # type: ignore[arg-type]
    with pytest.raises(UnknownJob, match="Invalid job id specified"):
        b.release(99)
    with pytest.raises(SlurmError, match=">= 1"):
        b.set_resources(1, nodes=0, gpus_per_node=1, cpus_per_gpu=1, mem_per_gpu_mb=1)
    down = PyslurmBackend(FakePyslurm(down=True), cli=RecordingCli())  # type: ignore[arg-type]
    with pytest.raises(SlurmUnavailable, match="Unable to contact"):
        down.snapshot()


def test_pyslurm_version() -> None:
    assert pyslurm_version(FakePyslurm()) == SlurmVersion(25, 11, 2)  # type: ignore[arg-type]


def test_job_states_from_pyslurm_strings() -> None:
    assert job_from_pyslurm(fake_job(1, "a", "REQUEUE_HOLD", priority=0)).state is JobState.REQUEUE_HOLD
