"""Live: a node dies under a real DDP job; the daemon acts on the job's peer-lost report, not on Slurm.

The private cluster runs with SlurmdTimeout=300 (tests/control/conftest.py), so Slurm itself does
not notice a killed slurmd for five minutes, as at many sites. The job (job_templates/ddp.sbatch,
the digits example, one rank on each of two nodes) loses the rank on its second node; its
survivor commits the step every rank completed and writes its peer-lost report; the daemon
shrinks the job to the survivor, requeues it, excludes the lost node for that job and releases
it. The test asserts the job trains again, on two nodes neither of which is the lost one, while
Slurm has not marked the lost node DOWN (so it was the job's word that moved things), with no
completed step lost, and that the other job on the lost node and the node itself were not
touched. It prints where the seconds went.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_elastic.cluster.model import JobState, NodeFlag, NodeState
from slurm_elastic import jobfiles as shim
from tests.control.live_files import json_lines

pytestmark = [pytest.mark.slurm, pytest.mark.heavy]

TEMPLATE = Path(__file__).resolve().parents[2] / "job_templates" / "ddp.sbatch"


def _blockers(cluster) -> dict[str, int]:
    """A plain job holding 3 of the 4 GPUs of every node, so a 2-GPU job must span two nodes."""
    out = {}
    for node in ("n1", "n2", "n3", "n4"):
        proc = subprocess.run(["sbatch", "--parsable", f"--nodelist={node}", "--gres=gpu:3", "--cpus-per-gpu=1",
                               "--mem=1000", "--no-requeue", "--job-name=blocker", "--output=/dev/null",
                               "--wrap", "sleep 3000"], env=cluster.env, capture_output=True, text=True, check=True)
        out[node] = int(proc.stdout.strip().split(";")[0])
    return out


def _show_job(cluster, job_id: int) -> str:
    return subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], env=cluster.env, capture_output=True,
                          text=True, check=False).stdout


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_node_lost_under_a_ddp_job_is_left_behind_on_the_jobs_word(elastic_cluster, tmp_path, how):
    """kill: slurmd and the rank SIGKILLed (connections close). freeze: SIGSTOPped, a hung node whose
    connections stay open; only the heartbeat tells (the collective timeout is 600 s here)."""
    cluster = elastic_cluster
    cluster.cancel_all()
    blockers = _blockers(cluster)
    cluster.wait_for(lambda: all(j.state is JobState.RUNNING for j in cluster.snapshot().jobs
                                 if j.job_id in blockers.values()), 60, what="the blockers running")
    daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "2", "--ack-timeout", "20",
                           log=tmp_path / "daemon.log")
    victim = None
    try:
        ckpt = cluster.root / "ckpt"
        loss_log = cluster.root / "out" / f"peerloss-{how}-loss.jsonl"   # one per run: rows of another mislead
        out = cluster.cli("sbatch", "--parsable", "--gpus=2-2", f"--ckpt-dir={ckpt}", "--job-name=peerloss",
                          f"--output={cluster.root / 'out'}/%j.out", "--open-mode=append", str(TEMPLATE),
                          sys.executable, "-m", "slurm_elastic.train.examples.digits", "--steps", "100000",
                          "--step-sleep", "0.05", "--loss-log", str(loss_log), "--timeout-s", "600")
        job_id = int(out.stdout.strip())
        job_dir = ckpt / str(job_id)

        def running_job():
            job = next(j for j in cluster.snapshot().jobs if j.job_id == job_id)
            return job if job.state is JobState.RUNNING else None

        def training(since: int) -> bool:
            """Three more steps logged (rank 0 logs each completed step) than `since`."""
            return len(json_lines(loss_log)) >= since + 3

        cluster.wait_for(lambda: (j := running_job()) and len(j.nodes) == 2, 180,
                         what=lambda: f"the job running on two nodes; {cluster.slurm_view()}")
        cluster.wait_for(lambda: training(0), 300, what=lambda: f"training to start; {cluster.job_outputs()}")
        job = running_job()
        assert job is not None and job.restarts == 0
        batch_host = _show_job(cluster, job_id).split("BatchHost=")[1].split()[0]
        victim = next(n for n in job.nodes if n != batch_host)   # the node that dies: not the batch script's

        lost_at = time.time()
        logged_before = json_lines(loss_log)
        cluster.local.node_down(victim, freeze=how == "freeze")   # Slurm is not told
        report_path = job_dir / shim.peer_lost_file_name(job_id, 0, 0)
        cluster.wait_for(report_path.exists, 120, what=lambda: f"the peer-lost report; {cluster.job_outputs()}")

        def settled() -> bool:
            try:
                return shim.PeerLostReport.parse(report_path.read_bytes()).commit != "pending"
            except ValueError:
                return False      # being replaced
        cluster.wait_for(settled, 120, what="the survivor's just-in-time commit")
        rows_at_restart = len(json_lines(loss_log))     # the survivor has exited: what follows is the next incarnation

        def restarted():
            j = running_job()
            return j if j is not None and j.restarts >= 1 else None

        again = cluster.wait_for(restarted, 240, 0.5, what=lambda: f"the job restarted; {cluster.slurm_view()}")
        running_at = time.time()
        cluster.wait_for(lambda: training(rows_at_restart), 240, 0.5,
                         what=lambda: f"training again; {cluster.job_outputs()}")
        trained_at = time.time()
        # Left alone, the old srun (its step spanned the dead node) would give up KillWait (30 s) + 2 s after
        # the requeue and then cancel its step by id; the new incarnation must still be training after that.
        time.sleep(max(running_at + 40 - time.time(), 0))
        rows_then = len(json_lines(loss_log))
        cluster.wait_for(lambda: training(rows_then), 120, 0.5, what=lambda: f"still training; {cluster.job_outputs()}")

        # Slurm has not acted: the lost node is not DOWN (at most flagged not responding, after the
        # controller's shrink sent it a kill it could not answer) and its jobs were not requeued.
        state = cluster.snapshot()
        lost_node = state.node(victim)
        assert lost_node.state is not NodeState.DOWN, f"Slurm acted on {victim} itself; the test proves nothing"
        # Training again on two nodes, neither of them the lost one, which this job now excludes.
        again = next(j for j in state.jobs if j.job_id == job_id)
        assert again.state is JobState.RUNNING and len(again.nodes) == 2 and victim not in again.nodes
        assert again.restarts == 1
        assert victim in _show_job(cluster, job_id).split("ExcNodeList=")[1].split()[0]
        # Nothing else moved: the other job on the lost node runs on in Slurm's view, the node is not drained.
        other = next(j for j in state.jobs if j.job_id == blockers[victim])
        assert other.state is JobState.RUNNING and other.restarts == 0
        assert NodeFlag.DRAIN not in lost_node.flags, lost_node.flags
        # No completed step lost: the survivor committed the last step every rank completed, the run resumed there.
        report = shim.PeerLostReport.parse(report_path.read_bytes())
        assert report.lost_nodes == (victim,) and report.commit == "done"
        assert report.committed_step is not None and report.committed_step >= logged_before[-1]["step"]
        if how == "freeze":
            assert report.detected_by == "heartbeat", report   # no connection closed: nothing else could tell
        resumed = [r["step"] for r in json_lines(loss_log)[rows_at_restart:]]
        assert resumed[0] == report.committed_step + 1, (report.committed_step, resumed[:5])
        # The job's output says which path it took and why: a 2-2 GPU job's lone survivor is below its minimum.
        output = (cluster.root / "out" / f"{job_id}.out").read_text()
        assert "do not go on in their processes (fewer survivors than the job's minimum GPUs)" in output, \
            output[-3000:]
        # admin status breaks the restart into its phases, from the marks the job and the daemon wrote.
        status = json.loads(cluster.cli("admin", "status", "--json").stdout)
        last = next(r for r in status["jobs"] if r["job_id"] == job_id)["last_restart"]
        assert last is not None and last["kind"] == "peer loss", last
        marks = last["marks"]
        order = [m for m in ("detected", "stopped", "committed", "requeued", "relaunched", "running") if m in marks]
        assert order == ["detected", "stopped", "committed", "requeued", "relaunched", "running"], marks
        assert [marks[m] for m in order[:-1]] == sorted(marks[m] for m in order[:-1])
        assert marks["running"] >= marks["relaunched"] - 1     # Slurm's start time has 1 s resolution
        assert abs(marks["detected"] - report.detected_at) < 1e-6
        # The batch script SIGKILLed the old srun once the report settled and said so; the daemon then
        # released the job without waiting KillWait (and the new incarnation outlived that srun's time).
        assert (job_dir / shim.launcher_stopped_file_name(job_id, 0, 0)).is_file()
        assert "its batch script stopped the old srun" in (tmp_path / "daemon.log").read_text()
        print("admin status:", last["line"])
        print(f"lost {victim} ({how}) -> detected {report.detected_at - lost_at:.1f} s, restarted (running) "
              f"{running_at - lost_at:.1f} s, training again {trained_at - lost_at:.1f} s "
              f"(SlurmdTimeout 300 s); committed step {report.committed_step}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(60)
        print((tmp_path / "daemon.log").read_text()[-4000:])
        if victim is not None:
            if how == "freeze":
                cluster.local.node_down(victim)   # the stopped processes killed, then the node started again
            cluster.local.node_up(victim, timeout=120)
        cluster.cancel_all()
    assert rc == 0


def test_a_job_whose_batch_host_is_lost_is_requeued_by_slurm_and_trains_on_with_its_gpus(elastic_cluster, tmp_path):
    """The node that dies is the job's batch host: Slurm never takes it from a running job, and a job
    requeued while the dead host holds it COMPLETING restarts without its GPUs (22.05.8: `Invalid generic
    resource (gres) specification` at its first srun, FAILED, and the GPUs of its new node counted as used
    until a reconfigure). The daemon holds it for Slurm's own requeue once Slurm marks the node DOWN
    (SlurmdTimeout shortened to 30 s here for that), and the job trains on, its GPUs with it."""
    cluster = elastic_cluster
    cluster.cancel_all()
    blockers = _blockers(cluster)
    cluster.wait_for(lambda: all(j.state is JobState.RUNNING for j in cluster.snapshot().jobs
                                 if j.job_id in blockers.values()), 60, what="the blockers running")
    old_timeout = cluster.local.set_slurmd_timeout(30)
    daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "2", "--ack-timeout", "20",
                           log=tmp_path / "daemon.log")
    victim = None
    try:
        ckpt = cluster.root / "ckpt"
        loss_log = cluster.root / "out" / "batchhost-loss.jsonl"
        out = cluster.cli("sbatch", "--parsable", "--gpus=2-2", f"--ckpt-dir={ckpt}", "--job-name=batchhost",
                          f"--output={cluster.root / 'out'}/%j.out", "--open-mode=append", str(TEMPLATE),
                          sys.executable, "-m", "slurm_elastic.train.examples.digits", "--steps", "100000",
                          "--step-sleep", "0.05", "--loss-log", str(loss_log), "--timeout-s", "600")
        job_id = int(out.stdout.strip())
        job_dir = ckpt / str(job_id)

        def job_now():
            return next(j for j in cluster.snapshot().jobs if j.job_id == job_id)

        cluster.wait_for(lambda: (j := job_now()).state is JobState.RUNNING and len(j.nodes) == 2, 180,
                         what=lambda: f"the job running on two nodes; {cluster.slurm_view()}")
        cluster.wait_for(lambda: len(json_lines(loss_log)) >= 3, 300, what=lambda: f"training; {cluster.job_outputs()}")
        # The rows above are the first start's: a job restarted before the loss is another case than this one.
        assert job_now().restarts == 0, f"restarted before its node was lost; {cluster.job_output(job_id)}"
        victim = _show_job(cluster, job_id).split("BatchHost=")[1].split()[0]
        cluster.local.node_down(victim)          # slurmd, the batch script and the rank there SIGKILLed
        report_path = job_dir / shim.peer_lost_file_name(job_id, 0, 0)

        def settled() -> bool:
            try:
                return shim.PeerLostReport.parse(report_path.read_bytes()).commit != "pending"
            except (OSError, ValueError):
                return False

        def why_not_settled() -> str:
            def text(path: Path, tail: int) -> str:
                return path.read_text(errors="replace")[-tail:] if path.is_file() else "none"
            return (f"the survivor's just-in-time commit; report: {text(report_path, 2000)}; "
                    f"{cluster.job_output(job_id)}\n== daemon.log\n{text(tmp_path / 'daemon.log', 4000)}")
        cluster.wait_for(settled, 120, what=why_not_settled)
        report = shim.PeerLostReport.parse(report_path.read_bytes())
        assert report.commit == "done" and report.lost_nodes == (victim,), report

        def restarted():
            j = job_now()
            return j if j.state is JobState.RUNNING and j.restarts >= 1 else None

        again = cluster.wait_for(restarted, 300, 0.5, what=lambda: f"the job restarted; {cluster.slurm_view()}")
        assert victim not in again.nodes and len(again.nodes) == 2, again
        rows = len(json_lines(loss_log))
        cluster.wait_for(lambda: [r for r in json_lines(loss_log)[rows:] if r["step"] > report.committed_step],
                         240, 0.5, what=lambda: f"training again; {cluster.job_outputs()}")
        resumed = [r["step"] for r in json_lines(loss_log)[rows:]]
        assert resumed[0] <= report.committed_step + 1, (report.committed_step, resumed[:5])   # no step lost
        output = (cluster.root / "out" / f"{job_id}.out").read_text()
        assert "Invalid generic resource" not in output, output[-3000:]
        log_text = (tmp_path / "daemon.log").read_text()
        assert "its batch host is lost: held for Slurm's own requeue" in log_text, log_text[-3000:]
        assert cluster.snapshot().node(victim).state is NodeState.DOWN    # Slurm noticed; we did not requeue it
        cluster.cancel_all()
        # Every GPU Slurm counts as used goes back with the jobs (the requeue on a dead batch host leaked them).
        cluster.wait_for(lambda: all(n.gpus_alloc == 0 for n in cluster.snapshot().nodes if n.name != victim), 60,
                         what=lambda: f"the GPUs released; {cluster.slurm_view()}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(60)
        print((tmp_path / "daemon.log").read_text()[-4000:])
        if victim is not None:
            cluster.local.node_up(victim, timeout=120)
        cluster.local.set_slurmd_timeout(old_timeout)
        cluster.cancel_all()
    assert rc == 0


STEPS_KEPT = "1500"


@pytest.mark.parametrize("path", ["kept", "relaunched"])
def test_a_job_whose_survivors_hold_all_it_can_get_is_shrunk_in_place_and_trains_on(elastic_cluster, tmp_path,
                                                                                     path):
    """Every other GPU is taken: the daemon gives up the lost node and leaves the job running (no requeue).
    kept (the default): the survivor keeps its process and re-forms the group alone (train/regroup.py);
    relaunched (SLURM_ELASTIC_KEEP_RANKS=0): the template relaunches the ranks on the survivor. Either
    resumes from the just-in-time commit."""
    cluster = elastic_cluster
    cluster.cancel_all()
    blockers = _blockers(cluster)
    cluster.wait_for(lambda: all(j.state is JobState.RUNNING for j in cluster.snapshot().jobs
                                 if j.job_id in blockers.values()), 60, what="the blockers running")
    # The daemon places the job (submitted 1x2, which fits nowhere) as 2x1.
    daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "2", "--ack-timeout", "20",
                           log=tmp_path / "daemon.log")
    victim = None
    try:
        ckpt = cluster.root / "ckpt"
        loss_log = cluster.root / "out" / f"inplace-{path}-loss.jsonl"
        out = cluster.cli("sbatch", "--parsable", "--gpus=1-2", f"--ckpt-dir={ckpt}", "--job-name=inplace",
                          f"--output={cluster.root / 'out'}/%j.out", "--open-mode=append", str(TEMPLATE),
                          sys.executable, "-m", "slurm_elastic.train.examples.digits",
                          # kept: the job trains to its end after the loss (about 100 s at one rank here)
                          "--steps", STEPS_KEPT if path == "kept" else "100000",
                          "--step-sleep", "0.05", "--loss-log", str(loss_log), "--timeout-s", "600",
                          env={"SLURM_ELASTIC_KEEP_RANKS": "1" if path == "kept" else "0"})
        job_id = int(out.stdout.strip())
        job_dir = ckpt / str(job_id)

        def job_now():
            return next(j for j in cluster.snapshot().jobs if j.job_id == job_id)

        first = cluster.wait_for(lambda: (j := job_now()).state is JobState.RUNNING and len(j.nodes) == 2 and j,
                                 180, what=lambda: f"the job running on two nodes; {cluster.slurm_view()}")
        for node in ("n1", "n2", "n3", "n4"):   # the last free GPUs taken: nothing is free anywhere else
            if node not in first.nodes:
                subprocess.run(["sbatch", "--parsable", f"--nodelist={node}", "--gres=gpu:1", "--cpus-per-gpu=1",
                                "--mem=100", "--no-requeue", "--job-name=filler", "--output=/dev/null",
                                "--wrap", "sleep 3000"], env=cluster.env, capture_output=True, text=True, check=True)
        cluster.wait_for(lambda: not [j for j in cluster.snapshot().jobs if j.state is JobState.PENDING], 60,
                         what="the fillers running")
        cluster.wait_for(lambda: len(json_lines(loss_log)) >= 3, 300, what=lambda: f"training; {cluster.job_outputs()}")
        batch_host = _show_job(cluster, job_id).split("BatchHost=")[1].split()[0]
        victim = next(n for n in first.nodes if n != batch_host)
        survivor = batch_host

        lost_at = time.time()
        cluster.local.node_down(victim)      # slurmd and the rank there SIGKILLed; Slurm is not told
        report_path = job_dir / shim.peer_lost_file_name(job_id, 0, 0)

        def settled() -> bool:
            try:
                return shim.PeerLostReport.parse(report_path.read_bytes()).commit != "pending"
            except (OSError, ValueError):
                return False
        cluster.wait_for(settled, 120, what=lambda: f"the survivor's just-in-time commit; {cluster.job_outputs()}")
        rows_at_loss = len(json_lines(loss_log))
        cluster.wait_for(lambda: len(json_lines(loss_log)) >= rows_at_loss + 3, 240, 0.5,
                         what=lambda: f"training again in place; {cluster.job_outputs()}")
        trained_at = time.time()

        # The same incarnation, on the survivor only: shrunk, not requeued; Slurm has not acted. (Kept ranks
        # train again before the daemon's next cycle gives the lost node up.)
        job = cluster.wait_for(lambda: (j := job_now()).nodes == (survivor,) and j, 60, 0.5,
                               what=lambda: f"the job shrunk to {survivor}; {cluster.slurm_view()}")
        assert job.state is JobState.RUNNING and job.nodes == (survivor,) and job.restarts == 0, job
        assert cluster.snapshot().node(victim).state is not NodeState.DOWN
        report = shim.PeerLostReport.parse(report_path.read_bytes())
        assert report.commit == "done" and report.lost_nodes == (victim,)
        # The first step at the new size follows the committed one (kept ranks may be rows past it already).
        resumed = [r["step"] for r in json_lines(loss_log) if r["world_size"] == 1]
        assert resumed[0] == report.committed_step + 1, (report.committed_step, resumed[:5])
        cluster.wait_for(lambda: "shrunk in place" in (tmp_path / "daemon.log").read_text(), 30, 0.5,
                         what="the daemon's 'shrunk in place'")
        output = (cluster.root / "out" / f"{job_id}.out").read_text()
        if path == "kept":
            # One process from start to end: the session before the loss and the one after it log one pid.
            pids = {line.split("[")[1].split("]")[0] for line in output.splitlines()
                    if "elastic session: rank 0/" in line}
            assert "rank 0 goes on as rank 0 of 1" in output and len(pids) == 1, output[-4000:]
            assert "re-formed their group in their processes" in output
            assert "relaunching the ranks" not in output
        else:
            assert "relaunching the ranks (step 1)" in output
        # Either way the batch script told the daemon it goes on in place (so the job was not requeued).
        said = (job_dir / shim.launcher_stopped_file_name(job_id, 0, 0)).read_text().strip()
        assert said == ("kept" if path == "kept" else "in-place")
        # The blockers (other users' jobs on the lost node among them) were not touched.
        state = cluster.snapshot()
        assert all(j.state is JobState.RUNNING and j.restarts == 0 for j in state.jobs if j.job_id in blockers.values())

        def last_restart():
            # The daemon says "shrunk in place" inside the plan and journals it done a moment later.
            status = json.loads(cluster.cli("admin", "status", "--json").stdout)
            return next(r for r in status["jobs"] if r["job_id"] == job_id)["last_restart"]

        last = cluster.wait_for(last_restart, 60, 1, what="the in-place plan journaled done")
        assert last["kind"] == ("peer loss, ranks kept" if path == "kept" else "peer loss, in place"), last
        print("admin status:", last["line"])
        if path == "kept":
            # Its srun still waits for the dead node's task (Slurm counts the node up until SlurmdTimeout):
            # the batch script ends the job on the kept ranks' own word that they ended.
            done = cluster.wait_for(lambda: (j := job_now()).state.finished and j, 600, 2,
                                    what=lambda: f"the job to end after training; {cluster.job_outputs()}")
            assert done.state is JobState.COMPLETED and done.restarts == 0, (done, cluster.job_outputs())
            assert json_lines(loss_log)[-1]["step"] == int(STEPS_KEPT)
            # the srun it ended is reaped quietly: no shell "Killed srun ..." line that reads as an error
            assert " Killed " not in (cluster.root / "out" / f"{job_id}.out").read_text()
            # and it says so: a later requeue of the job would not wait KillWait for that srun
            said = (job_dir / shim.launcher_stopped_file_name(job_id, 0, 0)).read_text().strip()
            assert said == "stopped", said
        print(f"{path}: lost {victim} -> detected {report.detected_at - lost_at:.1f} s, training again in place "
              f"{trained_at - lost_at:.1f} s (SlurmdTimeout 300 s); committed step {report.committed_step}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(60)
        print((tmp_path / "daemon.log").read_text()[-4000:])
        if victim is not None:
            cluster.local.node_up(victim, timeout=120)
        cluster.cancel_all()
    assert rc == 0


def test_a_hydra_style_runner_that_exits_1_still_commits_and_the_job_trains_on_in_place(elastic_cluster, tmp_path):
    """The training loop runs under a runner that catches the lost peer's error, logs it and exits 1
    (tests/control/hydra_style_train.py, as Hydra's run_and_report does): the survivor still commits
    the last step every rank completed and goes on in its process, 0 steps lost."""
    cluster = elastic_cluster
    cluster.cancel_all()
    blockers = _blockers(cluster)
    cluster.wait_for(lambda: all(j.state is JobState.RUNNING for j in cluster.snapshot().jobs
                                 if j.job_id in blockers.values()), 60, what="the blockers running")
    daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "2", "--ack-timeout", "20",
                           log=tmp_path / "daemon.log")
    victim = None
    try:
        ckpt = cluster.root / "ckpt"
        loss_log = cluster.root / "out" / "hydra-loss.jsonl"
        script = Path(__file__).resolve().parent / "hydra_style_train.py"
        out = cluster.cli("sbatch", "--parsable", "--gpus=1-2", f"--ckpt-dir={ckpt}", "--job-name=hydra",
                          f"--output={cluster.root / 'out'}/%j.out", "--open-mode=append", str(TEMPLATE),
                          sys.executable, str(script), "--loss-log", str(loss_log))
        job_id = int(out.stdout.strip())
        job_dir = ckpt / str(job_id)

        def job_now():
            return next(j for j in cluster.snapshot().jobs if j.job_id == job_id)

        first = cluster.wait_for(lambda: (j := job_now()).state is JobState.RUNNING and len(j.nodes) == 2 and j,
                                 180, what=lambda: f"the job running on two nodes; {cluster.slurm_view()}")
        for node in ("n1", "n2", "n3", "n4"):   # nothing free elsewhere: the daemon shrinks in place
            if node not in first.nodes:
                subprocess.run(["sbatch", "--parsable", f"--nodelist={node}", "--gres=gpu:1", "--cpus-per-gpu=1",
                                "--mem=100", "--no-requeue", "--job-name=filler", "--output=/dev/null",
                                "--wrap", "sleep 3000"], env=cluster.env, capture_output=True, text=True, check=True)
        cluster.wait_for(lambda: len(json_lines(loss_log)) >= 3, 300, what=lambda: f"training; {cluster.job_outputs()}")
        batch_host = _show_job(cluster, job_id).split("BatchHost=")[1].split()[0]
        victim = next(n for n in first.nodes if n != batch_host)
        logged_before = json_lines(loss_log)

        cluster.local.node_down(victim)      # slurmd and the rank there SIGKILLed: the survivor's collective fails
        report_path = job_dir / shim.peer_lost_file_name(job_id, 0, 0)

        def settled() -> bool:
            try:
                return shim.PeerLostReport.parse(report_path.read_bytes()).commit != "pending"
            except (OSError, ValueError):
                return False
        cluster.wait_for(settled, 120, what=lambda: f"the survivor's just-in-time commit; {cluster.job_outputs()}")
        rows_at_loss = len(json_lines(loss_log))
        cluster.wait_for(lambda: len(json_lines(loss_log)) >= rows_at_loss + 3, 240, 0.5,
                         what=lambda: f"training again in place; {cluster.job_outputs()}")

        outputs = (cluster.root / "out" / f"{job_id}.out").read_text()
        # Where the loss reached the loop (DDP's backward, the loop's all-reduce), the runner caught it and
        # exited 1; then, or where the session's own all-reduce saw it, the session's word: the survivor goes
        # on in its process (train/regroup.py).
        caught = outputs.find("Error executing job")
        assert outputs.find("goes on as rank 0 of 1", max(caught, 0)) >= 0, outputs[-4000:]
        report = shim.PeerLostReport.parse(report_path.read_bytes())
        assert report.commit == "done" and report.lost_nodes == (victim,), report
        assert report.committed_step is not None and report.committed_step >= logged_before[-1]["step"]
        # 0 steps lost: the steps go on one by one through the loss, none done twice, none skipped
        steps = [r["step"] for r in json_lines(loss_log)]
        assert steps == list(range(steps[0], steps[0] + len(steps))) and report.committed_step in steps, steps
        job = cluster.wait_for(lambda: (j := job_now()).nodes == (batch_host,) and j, 60, 0.5,
                               what=lambda: f"the job shrunk to {batch_host}; {cluster.slurm_view()}")
        assert job.state is JobState.RUNNING and job.restarts == 0, job
        assert "relaunching the ranks" not in outputs
        print(f"hydra-style: lost {victim}, committed step {report.committed_step}, steps {steps[0]}..{steps[-1]}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(60)
        print((tmp_path / "daemon.log").read_text()[-4000:])
        if victim is not None:
            cluster.local.node_up(victim, timeout=120)
        cluster.cancel_all()
    assert rc == 0
