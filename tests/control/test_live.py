"""Live end-to-end tests of the controller on a private 4-node x 4-GPU Slurm 22.05 (see conftest.py).

Node loss is `LocalCluster.node_down(mark_down=True)`: slurmd and its job
processes are SIGKILLed and the node is set DOWN at once, as an admin would,
so the test does not spend the 30 s SlurmdTimeout; Slurm requeues the jobs
that ran there exactly as after a timeout. The timing against plain Slurm is
measured in benchmarks/controller_recovery.py, not asserted here.
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_elastic.cluster.cli_backend import CliBackend
from slurm_elastic.cluster.model import JobState
from slurm_elastic.control.journal import STEPS, Journal
from slurm_elastic.control.plan import Plan
from slurm_elastic.control.protocol import CRASH_ENV
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler
from slurm_elastic.spec import ElasticSpec

pytestmark = pytest.mark.slurm

TEST_USER = "se-elastic-test"
LAST_SEEN: dict[str, object] = {}   # what the last poll saw, for timeout messages


def _allocator_agrees(cluster, ids: list[int]) -> dict[int, int] | None:
    """{job: running GPUs} once a fresh dry-run cycle wants no change and no job is held, else None.

    A job the allocator gives 0 GPUs waits in the queue (pending, not held); every other job runs
    with exactly the GPUs the allocator chose.
    """
    state = cluster.snapshot()
    jobs = {j.job_id: j for j in state.jobs if j.job_id in ids}
    LAST_SEEN["jobs"] = {j.job_id: (j.state.value, j.gpus, j.nodes, j.held, j.reason) for j in jobs.values()}
    if len(jobs) != len(ids) or any(j.held or j.state not in (JobState.RUNNING, JobState.PENDING)
                                    for j in jobs.values()):
        return None
    report = Reconciler(CliBackend(env=cluster.env), Journal(":memory:"),
                        ControllerConfig(node_confirm_s=0, min_resize_interval_s=0)).cycle(dry_run=True)
    LAST_SEEN["plans"] = [p.describe() for p in report.plans]
    LAST_SEEN["targets"] = {j: report.target(j) for j in ids}
    if report.plans or any(report.target(j) is None for j in ids):
        return None  # None: the job was held (by the controller) when the dry run looked again
    for j in ids:
        target, job = report.target(j), jobs[j]
        if (target or 0) > 0 and not (job.state is JobState.RUNNING and job.gpus == target):
            return None
        if not target and job.state is not JobState.PENDING:
            return None
    return {j: (jobs[j].gpus if jobs[j].state is JobState.RUNNING else 0) for j in ids}


def _settled(cluster, ids: list[int]) -> dict[int, int] | None:
    """_allocator_agrees twice, one daemon interval apart (the controller may be mid-plan at the first look)."""
    first = _allocator_agrees(cluster, ids)
    if first is None:
        return None
    time.sleep(2.5)
    return first if _allocator_agrees(cluster, ids) == first else None


def _no_job_held(cluster) -> None:
    held = [j.job_id for j in cluster.snapshot().jobs if j.held]
    assert held == [], f"jobs left held: {held}"


def _last_done_targets(journal_path: Path) -> dict[int, int]:
    return {j: plan.shape.gpus for j, plan in _last_done_plans(journal_path).items()}


def _last_done_plans(journal_path: Path) -> dict[int, Plan]:
    journal = Journal(journal_path)
    try:
        out: dict[int, Plan] = {}
        for rec in reversed(journal.plans(limit=1000)):
            if rec.status == "done":
                out[rec.job_id] = rec.plan
        assert journal.open_plans() == []
        return out
    finally:
        journal.close()


def _three_jobs(cluster, *, user: str | None = None, watch_log: Path | None = None) -> tuple[list[int], object]:
    a = cluster.submit("--gpus=4-8", "--gpu-step=4", name="elastic-a", user=user)
    b = cluster.submit("--gpus=4-8", "--gpu-step=4", name="elastic-b", user=user)
    watcher = None
    if watch_log is None:
        c = cluster.submit("--gpus=2-4", "--gpu-step=2", name="elastic-c", user=user)
    else:
        # The third submission stays in the foreground as the user-mode controller.
        watcher = cluster.spawn("-v", "sbatch", "--watch", "--gpus=2-4", "--gpu-step=2",
                                f"--ckpt-dir={cluster.root / 'ckpt'}", "--job-name=elastic-c",
                                f"--output={cluster.root / 'out'}/%j.out", "--open-mode=append",
                                str(cluster.root / "fake_trainer.sbatch"),
                                log=watch_log, user=user,
                                env={"SLURM_ELASTIC_INTERVAL": "2", "SLURM_ELASTIC_HYSTERESIS": "0",
                                     "SLURM_ELASTIC_ACK_TIMEOUT": "15"})
        def job_id_line() -> str | None:
            return next((ln for ln in watch_log.read_text().splitlines() if ln.startswith("Submitted batch job")),
                        None)
        c = int(cluster.wait_for(job_id_line, 60, what="sbatch --watch job id").split()[-1])
    return [a, b, c], watcher


def _lose_and_regain_n2(cluster, ids: list[int], journal_path: Path) -> None:
    try:
        _lose_and_regain(cluster, ids, journal_path)
    except AssertionError:
        print(cluster.job_outputs())
        raise


def _lose_and_regain(cluster, ids: list[int], journal_path: Path) -> None:
    full = cluster.wait_for(lambda: (g := _settled(cluster, ids)) and sum(g.values()) == 16 and g, 120, 0.5,
                            lambda: f"three jobs settled on 16 GPUs; last seen {LAST_SEEN}")
    assert sum(full.values()) == 16 and all(full.values()), full
    assert {j: g for j, g in _last_done_targets(journal_path).items() if j in ids}.items() <= full.items()

    on_n2 = [j.job_id for j in cluster.snapshot().jobs if j.job_id in ids and "n2" in j.nodes]
    assert on_n2, "some job runs on n2"
    cluster.local.node_down("n2", mark_down=True)
    shrunk = cluster.wait_for(lambda: _settled(cluster, ids), 90, 0.5,
                              lambda: f"jobs resized to 12 GPUs; last seen {LAST_SEEN}")
    assert sum(shrunk.values()) <= 12, shrunk
    state = cluster.snapshot()
    assert not any("n2" in j.nodes for j in state.jobs if j.job_id in ids)
    # The jobs that lost n2 run again (at once, not after Slurm's 120 s BeginTime).
    assert all(state.job(j).restarts >= 1 and shrunk[j] > 0 for j in on_n2), (on_n2, shrunk)
    # What the controller last set for each job it resized is what the job runs with now.
    assert {j: g for j, g in _last_done_targets(journal_path).items() if j in ids}.items() <= shrunk.items()

    cluster.local.node_up("n2")
    grown = cluster.wait_for(lambda: (g := _settled(cluster, ids)) and sum(g.values()) == 16 and g,
                             120, 0.5, lambda: f"jobs grown back to 16 GPUs; last seen {LAST_SEEN}")
    assert sum(grown.values()) == 16
    _no_job_held(cluster)
    # A plan that named nodes started its job there (Slurm's ReqNodeList), not where Slurm's own choice fell.
    state = cluster.snapshot()
    placed = {j: p.place for j, p in _last_done_plans(journal_path).items() if j in ids and p.place and grown[j]}
    assert placed, "some plan named its nodes"
    assert {j: set(state.job(j).nodes) for j in placed} == {j: set(n) for j, n in placed.items()}
    # The fake trainer logged each size it ran with: the last one is what Slurm gave after the resize.
    for job_id in [j for j in ids if grown[j]]:
        sizes = (cluster.root / "ckpt" / str(job_id) / "sizes.log").read_text().strip().splitlines()
        assert f'"gpus": {grown[job_id]},' in sizes[-1], (job_id, sizes[-1])


def test_job_submit_lua_rejects_malformed_and_forces_requeue(elastic_cluster):
    cluster = elastic_cluster
    script = str(cluster.root / "fake_trainer.sbatch")
    bad = "elastic:v1 gpus=8-4 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1"
    proc = subprocess.run(["sbatch", "--parsable", "--hold", f"--comment={bad}", "--gres=gpu:1", "--mem=1G", script],
                          env=cluster.env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "slurm-elastic: rejected: elastic spec: min GPUs 8 exceeds max GPUs 4" in proc.stderr
    good = ElasticSpec(1, 4).to_comment()
    proc = subprocess.run(["sbatch", "--parsable", "--hold", "--no-requeue", f"--comment={good}", "--gres=gpu:1",
                           "--mem=1G", script], env=cluster.env, capture_output=True, text=True, timeout=30, check=True)
    job_id = int(proc.stdout.strip())
    shown = subprocess.run(["scontrol", "show", "job", str(job_id)], env=cluster.env, capture_output=True,
                           text=True, check=True).stdout
    assert "Requeue=1" in shown
    plain = subprocess.run(["sbatch", "--parsable", "--hold", "--no-requeue", "--comment=just a note", "--mem=1G",
                            script], env=cluster.env, capture_output=True, text=True, timeout=30, check=True)
    plain_id = int(plain.stdout.strip())
    shown = subprocess.run(["scontrol", "show", "job", str(plain_id)], env=cluster.env, capture_output=True,
                           text=True, check=True).stdout
    assert "Requeue=0" in shown  # not elastic: untouched
    cluster.cancel_all()


def test_daemon_resizes_on_node_loss_and_grows_back(elastic_cluster, tmp_path):
    cluster = elastic_cluster
    cluster.cancel_all()
    daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "2", "--hysteresis", "0", "--ack-timeout", "15",
                           log=tmp_path / "daemon.log")
    try:
        ids, _ = _three_jobs(cluster)
        _lose_and_regain_n2(cluster, ids, Path(cluster.env["SLURM_ELASTIC_DAEMON_DIR"]) / "journal.sqlite")
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(60)
        print((tmp_path / "daemon.log").read_text()[-3000:])
    assert rc == 0
    assert not (Path(cluster.env["SLURM_ELASTIC_DAEMON_DIR"]) / "daemon.heartbeat").exists()
    log = (tmp_path / "daemon.log").read_text()
    assert "node n2 lost" in log
    cluster.cancel_all()


@pytest.fixture
def unprivileged(elastic_cluster, user_pythons):
    """A plain Linux user who can run slurm-elastic (tests/users.py: the interpreter may be private to root)."""
    runner = user_pythons(TEST_USER)
    state = elastic_cluster.root / "state" / "user"
    state.mkdir(exist_ok=True)
    ent = pwd.getpwnam(TEST_USER)
    os.chown(state, ent.pw_uid, ent.pw_gid)
    elastic_cluster.user_site = runner.site
    elastic_cluster.user_python = runner.python
    saved = elastic_cluster.env["SLURM_ELASTIC_STATE_DIR"], elastic_cluster.env["FAKE_PYTHON"]
    elastic_cluster.env["SLURM_ELASTIC_STATE_DIR"] = str(state)
    elastic_cluster.env["FAKE_PYTHON"] = runner.python     # the user's jobs run the fake trainer with it
    try:
        yield TEST_USER
    finally:
        elastic_cluster.env["SLURM_ELASTIC_STATE_DIR"], elastic_cluster.env["FAKE_PYTHON"] = saved
        elastic_cluster.user_python = None
        elastic_cluster.user_site = None
        for proc in elastic_cluster.procs:      # a watch still running as the user
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_user_mode_watch_resizes_own_jobs_without_a_daemon(elastic_cluster, unprivileged, tmp_path):
    cluster = elastic_cluster
    cluster.cancel_all()
    ids, watcher = _three_jobs(cluster, user=unprivileged, watch_log=tmp_path / "watch.log")
    assert all(cluster.snapshot().job(j).user == unprivileged for j in ids)
    second = cluster.cli("watch", user=unprivileged, check=False, timeout=60)
    assert second.returncode != 0 and "already running" in second.stderr
    try:
        _lose_and_regain_n2(cluster, ids, cluster.root / "state" / "user" / "journal.sqlite")
    except BaseException:
        watcher.kill()
        raise
    finally:
        print((tmp_path / "watch.log").read_text()[-6000:])
    assert watcher.poll() is None, "watch must stay in the foreground while the jobs run"
    cluster.cancel_all()
    assert watcher.wait(60) == 0  # ends by itself once the user's elastic jobs are gone
    assert "watch ended: jobs ended" in (tmp_path / "watch.log").read_text()


@pytest.mark.parametrize("step", STEPS)
def test_daemon_killed_after_each_step_leaves_nothing_held(elastic_cluster, step):
    cluster = elastic_cluster
    cluster.cancel_all()
    ckpt = cluster.root / "ckpt"
    spec = ElasticSpec(4, 8, gpu_step=4, ckpt_dir=str(ckpt))
    # Submitted at 4 GPUs on an empty 16-GPU cluster: the allocator grows it to 8 (a running plan).
    job_id = int(subprocess.run(
        ["sbatch", "--parsable", f"--comment={spec.to_comment()}", "-N1", "--gres=gpu:4", "--cpus-per-gpu=1",
         "--mem-per-gpu=1024M", "--requeue", f"--output={cluster.root / 'out'}/%j.out",
         str(cluster.root / "fake_trainer.sbatch")],
        env={**cluster.env, "SLURM_ELASTIC_CKPT_DIR": str(ckpt)}, capture_output=True, text=True, check=True,
        timeout=30).stdout.strip())
    cluster.wait_for(lambda: cluster.snapshot().job(job_id).state is JobState.RUNNING, 30, what="job running")
    journal_path = Path(cluster.env["SLURM_ELASTIC_DAEMON_DIR"]) / "journal.sqlite"
    args = ("admin", "daemon", "--interval", "1", "--hysteresis", "0", "--ack-timeout", "15")
    crashed = cluster.cli(*args, env={CRASH_ENV: step}, check=False, timeout=120)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    journal = Journal(journal_path)
    [open_plan] = [p for p in journal.open_plans() if p.job_id == job_id]
    assert open_plan.step == step
    journal.close()

    cluster.cli(*args, "--max-cycles", "1", timeout=120)  # the restarted daemon: recovery, then one cycle
    journal = Journal(journal_path)
    assert journal.open_plans() == []
    journal.close()
    job = cluster.snapshot().job(job_id)
    assert not job.held
    assert job.state in (JobState.RUNNING, JobState.PENDING)
    grown = cluster.wait_for(lambda: _settled(cluster, [job_id]), 60, 0.5,
                             lambda: f"job at its allocation; last seen {LAST_SEEN}")
    assert grown == {job_id: 8}
    cluster.cancel_all()
