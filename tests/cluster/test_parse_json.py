"""Every real Slurm JSON capture (22.05, 24.11, 26.05) parses into the same model."""

from __future__ import annotations

import copy
import json

import pytest

from slurm_elastic.cluster.model import Job, JobState, Node
from slurm_elastic.cluster.parse_json import (MissingField, allocated_mem_per_node, cluster_state, job_from_record,
                                              parse_jobs, parse_nodes, version_of)
from slurm_elastic.cluster.slurm_values import SlurmParseError, SlurmVersion, number
from slurm_elastic.spec import ElasticSpec

from tests.cluster.captures import (EXPECTED_JOBS, EXPECTED_NODES, MEM_PER_GPU_JOB, VERSIONS, capture_dir, load,
                                    project_load)


def assert_job(job: Job, expected: dict) -> None:
    got = {k: (getattr(job, k).value if k == "state" else getattr(job, k)) for k in expected}
    assert got == expected, f"job {job.job_id}"


def assert_node(node: Node, expected: dict) -> None:
    got = dict(state=node.state.value, flags={f.value for f in node.flags}, cpus=node.cpus,
               cpus_alloc=node.cpus_alloc, mem_mb=node.mem_mb, mem_alloc_mb=node.mem_alloc_mb, gpus=node.gpus,
               gpus_alloc=node.gpus_alloc, reason=node.reason, available=node.available)
    assert got == expected, f"node {node.name}"


@pytest.mark.parametrize("version", VERSIONS)
def test_squeue_json_gives_every_job_right(version: str) -> None:
    jobs = {j.job_id: j for j in parse_jobs(load(version, "squeue.json"))}
    assert set(jobs) == set(EXPECTED_JOBS)
    for jid, expected in EXPECTED_JOBS.items():
        assert_job(jobs[jid], expected)
        assert jobs[jid].spec is None and jobs[jid].spec_error is None
        assert jobs[jid].user_id == 0 and jobs[jid].submit_time and jobs[jid].submit_time > 1.7e9
    assert jobs[1].start_time is not None and jobs[2].start_time is None and jobs[3].start_time is None
    # The running job's batch host (the node a shrink in place must keep); none for a job not running.
    assert jobs[1].batch_host == "n1" and jobs[1].first_node == "n1" and jobs[2].batch_host == ""


@pytest.mark.parametrize("version", ["24.11", "26.05"])
@pytest.mark.parametrize("kind,jid", [("running", 1), ("pending-requeued", 2), ("held", 3)])
def test_scontrol_show_job_json_matches_squeue(version: str, kind: str, jid: int) -> None:
    (job,) = parse_jobs(load(version, f"scontrol-show-job-{kind}.json"))
    squeue_job = {j.job_id: j for j in parse_jobs(load(version, "squeue.json"))}[jid]
    assert_job(job, EXPECTED_JOBS[jid])
    assert job == squeue_job


def test_scontrol_json_is_absent_on_22_05() -> None:
    assert not list(capture_dir("22.05").glob("scontrol-*.json"))


@pytest.mark.parametrize("version,name", [("22.05", "sinfo.json"), ("24.11", "scontrol-show-nodes.json"),
                                          ("26.05", "scontrol-show-nodes.json"), ("24.11", "sinfo.json"),
                                          ("26.05", "sinfo.json")])
def test_node_documents_give_every_node_right(version: str, name: str) -> None:
    nodes = {n.name: n for n in parse_nodes(load(version, name))}
    assert set(nodes) == set(EXPECTED_NODES)
    for node_name, expected in EXPECTED_NODES.items():
        assert_node(nodes[node_name], expected)
        assert nodes[node_name].partitions == ("gpu",)


@pytest.mark.parametrize("version,name", [("22.05", "sinfo.json"), ("24.11", "scontrol-show-nodes.json"),
                                          ("26.05", "scontrol-show-nodes.json")])
def test_per_node_records_say_when_each_slurmd_started(version: str, name: str) -> None:
    """A node whose slurmd started after its loss was reported has come back (control/peer_loss.still_lost)."""
    doc = load(version, name)
    for rec, node in zip(doc["nodes"], parse_nodes(doc)):
        raw = rec["slurmd_start_time"]
        seconds = raw["number"] if isinstance(raw, dict) else raw
        assert node.slurmd_started_at == (float(seconds) if seconds else None)
    assert any(n.slurmd_started_at for n in parse_nodes(doc))


@pytest.mark.parametrize("version,expected", [("22.05", SlurmVersion(22, 5, 8)), ("24.11", SlurmVersion(24, 11, 5)),
                                              ("26.05", SlurmVersion(26, 5, 5))])
def test_version_from_every_meta(version: str, expected: SlurmVersion) -> None:
    for name in ("squeue.json", "sinfo.json"):
        assert version_of(load(version, name)) == expected


@pytest.mark.parametrize("version", VERSIONS)
def test_whole_snapshot(version: str) -> None:
    nodes_doc = "sinfo.json" if version == "22.05" else "scontrol-show-nodes.json"
    state = cluster_state(load(version, "squeue.json"), load(version, nodes_doc), taken_at=1.0)
    assert state.slurm_version.startswith(version.split(".")[0])
    assert sum(n.free.gpus for n in state.nodes) == 1 + 4 + 4  # n2 is down: it gives nothing


# --- a field the model needs that is missing is an error, never a silent default -------------------

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("field", ["job_id", "job_state", "node_count", "cpus", "restart_cnt", "requeue"])
def test_missing_job_field_is_reported(version: str, field: str) -> None:
    rec = copy.deepcopy(load(version, "squeue.json")["jobs"][0])
    del rec[field]
    with pytest.raises(MissingField, match=field):
        job_from_record(rec)


@pytest.mark.parametrize("version", VERSIONS)
def test_job_without_any_gpu_field_is_reported(version: str) -> None:
    rec = copy.deepcopy(load(version, "squeue.json")["jobs"][1])
    for key in ("tres_per_node", "tres_per_job", "tres_per_task", "gres_detail", "tres_alloc_str", "tres_req_str"):
        rec.pop(key, None)
    with pytest.raises(MissingField, match="tres_per_node"):
        job_from_record(rec)


@pytest.mark.parametrize("version,name", [("22.05", "sinfo.json"), ("24.11", "scontrol-show-nodes.json")])
@pytest.mark.parametrize("field", ["state", "cpus", "real_memory", "alloc_memory", "alloc_cpus", "gres"])
def test_missing_node_field_is_reported(version: str, name: str, field: str) -> None:
    doc = copy.deepcopy(load(version, name))
    del doc["nodes"][0][field]
    with pytest.raises(MissingField, match=field):
        parse_nodes(doc)


def test_pending_node_count_follows_requested_tres() -> None:
    # 22.05.8 after `scontrol update JobId=J NumNodes=1` on a held 2-node job (seen live):
    # node_count stays 2, tres_req_str says node=1, and the job then runs on one node.
    rec = copy.deepcopy(load("22.05", "squeue.json")["jobs"][2])
    rec.update(node_count=2, tres_req_str="cpu=2,mem=2000M,node=1,billing=2", cpus=2)
    assert job_from_record(rec).num_nodes == 1
    rec.update(tres_req_str="")
    assert job_from_record(rec).num_nodes == 2


def test_held_on_22_05_is_priority_zero_and_reason() -> None:
    rec = copy.deepcopy(load("22.05", "squeue.json")["jobs"][2])
    assert "hold" not in rec and job_from_record(rec).held
    rec["priority"] = 4294901757
    rec["state_reason"] = "Resources"
    assert not job_from_record(rec).held
    del rec["priority"]
    with pytest.raises(MissingField, match="hold/priority"):
        job_from_record(rec)


# --- fields whose meaning differs between versions (the project captures, tests/cluster/slurm-json) -----

def project_jobs(version: str, name: str) -> dict[int, Job]:
    return {j.job_id: j for j in parse_jobs(project_load(version, name))}


@pytest.mark.parametrize("version", VERSIONS)
def test_cancelled_held_job_is_not_held(version: str) -> None:
    # 24.11 and 26.05 keep "hold": true on the cancelled job; 22.05 keeps priority 0 and JobHeldUser.
    rec = {r["job_id"]: r for r in project_load(version, "squeue-held-then-cancelled.json")["jobs"]}[2]
    assert rec.get("hold") is (None if version == "22.05" else True)
    job = project_jobs(version, "squeue-held-then-cancelled.json")[2]
    assert job.state is JobState.CANCELLED and not job.held and job.reason == "JobHeldUser"
    assert job.cpus_per_node == 1  # 22.05 gives `cpus: null` for it; the requested TRES say cpu=1
    before = project_jobs(version, "squeue-mem-per-gpu-running.json")[2]
    assert before.state is JobState.PENDING and before.held  # the same job while it was held


def test_job_completing_its_requeuehold_is_held() -> None:
    # 24.11.5, seen live for ~4 s after `scontrol requeuehold` of a job whose batch shell traps TERM
    rec = {r["job_id"]: r for r in project_load("24.11", "squeue-requeue-held.json")["jobs"]}[1]
    rec = copy.deepcopy(rec)
    rec["job_state"] = ["PENDING", "COMPLETING"]
    job = job_from_record(rec)
    assert job.state is JobState.COMPLETING and job.held


@pytest.mark.parametrize("version", VERSIONS)
def test_requeue_held_job_is_held_with_the_reason_code(version: str) -> None:
    rec = {r["job_id"]: r for r in project_load(version, "squeue-requeue-held.json")["jobs"]}[1]
    assert rec["state_description"] == "job requeued in held state"
    job = project_jobs(version, "squeue-requeue-held.json")[1]
    assert (job.state, job.held, job.reason, job.restarts) == (JobState.PENDING, True, "JobHeldUser", 1)
    # and the cancelled job 2 beside it is not
    assert not project_jobs(version, "squeue-requeue-held.json")[2].held


@pytest.mark.parametrize("version", VERSIONS)
def test_mem_per_gpu_job_holds_gpus_times_mem_per_node(version: str) -> None:
    # Slurm allocated 1000 MB per node (2 GPUs x 500M); 23.02+ put 500 in memory_per_node, 22.05 null.
    rec = {r["job_id"]: r for r in project_load(version, "squeue-mem-per-gpu-running.json")["jobs"]}[1]
    assert number(rec["memory_per_node"]) == (None if version == "22.05" else 500)
    job = project_jobs(version, "squeue-mem-per-gpu-running.json")[1]
    assert job.state is JobState.RUNNING
    assert {k: getattr(job, k) for k in MEM_PER_GPU_JOB} == MEM_PER_GPU_JOB
    # the allocation (job_resources) agrees with the request read per GPU
    assert allocated_mem_per_node(rec["job_resources"]) == [1000, 1000]
    pending = project_jobs(version, "squeue-requeue-held.json")[1]  # no allocation now: read from the request
    assert {k: getattr(pending, k) for k in MEM_PER_GPU_JOB} == MEM_PER_GPU_JOB


@pytest.mark.parametrize("version", ["24.11", "26.05"])
def test_mem_per_gpu_job_from_scontrol_json(version: str) -> None:
    (job,) = parse_jobs(project_load(version, "scontrol-show-job-mem-per-gpu-running.json"))
    assert {k: getattr(job, k) for k in MEM_PER_GPU_JOB} == MEM_PER_GPU_JOB
    assert job == project_jobs(version, "squeue-mem-per-gpu-running.json")[1]


def test_running_job_memory_is_the_allocation() -> None:
    # --mem=0 (the whole node): no request says how much; the allocation does.
    rec = copy.deepcopy(load("24.11", "squeue.json")["jobs"][0])
    rec["job_resources"]["nodes"]["allocation"][0]["memory"]["allocated"] = 16000
    rec["memory_per_node"] = {"set": True, "infinite": False, "number": 0}
    assert job_from_record(rec).mem_per_node_mb == 16000
    rec = copy.deepcopy(load("22.05", "squeue.json")["jobs"][0])
    rec["job_resources"]["allocated_nodes"][0]["memory_allocated"] = 16000
    assert job_from_record(rec).mem_per_node_mb == 16000


# --- the elastic spec in the comment ------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
def test_elastic_comment_becomes_spec(version: str) -> None:
    spec = ElasticSpec(2, 8, gpu_step=2, cpus_per_gpu=4, mem_per_gpu_mb=8000, weight=2.0)
    rec = copy.deepcopy(load(version, "squeue.json")["jobs"][0])
    rec["comment"] = spec.to_comment()
    job = job_from_record(rec)
    assert job.spec == spec and job.spec_error is None and job.elastic


@pytest.mark.parametrize("comment,message", [
    ("elastic:v1 gpus=8-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1", "min GPUs 8 exceeds max GPUs 2"),
    ("elastic:v1 gpus=1-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1 x=1", "not a canonical elastic spec"),
    ("elastic:v1 garbage", "not a canonical elastic spec")])
def test_broken_elastic_comment_is_not_elastic_and_does_not_crash(comment: str, message: str) -> None:
    rec = copy.deepcopy(load("24.11", "squeue.json")["jobs"][0])
    rec["comment"] = comment
    job = job_from_record(rec)
    assert job.spec is None and not job.elastic
    assert job.spec_error and message in job.spec_error


def test_plain_comment_is_ignored() -> None:
    rec = copy.deepcopy(load("22.05", "squeue.json")["jobs"][0])
    rec["comment"] = "my experiment"
    job = job_from_record(rec)
    assert job.spec is None and job.spec_error is None and job.comment == "my experiment"


# --- shapes the captures do not show, as Slurm writes them ------------------------------------------------

def test_gpus_per_job_and_typed_gpus() -> None:
    rec = copy.deepcopy(load("24.11", "squeue.json")["jobs"][1])
    rec.update(tres_per_node="", tres_per_job="gres/gpu:6", node_count={"set": True, "infinite": False, "number": 2},
               tres_req_str="cpu=2,mem=2G,node=2,billing=2")
    assert job_from_record(rec).gpus_per_node == 3
    rec.update(tres_per_node="gres/gpu:a100:2", tres_per_job="")
    assert job_from_record(rec).gpus_per_node == 2


def test_per_gpu_cpus_and_memory_as_22_05_writes_them() -> None:
    # squeue --json of `sbatch -N2 --gres=gpu:2 --cpus-per-gpu=2 --mem-per-gpu=1000` on 22.05.8
    rec = copy.deepcopy(load("22.05", "squeue.json")["jobs"][1])
    rec.update(cpus_per_tres="gres:gpu:2", memory_per_tres="gres:gpu:1000", memory_per_node=None,
               memory_per_cpu=None, tres_per_node="gres:gpu:2", node_count=2, cpus=8,
               tres_req_str="cpu=8,mem=4000M,node=2,billing=8")
    job = job_from_record(rec)
    assert (job.cpus_per_gpu, job.mem_per_gpu_mb, job.mem_per_node_mb, job.cpus_per_node) == (2, 1000, 2000, 4)


def test_unknown_states_are_errors() -> None:
    rec = copy.deepcopy(load("26.05", "squeue.json")["jobs"][0])
    rec["job_state"] = ["FLOATING"]
    with pytest.raises(SlurmParseError, match="FLOATING"):
        job_from_record(rec)
    doc = copy.deepcopy(load("26.05", "scontrol-show-nodes.json"))
    doc["nodes"][0]["state"] = ["LEVITATING"]
    with pytest.raises(SlurmParseError, match="LEVITATING"):
        parse_nodes(doc)


def test_document_without_jobs_or_nodes() -> None:
    with pytest.raises(SlurmParseError):
        parse_jobs({"meta": {}})
    with pytest.raises(SlurmParseError):
        parse_nodes({"meta": {}})
    with pytest.raises(SlurmParseError):
        version_of({"jobs": []})
    assert json  # the module reads real JSON files above


def failed_by_signal(version: str, *, sig: int, exit_status: int = 0) -> dict:
    """Running job 1 of the version's capture as it reads once its batch script ended: killed by `sig`
    (0: exited with `exit_status`). The encodings are the capture's own: 22.05 writes the raw wait
    status as an int, 23.02 on an object {status, return_code, signal: {id, name}}."""
    rec = copy.deepcopy({r["job_id"]: r for r in project_load(version, "squeue-mem-per-gpu-running.json")["jobs"]}[1])
    end = number(rec["start_time"]) + 3
    if version == "22.05":
        rec["job_state"], rec["end_time"] = "FAILED", end
        rec["exit_code"] = sig if sig else exit_status << 8
    else:
        rec["job_state"], rec["end_time"] = ["FAILED"], {"set": True, "infinite": False, "number": end}
        rec["exit_code"] = {"status": ["SIGNALED" if sig else "ERROR"],
                            "return_code": {"set": True, "infinite": False, "number": exit_status},
                            "signal": {"id": {"set": bool(sig), "infinite": False, "number": sig},
                                       "name": "TERM" if sig == 15 else ""}}
    return rec


@pytest.mark.parametrize("version", VERSIONS)
def test_the_signal_that_ended_a_job_and_when(version: str) -> None:
    # control/revive.py reads both: a batch script ended by SIGTERM seconds after its start.
    running = job_from_record({r["job_id"]: r for r in project_load(version, "squeue-mem-per-gpu-running.json")["jobs"]}[1])
    assert (running.exit_signal, running.end_time) == (None, None)   # a running job's end_time is its limit
    killed = job_from_record(failed_by_signal(version, sig=15))
    assert killed.state is JobState.FAILED and killed.exit_signal == 15
    assert killed.end_time is not None and killed.start_time is not None and killed.end_time - killed.start_time == 3
    assert job_from_record(failed_by_signal(version, sig=0, exit_status=1)).exit_signal is None
    assert job_from_record(failed_by_signal(version, sig=9)).exit_signal == 9


def test_a_jobs_reservation_is_its_resv_name() -> None:
    doc = load("24.11", "scontrol-show-job-held.json")
    assert {j.reservation for j in parse_jobs(doc)} == {""}
    doc["jobs"][0]["resv_name"] = "r2"
    assert parse_jobs(doc)[0].reservation == "r2"
