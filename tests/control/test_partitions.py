"""An elastic job is sized on its own partition's nodes: Slurm starts a resized job nowhere else."""

from __future__ import annotations

from slurm_elastic.allocate.from_state import partition_nodes
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.model import JobState
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.protocol import ProtocolSettings
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler
from slurm_elastic.spec import ElasticSpec
from tests.control.test_rigid_neighbours import Clock


def _two_partitions() -> InMemorySlurm:
    """n1-n2 in `gpu` (the elastic job's), n3-n4 in `big`, 4 GPUs each, nothing else running."""
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    for name in ("n3", "n4"):
        slurm.add_node(name, gpus=4, cpus=32, mem_mb=64000, partitions=("big",))
    return slurm


def test_a_job_grows_to_what_its_partition_holds_and_runs_there(tmp_path):
    slurm = _two_partitions()
    job = slurm.add_job(ElasticSpec(1, 16, ckpt_dir=str(tmp_path / "ckpt")), nodes=1, gpus_per_node=4)
    clock = Clock()
    config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.5, settle_timeout_s=1.0), node_confirm_s=0,
                              min_resize_interval_s=0)
    rec = Reconciler(slurm, Journal(tmp_path / "j.sqlite"), config, clock=clock, sleep=clock.sleep)
    report = rec.cycle()
    assert report.target(job) == 8          # all of gpu's GPUs; the 8 of `big` are not the job's to take
    rec.cycle()
    assert slurm.jobs[job].state is JobState.RUNNING and slurm.jobs[job].gpus == 8
    assert set(slurm.jobs[job].nodes) == {"n1", "n2"}
    assert rec.cycle().target(job) == 8      # and it stays


def test_a_pending_jobs_partition_list_gives_the_nodes_of_its_largest_partition():
    slurm = _two_partitions()
    slurm.add_node("n5", gpus=4, cpus=32, mem_mb=64000, partitions=("big",))
    state = slurm.snapshot()
    assert partition_nodes(state, "gpu") == {"n1", "n2"}
    # Slurm starts it in one partition, never across two: sized on the one with the most GPUs
    assert partition_nodes(state, "gpu,big") == {"n3", "n4", "n5"}
    assert partition_nodes(state, "") is None
    assert partition_nodes(state, "elsewhere") == frozenset()   # no node: it cannot run anywhere


def test_the_wrapper_sizes_a_new_job_on_its_partitions_nodes(tmp_path):
    from slurm_elastic.control.submit import parse_command_line, submit

    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\nsrun true\n")
    site = {"SLURM_ELASTIC_CKPT_DIR": str(tmp_path / "ckpt")}
    for args, gpus in ((["--partition=big"], 8), ([], 8)):    # no -p: the default partition, gpu
        description, _ = submit(_two_partitions(), parse_command_line(["--gpus=1-16", *args, str(script)],
                                                                      environ=site))
        assert description.shape.nodes * description.shape.gpus_per_node == gpus, (args, description.shape)
