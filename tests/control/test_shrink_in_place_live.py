"""Live: the daemon gives a rigid job the GPU an elastic job borrowed, shrinking that job in place.

A real DDP job (job_templates/ddp.sbatch, the digits example, one rank on each of two nodes, every other
GPU taken) runs under the daemon; a plain job then asks for one GPU. The daemon gives up the elastic
job's second node (`scontrol update NodeList=`: Slurm SIGKILLs the rank there), sends no signal and
requeues nothing; the surviving rank commits the step every rank completed and goes on in its process
at the new size (train/regroup.py). The test asserts the path taken (same incarnation, one process),
that no completed step was lost, the resumed step, and that the rigid job runs on the node given up.
A growth, which Slurm cannot do to a running job, is asserted the same way on its requeue path.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from slurm_elastic.cluster.model import JobState
from slurm_elastic import jobfiles as shim
from tests.control.live_files import json_lines
from tests.control.test_peer_loss_live import TEMPLATE, _blockers, _show_job

pytestmark = [pytest.mark.slurm, pytest.mark.heavy]


def _filler(cluster, node: str) -> int:
    """A plain 1-GPU job pinned to `node`."""
    proc = subprocess.run(["sbatch", "--parsable", f"--nodelist={node}", "--gres=gpu:1", "--cpus-per-gpu=1",
                           "--mem=100", "--no-requeue", "--job-name=filler", "--output=/dev/null",
                           "--wrap", "sleep 3000"], env=cluster.env, capture_output=True, text=True, check=True)
    return int(proc.stdout.strip().split(";")[0])


def _ddp_job(cluster, name: str, loss_log) -> int:
    """The DDP template with the digits example, 1-2 GPUs, logging every step's loss to `loss_log`."""
    out = cluster.cli("sbatch", "--parsable", "--gpus=1-2", f"--ckpt-dir={cluster.root / 'ckpt'}",
                      f"--job-name={name}", f"--output={cluster.root / 'out'}/%j.out", "--open-mode=append",
                      str(TEMPLATE), sys.executable, "-m", "slurm_elastic.train.examples.digits", "--steps",
                      "100000", "--step-sleep", "0.05", "--loss-log", str(loss_log), "--timeout-s", "600")
    return int(out.stdout.strip())


def _job(cluster, job_id: int):
    return next(j for j in cluster.snapshot().jobs if j.job_id == job_id)


def _last_restart(cluster, job_id: int):
    """What `admin status --json` says of the job's last restart (None until its plan is journaled done)."""
    status = json.loads(cluster.cli("admin", "status", "--json").stdout)
    return next(r for r in status["jobs"] if r["job_id"] == job_id)["last_restart"]


def test_a_rebalance_shrink_on_healthy_nodes_keeps_the_ranks_and_loses_no_step(elastic_cluster, tmp_path):
    cluster = elastic_cluster
    cluster.cancel_all()
    blockers = _blockers(cluster)
    cluster.wait_for(lambda: all(j.state is JobState.RUNNING for j in cluster.snapshot().jobs
                                 if j.job_id in blockers.values()), 60, what="the blockers running")
    daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "2", "--ack-timeout", "20",
                           log=tmp_path / "daemon.log")
    try:
        loss_log = cluster.root / "out" / "shrink-kept-loss.jsonl"
        job_id = _ddp_job(cluster, "shrinkkept", loss_log)
        job_dir = cluster.root / "ckpt" / str(job_id)

        def job_now():
            return _job(cluster, job_id)

        first = cluster.wait_for(lambda: (j := job_now()).state is JobState.RUNNING and len(j.nodes) == 2 and j,
                                 180, what=lambda: f"the job running on two nodes; {cluster.slurm_view()}")
        for node in ("n1", "n2", "n3", "n4"):   # the last free GPUs taken elsewhere
            if node not in first.nodes:
                _filler(cluster, node)
        cluster.wait_for(lambda: not [j for j in cluster.snapshot().jobs if j.state is JobState.PENDING], 60,
                         what="the fillers running")
        marker = job_dir / shim.keeps_ranks_file_name(job_id, 0)
        cluster.wait_for(lambda: len(json_lines(loss_log)) >= 3 and marker.exists(), 300,
                         what=lambda: f"training, its script's keeps-ranks word; {cluster.job_outputs()}")
        batch_host = _show_job(cluster, job_id).split("BatchHost=")[1].split()[0]
        given_up = next(n for n in first.nodes if n != batch_host)

        asked_at = time.time()
        proc = subprocess.run(["sbatch", "--parsable", "--gres=gpu:1", "--cpus-per-gpu=1", "--mem=100",
                               "--no-requeue", "--job-name=rigid", "--output=/dev/null", "--wrap", "sleep 3000"],
                              env=cluster.env, capture_output=True, text=True, check=True)
        rigid = int(proc.stdout.strip().split(";")[0])
        job = cluster.wait_for(lambda: (j := job_now()).nodes == (batch_host,) and j, 120, 0.5,
                               what=lambda: f"the job shrunk to {batch_host}; {cluster.slurm_view()}")
        rows_at_shrink = len(json_lines(loss_log))
        cluster.wait_for(lambda: any(r["world_size"] == 1 for r in json_lines(loss_log)[rows_at_shrink - 2:])
                         and len(json_lines(loss_log)) >= rows_at_shrink + 3, 120, 0.5,
                         what=lambda: f"training again at one rank; {cluster.job_outputs()}")
        trained_at = time.time()
        # The same incarnation, never requeued; the rigid job got the node given up.
        assert job.state is JobState.RUNNING and job.restarts == 0, job
        cluster.wait_for(lambda: (r := next(j for j in cluster.snapshot().jobs if j.job_id == rigid)).state
                         is JobState.RUNNING and r.nodes == (given_up,), 60, 0.5,
                         what=lambda: f"the rigid job running on {given_up}; {cluster.slurm_view()}")
        # No completed step lost: the survivor committed every step logged at two ranks and went on after it.
        report = shim.PeerLostReport.parse((job_dir / shim.peer_lost_file_name(job_id, 0, 0)).read_bytes())
        assert report.commit == "done" and report.lost_nodes == (given_up,)
        rows = json_lines(loss_log)
        before = max(r["step"] for r in rows if r["world_size"] == 2)
        resumed = [r["step"] for r in rows if r["world_size"] == 1]
        assert report.committed_step >= before and resumed[0] == report.committed_step + 1, (before, report, resumed[:5])
        # Its first metrics row at the new size says its ranks went on in their processes: the controller
        # measures what that path costs apart from a relaunch (control/requests/measuring.py).
        metrics = job_dir / shim.METRICS_FILE
        flagged = cluster.wait_for(lambda: [r for r in json_lines(metrics) if r.get("in_place")], 60, 0.5,
                                   what=lambda: f"a metrics row after the shrink; {json_lines(metrics)[-3:]}")
        assert [r["gpus"] for r in flagged] == [1], json_lines(metrics)
        out_file = cluster.root / "out" / f"{job_id}.out"
        # The batch script says so at its next look (every half second), after the ranks trained on.
        output = cluster.wait_for(lambda: "re-formed their group in their processes" in (t := out_file.read_text())
                                  and t, 30, 0.5, what=lambda: f"the script's word; {out_file.read_text()[-3000:]}")
        pids = {line.split("[")[1].split("]")[0] for line in output.splitlines() if "elastic session: rank 0/" in line}
        assert "re-formed their group in their processes" in output and len(pids) == 1, output[-4000:]
        assert "relaunching the ranks" not in output
        log = (tmp_path / "daemon.log").read_text()
        assert "shrunk in place to" in log and f"job {job_id}: sent" not in log and "requeued and held" not in log

        last = cluster.wait_for(lambda: _last_restart(cluster, job_id), 60, 1, what="the shrink journaled done")
        assert last["kind"] == "resize, ranks kept" and last["marks"].get("first_step"), last
        print("admin status:", last["line"])
        print(f"rigid job asked at 0 s; training again at one rank {trained_at - asked_at:.1f} s; "
              f"committed step {report.committed_step}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(60)
        print((tmp_path / "daemon.log").read_text()[-4000:])
        cluster.cancel_all()
    assert rc == 0


def test_a_growth_goes_through_the_signalled_checkpoint_and_requeue_and_loses_no_step(elastic_cluster, tmp_path):
    """Growth cannot keep the ranks (Slurm does not grow a running job, docs/slurm-backends.md): a DDP job at
    1 GPU grows to 2 when a GPU is freed, through signal, checkpoint ACK and requeue; it resumes at the step
    after the acknowledged one, and every step logged before is at or below it."""
    cluster = elastic_cluster
    cluster.cancel_all()
    blockers = _blockers(cluster)
    fillers = {}
    for node in ("n2", "n3", "n4"):       # one free GPU left in the cluster, on n1
        fillers[node] = _filler(cluster, node)
    cluster.wait_for(lambda: all(j.state is JobState.RUNNING for j in cluster.snapshot().jobs
                                 if j.job_id in (*blockers.values(), *fillers.values())), 60, what="blockers, fillers")
    # No hysteresis, linear speeds: the grow comes as soon as the GPU is free (the digits job measures no
    # faster at 2 CPU ranks).
    daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "2", "--ack-timeout", "20", "--hysteresis", "0",
                           "--speed", "linear", log=tmp_path / "daemon.log")
    try:
        loss_log = cluster.root / "out" / "grow-loss.jsonl"
        job_id = _ddp_job(cluster, "grow", loss_log)
        job_dir = cluster.root / "ckpt" / str(job_id)

        def job_now():
            return _job(cluster, job_id)

        cluster.wait_for(lambda: (j := job_now()).state is JobState.RUNNING and j.gpus == 1, 180,
                         what=lambda: f"the job running at 1 GPU; {cluster.slurm_view()}")
        cluster.wait_for(lambda: len(json_lines(loss_log)) >= 3, 300, what=lambda: f"training; {cluster.job_outputs()}")
        freed_at = time.time()
        subprocess.run(["scancel", str(fillers["n2"])], env=cluster.env, check=True)
        cluster.wait_for(lambda: (j := job_now()).restarts == 1 and j.state is JobState.RUNNING and j.gpus == 2,
                         180, 0.5, what=lambda: f"the job grown to 2 GPUs; {cluster.slurm_view()}")
        cluster.wait_for(lambda: len([r for r in json_lines(loss_log) if r["world_size"] == 2]) >= 3, 180, 0.5,
                         what=lambda: f"training at two ranks; {cluster.job_outputs()}")
        grown_at = time.time()
        ack = shim.Ack.parse(json.loads((job_dir / shim.ack_file_name(job_id, 0)).read_text()))
        assert ack.committed and ack.step is not None, ack
        rows = json_lines(loss_log)
        before = max(r["step"] for r in rows if r["world_size"] == 1)
        after = [r["step"] for r in rows if r["world_size"] == 2]
        assert before <= ack.step and after[0] == ack.step + 1, (before, ack, after[:5])
        log = (tmp_path / "daemon.log").read_text()
        assert f"job {job_id}: sent" in log and "requeued and held" in log

        last = cluster.wait_for(lambda: _last_restart(cluster, job_id), 60, 1, what="the grow journaled done")
        assert last["kind"] == "resize", last
        print("admin status:", last["line"])
        print(f"GPU freed at 0 s; training at two ranks {grown_at - freed_at:.1f} s; acknowledged step {ack.step}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(60)
        print((tmp_path / "daemon.log").read_text()[-4000:])
        cluster.cancel_all()
    assert rc == 0
