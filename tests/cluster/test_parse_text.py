"""`scontrol show job|node` text of every version parses into the same model as the JSON."""

from __future__ import annotations

import os
import time

import pytest

from slurm_elastic.cluster.parse_json import parse_jobs, parse_nodes
from slurm_elastic.cluster.parse_text import jobs_from_text, nodes_from_text, records
from slurm_elastic.cluster.slurm_values import SlurmParseError

from tests.cluster.captures import EXPECTED_JOBS, MEM_PER_GPU_JOB, VERSIONS, load, project_load, project_text, text
from tests.cluster.test_parse_json import assert_job


@pytest.fixture
def utc():
    """The captures' text times are the capture host's local time, which was UTC."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if old is None:
        os.environ.pop("TZ")
    else:
        os.environ["TZ"] = old
    time.tzset()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind,jid", [("running", 1), ("pending-requeued", 2), ("held", 3)])
def test_job_text_equals_json(version: str, kind: str, jid: int, utc: None) -> None:
    (job,) = jobs_from_text(text(version, f"scontrol-show-job-{kind}.txt"))
    assert_job(job, EXPECTED_JOBS[jid])
    from_json = {j.job_id: j for j in parse_jobs(load(version, "squeue.json"))}[jid]
    assert job == from_json


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind,json_name,jid", [
    ("mem-per-gpu-running", "squeue-mem-per-gpu-running.json", 1),   # 22.05 MinMemoryNode=0, later MinMemoryTRES=500M
    ("requeue-held", "squeue-requeue-held.json", 1),                 # Reason=job_requeued_in_held_state
    ("held-then-cancelled", "squeue-held-then-cancelled.json", 2)])  # CANCELLED with Priority=0
def test_version_differences_in_text_give_the_json_model(version: str, kind: str, json_name: str, jid: int,
                                                        utc: None) -> None:
    (job,) = jobs_from_text(project_text(version, f"scontrol-show-job-{kind}.txt"))
    from_json = {j.job_id: j for j in parse_jobs(project_load(version, json_name))}[jid]
    assert job == from_json
    if kind != "held-then-cancelled":
        assert {k: getattr(job, k) for k in MEM_PER_GPU_JOB} == MEM_PER_GPU_JOB
    assert job.held is (kind == "requeue-held")
    assert job.reason == ("" if kind == "mem-per-gpu-running" else "JobHeldUser")


@pytest.mark.parametrize("version", VERSIONS)
def test_node_text_equals_json(version: str) -> None:
    jobs = parse_jobs(load(version, "squeue.json"))
    from_text = nodes_from_text(text(version, "scontrol-show-node.txt"), jobs)
    from_json = parse_nodes(load(version, "sinfo.json" if version == "22.05" else "scontrol-show-nodes.json"))
    assert sorted(from_text, key=lambda n: n.name) == sorted(from_json, key=lambda n: n.name)


def test_gpus_used_from_jobs_only_when_text_lacks_them() -> None:
    # The captures' node text has no GresUsed= (no -d) and AllocTRES without gres/gpu.
    nodes = {n.name: n for n in nodes_from_text(text("22.05", "scontrol-show-node.txt"), ())}
    assert nodes["n1"].gpus_alloc == 0
    one_line = text("22.05", "scontrol-show-node.txt").split("\n\n")[0].replace("\n", " ") + " GresUsed=gpu:2(IDX:0-1)"
    (n1,) = nodes_from_text(one_line, parse_jobs(load("22.05", "squeue.json")))
    assert n1.gpus_alloc == 2


def test_one_line_form_and_values_with_spaces() -> None:
    line = ("JobId=7 JobName=train UserId=alice(1000) GroupId=alice(1000) Priority=10 JobState=RUNNING "
            "Reason=None Requeue=1 Restarts=2 NodeList=n[1-2] NumNodes=2 NumCPUs=8 "
            "Comment=elastic:v1 gpus=2-8 step=2 cpus-per-gpu=2 mem-per-gpu=1000M weight=1 "
            "Command=/bin/train --lr=0.1 x Partition=gpu MinMemoryNode=0 TresPerNode=gres/gpu:2 "
            "CpusPerTres=gres/gpu:2 MemPerTres=gres/gpu:1000 StartTime=2026-11-30T04:10:53")
    (job,) = jobs_from_text(line)
    assert job.user == "alice" and job.user_id == 1000 and job.nodes == ("n1", "n2")
    assert job.spec is not None and job.spec.gpu_step == 2 and job.spec_error is None
    assert (job.gpus_per_node, job.cpus_per_gpu, job.mem_per_gpu_mb, job.mem_per_node_mb) == (2, 2, 1000, 2000)
    assert job.restarts == 2 and job.requeue and not job.held


def test_records_split_on_first_key_only() -> None:
    recs = records("JobId=1 JobName=a b JobState=RUNNING\nJobId=2 JobName=c JobState=PENDING", "JobId")
    assert [r["JobName"] for r in recs] == ["a b", "c"]
    with pytest.raises(SlurmParseError):
        records("JobName=a JobId=1", "JobId")


def test_missing_state_is_an_error() -> None:
    with pytest.raises(SlurmParseError, match="JobState"):
        jobs_from_text("JobId=1 UserId=a(1) NumNodes=1 NumCPUs=1 Restarts=0 Priority=1")
    with pytest.raises(SlurmParseError, match="State"):
        nodes_from_text("NodeName=n1 CPUTot=8 CPUAlloc=0 RealMemory=10")


@pytest.mark.parametrize("exit_code, signal", [("0:15", 15), ("1:0", None), ("0:0", None), ("", None)])
def test_exit_code_text_gives_the_signal(exit_code: str, signal: int | None) -> None:
    text = project_text("24.11", "scontrol-show-job-held-then-cancelled.txt")
    text = text.replace("ExitCode=0:0", f"ExitCode={exit_code}")
    (job,) = jobs_from_text(text)
    assert job.state.finished and job.exit_signal == signal and job.end_time is not None


def test_a_jobs_reservation_is_read_where_scontrol_prints_one() -> None:
    # Slurm 22.05 on the local cluster printed `Reservation=r2` for a job submitted with --reservation=r2 and
    # no Reservation field for a job without one (as in every capture)
    text = project_text("24.11", "scontrol-show-job-held-then-cancelled.txt")
    assert "Reservation=" not in text
    (plain,) = jobs_from_text(text)
    (reserved,) = jobs_from_text(text.replace(" Partition=", " Reservation=r2 Partition=", 1))
    assert (plain.reservation, reserved.reservation) == ("", "r2")
