"""One request shape, spelled by every backend: the scontrol/sbatch argv, pyslurm's description, the in-memory job."""

from __future__ import annotations

import pytest

from slurm_elastic.cluster.backend import SubmitDescription
from slurm_elastic.cluster.cli_backend import CliBackend
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.pyslurm_backend import PyslurmBackend
from slurm_elastic.cluster.shape import RequestShape, ShapeError
from slurm_elastic.cluster.slurm_values import SlurmVersion
from slurm_elastic.spec import ElasticSpec

from tests.cluster.captures import project_load
from tests.cluster.pyslurm_standin import FakeCli, FakePyslurm, FakeSlurmctld

SHAPE = RequestShape(nodes=1, gpus_per_node=3, cpus_per_gpu=2, mem_per_gpu_mb=700)


def _seen(job) -> RequestShape:
    return RequestShape(job.num_nodes, job.gpus_per_node, job.cpus_per_gpu, job.mem_per_gpu_mb)


@pytest.mark.parametrize("version,gpu", [(SlurmVersion(22, 5, 8), "gres:gpu"), (SlurmVersion(26, 5, 5), "gres/gpu")])
def test_the_cli_backend_spells_the_shape_for_scontrol_and_sbatch(monkeypatch, version: SlurmVersion, gpu: str):
    calls: list[list[str]] = []
    backend = CliBackend(version=version)
    monkeypatch.setattr(backend, "_run", lambda args, **kw: calls.append(list(args))
                        or ("" if args[:3] == ["scontrol", "show", "config"] else "42\n"))
    backend.set_resources(7, SHAPE)
    assert calls[-1] == ["scontrol", "update", "JobId=7", "NumNodes=1-1", "NumTasks=1", "NumCPUs=6", "MinCPUsNode=6",
                         f"TresPerNode={gpu}:3",
                         f"CpusPerTres={gpu}:2", f"MemPerTres={gpu}:700", "StartTime=now"]
    assert backend.submit(SubmitDescription(script="s", shape=SHAPE)) == 42
    [sbatch] = [c for c in calls if c[0] == "sbatch"]
    assert sbatch[:6] == ["sbatch", "--parsable", "--nodes=1", "--gres=gpu:3", "--cpus-per-gpu=2",
                          "--mem-per-gpu=700M"]


def test_the_pyslurm_backend_sends_the_same_shape_and_reads_it_back():
    ctld = FakeSlurmctld(project_load("26.05", "squeue-requeue-held.json"))
    ps, cli = FakePyslurm(ctld, version="25.11.2"), FakeCli(ctld)
    backend = PyslurmBackend(ps, cli=cli)  # type: ignore[arg-type]
    backend.set_resources(1, SHAPE)
    # Job.modify() takes the per-node GPUs and the per-GPU CPUs and memory; scontrol the node count.
    assert [r for r in ctld.rpcs if r[0] == "update"] == [
        ("update", 1, {"tres_per_node": "gres:gpu:3", "cpus_per_tres": "gres:gpu:2", "mem_per_tres": "gres:gpu:700"}),
        ("update", 1, {"num_nodes": 1})]
    assert ["scontrol", "update", "JobId=1", "NumNodes=1-1", "NumTasks=1", "NumCPUs=6", "MinCPUsNode=6"] in cli.runs
    assert _seen(backend.snapshot().job(1)) == SHAPE


def test_the_in_memory_slurm_takes_the_same_shape():
    slurm = InMemorySlurm()
    job_id = slurm.add_job(ElasticSpec(1, 8), nodes=2, gpus_per_node=4)
    slurm.requeue_hold(job_id)
    slurm.set_resources(job_id, SHAPE)
    assert _seen(slurm.snapshot().job(job_id)) == SHAPE
    submitted = slurm.submit(SubmitDescription(script="s", shape=SHAPE, comment=ElasticSpec(1, 8).to_comment()))
    job = slurm.snapshot().job(submitted)
    assert (job.num_nodes, job.gpus_per_node) == (SHAPE.nodes, SHAPE.gpus_per_node)


def test_the_stored_form_round_trips():
    assert RequestShape.loads(SHAPE.dumps()) == SHAPE
    assert RequestShape.from_json(SHAPE.to_json()) == SHAPE
    assert RequestShape.loads('{"nodes":1,"gpus_per_node":0,"cpus_per_gpu":1,"mem_per_gpu_mb":1}').gpus == 0


@pytest.mark.parametrize("stored,why", [
    ('{"nodes": 1, "gpus_per_node": 3, "cpus_per_gpu": 2}', "has the fields"),
    ('{"nodes": 1, "gpus_per_node": 3, "cpus_per_gpu": 2, "mem_per_gpu_mb": 700, "x": 1}', "has the fields"),
    ('{"nodes": 0, "gpus_per_node": 3, "cpus_per_gpu": 2, "mem_per_gpu_mb": 700}', "nodes must be an integer >= 1"),
    ('{"nodes": 1, "gpus_per_node": -1, "cpus_per_gpu": 2, "mem_per_gpu_mb": 700}', "gpus_per_node must be"),
    ('{"nodes": true, "gpus_per_node": 3, "cpus_per_gpu": 2, "mem_per_gpu_mb": 700}', "nodes must be"),
    ('{"nodes": 1.0, "gpus_per_node": 3, "cpus_per_gpu": 2, "mem_per_gpu_mb": 700}', "nodes must be"),
    ('{"nodes": 1, "gpus_per_node": NaN, "cpus_per_gpu": 2, "mem_per_gpu_mb": 700}', "gpus_per_node must be"),
    ('{"nodes": 1, "gpus_per_node": 3, "cpus_per_gpu": "2", "mem_per_gpu_mb": 700}', "cpus_per_gpu must be"),
    ('[1, 3, 2, 700]', "must be an object"),
    ('{"nodes": 1', "not JSON"),
])
def test_a_stored_shape_is_validated(stored: str, why: str):
    with pytest.raises(ShapeError, match=why):
        RequestShape.loads(stored)
