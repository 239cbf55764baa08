"""Live: the DDP template under srun, signalled and resized 4 -> 2 -> 3 GPUs, resumes exactly."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

from slurm_elastic import jobfiles as protocol

from .launch import run_ranks
from .test_exact_resume import _final, _flat, _losses

TEMPLATE = Path(__file__).resolve().parents[2] / "job_templates" / "ddp.sbatch"
STEPS = 60
# This interpreter, not whatever `python3` the job's PATH finds: the package and its
# dependencies are installed here.
TRAIN = [sys.executable, "-m", "slurm_elastic.train.examples.digits", "--steps", str(STEPS), "--every-steps", "10",
         "--step-sleep", "0.15"]


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _signal_and_resize(cluster, job: int, ck: Path, log: Path, restart: int, nodes: int, gpn: int) -> dict:
    """One elastic restart as the controller does it; returns the ACK and the measured times."""
    seen = len(_lines(log))
    cluster.wait_for(lambda: len(_lines(log)) >= seen + 4, 180, what="training progress")
    ack_path = ck / str(job) / protocol.ack_file_name(job, restart)
    out = ck.parent / f"out-{job}.txt"
    waits = out.read_text().count("waiting up to")    # the output file spans all incarnations
    t0 = time.monotonic()
    cluster.run("scancel", "--signal=USR2", "--full", str(job))
    cluster.wait_for(ack_path.exists, 60, interval=0.02, what="the ACK file")
    t_ack = time.monotonic() - t0
    cluster.wait_for(lambda: out.read_text().count("waiting up to") > waits, 60, interval=0.05,
                     what="srun to end (exit 85)")
    t_exit = time.monotonic() - t0
    assert cluster.job(job)["JobState"] == "RUNNING"     # the template waits instead of completing
    cluster.run("scontrol", "requeuehold", str(job))
    cluster.wait_for(lambda: cluster.job(job).get("JobState") == "PENDING", 60, what="requeue hold")
    # slurmd revokes the old incarnation's credential with one-second resolution; a
    # restart within that second is refused ("Job credential revoked") and the job
    # FAILS. Seen on 22.05 with StartTime=now; so the update starts it 2 s later.
    # Gres alone leaves the CPU count of the old shape (22.05), so CPUs are set too.
    cluster.run("scontrol", "update", f"JobId={job}", f"NumNodes={nodes}", f"Gres=gpu:{gpn}",
                f"NumCPUs={nodes * gpn}", f"MinCPUsNode={gpn}", "StartTime=now+2")
    cluster.run("scontrol", "release", str(job))
    ack = json.loads(ack_path.read_text())
    ack.update(signal_to_ack_s=t_ack, signal_to_exit_s=t_exit)
    return ack


@pytest.mark.slurm
@pytest.mark.heavy
def test_ddp_template_resumes_exactly_across_gpu_counts(slurm_cluster, tmp_path: Path) -> None:
    if slurm_cluster.gpus_per_node < 3 or len(slurm_cluster.nodes) < 2:
        pytest.skip("needs 2 nodes with >= 3 GPUs each")
    ref = tmp_path / "ref"
    for r in run_ranks("slurm_elastic.train.examples.digits",
                       ["--ckpt-dir", str(ref / "ck"), "--steps", str(STEPS), "--every-steps", "10",
                        "--loss-log", str(ref / "loss.jsonl")], world_size=4, job_id="1"):
        assert r.returncode == 0, r.stdout[-3000:]

    ck, log = tmp_path / "ck", tmp_path / "loss.jsonl"
    partition = ["-p", slurm_cluster.partition] if slurm_cluster.partition else []
    out = slurm_cluster.run("sbatch", "--parsable", *partition, "-N2", "--gres=gpu:2", "--cpus-per-gpu=1",
                            "--mem=2G", f"--chdir={tmp_path}", f"--output={tmp_path}/out-%j.txt",
                            f"--export=ALL,SLURM_ELASTIC_CKPT_DIR={ck},SLURM_ELASTIC_REQUEUE_WAIT_S=300,"
                            f"SLURM_ELASTIC_PYTHON={sys.executable}",
                            str(TEMPLATE), *TRAIN, "--loss-log", str(log)).stdout
    job = int(out.strip().split(";")[0])
    try:
        acks = [_signal_and_resize(slurm_cluster, job, ck, log, 0, nodes=1, gpn=2),
                _signal_and_resize(slurm_cluster, job, ck, log, 1, nodes=1, gpn=3)]
        slurm_cluster.wait_for(lambda: slurm_cluster.job(job).get("JobState") in ("COMPLETED", "FAILED"), 300,
                               interval=1, what="the job to finish")
        assert slurm_cluster.job(job)["JobState"] == "COMPLETED", (tmp_path / f"out-{job}.txt").read_text()[-3000:]
    finally:
        slurm_cluster.cancel(job)

    rows = _lines(log)
    # 0 steps lost: each incarnation starts right after the acknowledged step
    for ack in acks:
        assert ack["committed"]
        after = [r for r in rows if r["step"] == ack["step"] + 1]
        assert after, f"no step {ack['step'] + 1} after the restart"
    assert {r["world_size"] for r in rows} == {4, 2, 3}
    want, got = _losses(ref / "loss.jsonl"), _losses(log)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        assert math.isclose(got[step], want[step], rel_tol=1e-9), step
    a, b = _flat(_final(ref / "ck" / "1")["params"]), _flat(_final(ck / str(job))["params"])
    assert max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b) if abs(x) > 1e-8) <= 1e-5
    (tmp_path.parent / "signal-times.json").write_text(json.dumps(acks))
    print("signal-to-exit times:", json.dumps(acks))
