"""Live: two DDP jobs on one node at once, one of them with its old job-id-derived port held by someone else."""

from __future__ import annotations

import errno
import json
import socket
import sys
from pathlib import Path

import pytest

from slurm_elastic import jobfiles as protocol

TEMPLATE = Path(__file__).resolve().parents[2] / "job_templates" / "ddp.sbatch"
TRAIN = [sys.executable, "-m", "slurm_elastic.train.examples.digits", "--steps", "30", "--step-sleep", "0.2"]


def _old_derived_port(job_id: int) -> int:
    # What environment.derived_port gave before rank 0 took a port from the kernel.
    return 20000 + (job_id * 7) % 10000


@pytest.mark.slurm
def test_two_jobs_on_one_node_meet_on_ports_that_cannot_collide(slurm_cluster, tmp_path: Path) -> None:
    if slurm_cluster.gpus_per_node < 4:
        pytest.skip("needs a node with 4 GPUs")
    node = slurm_cluster.nodes[0]
    partition = ["-p", slurm_cluster.partition] if slurm_cluster.partition else []
    jobs = []
    for name in ("a", "b"):
        ck = tmp_path / name / "ck"
        ck.parent.mkdir()
        out = slurm_cluster.run("sbatch", "--parsable", "--hold", *partition, "-N1", f"-w{node}", "--gres=gpu:2",
                                "--cpus-per-gpu=1", "--mem=1G", f"--chdir={ck.parent}",
                                f"--output={ck.parent}/out-%j.txt",
                                f"--export=ALL,SLURM_ELASTIC_CKPT_DIR={ck},SLURM_ELASTIC_PYTHON={sys.executable}",
                                str(TEMPLATE), *TRAIN, "--loss-log", str(ck.parent / "loss.jsonl")).stdout
        jobs.append((int(out.strip().split(";")[0]), ck))
    # Someone else listens on the port the old scheme would have given the first job (the
    # local cluster's nodes share this host, so this is "the same node"). Where another process
    # (another suite's slurmd, say) holds it already, that is the same situation.
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        squatter.bind(("0.0.0.0", _old_derived_port(jobs[0][0])))
        squatter.listen()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
    try:
        for job, _ in jobs:
            slurm_cluster.run("scontrol", "release", str(job))
        # Both run at the same time on the same node.
        slurm_cluster.wait_for(lambda: all(slurm_cluster.job(j).get("JobState") in ("RUNNING", "COMPLETED", "FAILED")
                                           for j, _ in jobs), 120, what="both jobs to start")
        slurm_cluster.wait_for(lambda: all(slurm_cluster.job(j).get("JobState") in ("COMPLETED", "FAILED")
                                           for j, _ in jobs), 300, interval=1, what="both jobs to finish")
        for job, ck in jobs:
            out = (ck.parent / f"out-{job}.txt").read_text()
            assert slurm_cluster.job(job)["JobState"] == "COMPLETED", out[-3000:]
            assert slurm_cluster.job(job)["NodeList"] == node
    finally:
        squatter.close()
        slurm_cluster.cancel(*[j for j, _ in jobs])
    ports = []
    for job, ck in jobs:
        rdv = json.loads((ck / str(job) / protocol.run_dir_name(job, 0, 0) / protocol.RENDEZVOUS_FILE).read_text())
        assert rdv["world_size"] == 2
        ports.append(rdv["port"])
        rows = [json.loads(x) for x in (ck.parent / "loss.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, 31)) and {r["world_size"] for r in rows} == {2}
    assert ports[0] != ports[1] and _old_derived_port(jobs[0][0]) not in ports
    # The two jobs really overlapped in time (else this would not test sharing a node).
    starts = [slurm_cluster.job(j)["StartTime"] for j, _ in jobs]
    ends = [slurm_cluster.job(j)["EndTime"] for j, _ in jobs]
    assert max(starts) < min(ends), (starts, ends)
