"""Controller faults on a live private Slurm: slurmctld restarted under the daemon, a node lost mid-plan, flapping.

tests/control/test_live.py already kills the daemon after each protocol step
through its own test hook (SLURM_ELASTIC_CRASH_AFTER). Here the faults come
from outside the daemon: a real SIGKILL at the moment the journal shows a
step as taken, slurmctld going away, nodes failing while a plan is open.
After each: no job held, no job lost, the journal has no open plan.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.cluster.model import JobState
from slurm_elastic.control.journal import Journal
from slurm_elastic.devcluster import node_state_serving
from slurm_elastic.spec import ElasticSpec

pytestmark = pytest.mark.slurm

DAEMON = ("-v", "admin", "daemon", "--interval", "1", "--hysteresis", "0", "--ack-timeout", "15")


def _journal_path(cluster: Any) -> Path:
    return Path(cluster.env["SLURM_ELASTIC_DAEMON_DIR"]) / "journal.sqlite"


def _open_plans(cluster: Any) -> list[tuple[int, int, str]]:
    """(plan, job, step) of open plans, read without taking a write lock (the daemon owns the journal)."""
    path = _journal_path(cluster)
    if not path.exists():
        return []
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            return [(int(p), int(j), str(s)) for p, j, s in
                    db.execute("SELECT plan_id, job_id, step FROM plans WHERE status='open'").fetchall()]
        finally:
            db.close()
    except sqlite3.Error:
        return []


def _plans_total(cluster: Any, job_ids: list[int]) -> dict[str, int]:
    journal = Journal(_journal_path(cluster))
    try:
        recs = [r for r in journal.plans(limit=100000) if r.job_id in job_ids]
        return {"plans": len(recs), "running_restarts": sum(r.plan.entry.value == "running" and r.status == "done"
                                                            for r in recs),
                "open": len(journal.open_plans())}
    finally:
        journal.close()


def _submit_small(cluster: Any, spec: ElasticSpec, gpus: int, *, step_s: str = "0.2") -> int:
    """An elastic job started below its allocation (raw sbatch, `gpus` GPUs), so the daemon has a plan to make."""
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--comment={spec.to_comment()}", "-N1", f"--gres=gpu:{gpus}", "--cpus-per-gpu=1",
         "--mem-per-gpu=1024M", "--requeue", f"--output={cluster.root / 'out'}/%j.out",
         str(cluster.root / "fake_trainer.sbatch")],
        env={**cluster.env, "SLURM_ELASTIC_CKPT_DIR": spec.ckpt_dir or "", "FAKE_STEP_S": step_s},
        capture_output=True, text=True, check=True, timeout=30)
    return int(proc.stdout.strip().split(";")[0])


def _after_each(cluster: Any, ids: list[int]) -> None:
    """No job held, no job lost, the journal closed."""
    state = cluster.snapshot()
    present = {j.job_id: j for j in state.jobs if j.job_id in ids}
    assert sorted(present) == sorted(ids), f"jobs lost: {sorted(set(ids) - set(present))}"
    assert all(j.state in (JobState.RUNNING, JobState.PENDING) for j in present.values()), \
        {j.job_id: j.state.value for j in present.values()}
    held = [j.job_id for j in state.jobs if j.held]
    assert held == [], f"jobs left held: {held}"
    journal = Journal(_journal_path(cluster))
    try:
        assert journal.open_plans() == [], journal.open_plans()
    finally:
        journal.close()


def _settled(cluster: Any, ids: list[int], total: int | None = None) -> dict[int, int] | None:
    from control.test_live import _allocator_agrees

    got = _allocator_agrees(cluster, ids)
    if got and (total is None or sum(got.values()) == total):
        return got
    return None


def _restore_nodes(cluster: Any) -> None:
    """Start every node whose slurmd a test killed, and wait until all serve again."""
    status = cluster.local.status()
    for node in status.nodes:
        if not node.spare and not node.started:
            cluster.local.node_up(node.name, wait=False)
    cluster.local.wait_for_nodes([n.name for n in status.nodes if not n.spare], node_state_serving, timeout=90,
                                 what="back in service")


def _stop_daemon(cluster: Any, proc: subprocess.Popen[str], log: Path) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    print(log.read_text()[-3000:])
    return proc.returncode


@pytest.mark.parametrize("step", ["signal", "hold", "resize", "release"])
def test_external_sigkill_when_the_journal_shows_each_step(elastic_cluster: Any, step: str, tmp_path: Path,
                                                          figures: Any) -> None:
    cluster = elastic_cluster
    cluster.cancel_all()
    order = ["open", "signal", "ack", "hold", "resize", "release"]
    # A slow trainer (5 s steps) keeps the plan at 'signal' long enough to aim at it.
    job = _submit_small(cluster, ElasticSpec(4, 8, gpu_step=4, ckpt_dir=str(cluster.root / "ckpt")), 4,
                        step_s="5")
    cluster.wait_for(lambda: cluster.snapshot().job(job).state is JobState.RUNNING, 60, what="job running")
    log = tmp_path / "daemon.log"
    daemon = cluster.spawn(*DAEMON, log=log)
    landed = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and daemon.poll() is None:
        plans = [p for p in _open_plans(cluster) if p[1] == job]
        if plans and order.index(plans[0][2]) >= order.index(step):
            daemon.kill()   # SIGKILL, from outside, as soon as the step is journaled
            daemon.wait(10)
            landed = plans[0][2]
            break
        time.sleep(0.02)
    if landed is None:
        # The plan went through faster than we could look: nothing to recover, which is fine but not the test.
        _stop_daemon(cluster, daemon, log)
        pytest.skip(f"the plan finished before the journal showed {step!r} to the poller")
    t0 = time.monotonic()
    rc = cluster.cli("admin", "daemon", "--interval", "1", "--hysteresis", "0", "--ack-timeout", "15",
                     "--max-cycles", "1", check=False, timeout=180)
    assert rc.returncode == 0, rc.stderr[-2000:]
    recovery_s = time.monotonic() - t0
    try:
        got = cluster.wait_for(lambda: _settled(cluster, [job]), 90, 0.5, "job at its allocation")
    except AssertionError as exc:
        seen = cluster.snapshot().job(job)
        raise AssertionError(f"{exc}; job {job} is {seen.state.value} reason={seen.reason!r} held={seen.held} "
                             f"gpus={seen.gpus}; recovery cycle said: {rc.stderr[-1500:]}") from None
    _after_each(cluster, [job])
    figures.put(aimed_at=step, killed_at=landed, recovery_cycle_s=round(recovery_s, 2), job_gpus_after=got[job],
                jobs_held=0, jobs_lost=0, open_plans=0)
    assert got == {job: 8}
    cluster.cancel_all()


def test_slurmctld_stopped_and_restarted_under_the_daemon(elastic_cluster: Any, tmp_path: Path, long_run: bool,
                                                         figures: Any) -> None:
    cluster = elastic_cluster
    cluster.cancel_all()
    local = cluster.local
    log = tmp_path / "daemon.log"
    daemon = cluster.spawn(*DAEMON, log=log)
    try:
        ids = [cluster.submit("--gpus=4-8", "--gpu-step=4", name=f"ctld-{i}") for i in range(2)]
        cluster.wait_for(lambda: _settled(cluster, ids, 16), 180, 0.5, "two jobs settled on 16 GPUs")
        outage_s = 40.0 if long_run else 15.0
        ctld = local.status().controller_pid
        os.kill(ctld, signal.SIGTERM)
        down_at = time.monotonic()
        cluster.wait_for(lambda: not Path(f"/proc/{ctld}").exists(), 60, what="slurmctld gone")
        time.sleep(outage_s)
        assert daemon.poll() is None, "the daemon died while slurmctld was away"
        failed_cycles = log.read_text().count("cycle failed")  # counted again below, after the restart
        subprocess.run(["slurmctld", "-f", str(local.slurm_conf)], env=cluster.env, check=True, timeout=60,
                       capture_output=True)
        up_at = time.monotonic()
        cluster.wait_for(lambda: cluster.run_ok(), 90, 0.5, "slurmctld answers") if hasattr(cluster, "run_ok") else \
            cluster.wait_for(lambda: subprocess.run(["squeue", "-h"], env=cluster.env, capture_output=True).returncode
                             == 0, 90, 0.5, "slurmctld answers")
        # Prove the daemon acts again: lose a node and watch it resize the jobs.
        local.node_down("n2", mark_down=True)
        lost_at = time.monotonic()
        shrunk = cluster.wait_for(lambda: _settled(cluster, ids, 12) or _settled(cluster, ids, 8), 180, 0.5,
                                  "jobs resized after the node loss")
        recovered_s = time.monotonic() - lost_at
        _after_each(cluster, ids)
        assert daemon.poll() is None
        failed_cycles = log.read_text().count("cycle failed")
        figures.put(outage_s=round(up_at - down_at, 1), cycles_failed_during_outage=failed_cycles,
                    daemon_survived=True, resized_after_restart_s=round(recovered_s, 1),
                    gpus_after_node_loss=sum(shrunk.values()), jobs_held=0, jobs_lost=0, open_plans=0)
        text = log.read_text()
        retries = text.count("retrying in")
        figures.put(backend_retries=retries)
        # Slurm's own clients wait a while for a missing controller, so the outage shows as retried
        # calls (bounded backoff) and, when it lasts longer than the retries, as failed cycles.
        assert retries + failed_cycles >= 1, "the daemon never noticed slurmctld was away"
    finally:
        _stop_daemon(cluster, daemon, log)
        _restore_nodes(cluster)
        cluster.cancel_all()


def test_node_lost_while_a_plan_is_open(elastic_cluster: Any, tmp_path: Path, figures: Any) -> None:
    cluster = elastic_cluster
    cluster.cancel_all()
    log = tmp_path / "daemon.log"
    # Slow trainers: a plan sits at 'signal' waiting for the ACK for a few seconds.
    a = _submit_small(cluster, ElasticSpec(4, 8, gpu_step=4, ckpt_dir=str(cluster.root / "ckpt")), 4, step_s="4")
    cluster.wait_for(lambda: cluster.snapshot().job(a).state is JobState.RUNNING, 60, what="job running")
    daemon = cluster.spawn(*DAEMON, log=log)
    try:
        plan = cluster.wait_for(lambda: [p for p in _open_plans(cluster) if p[1] == a and p[2] in ("signal", "ack")],
                                120, 0.02, "a plan waiting for its ACK")
        node = cluster.snapshot().job(a).nodes[0]
        cluster.local.node_down(node, mark_down=True)
        lost_at = time.monotonic()
        b = cluster.submit("--gpus=2-4", "--gpu-step=2", name="mid-b")
        ids = [a, b]
        got = cluster.wait_for(lambda: _settled(cluster, ids), 180, 0.5,
                               lambda: f"jobs re-planned after the loss; Slurm says:\n{cluster.slurm_view()}")
        assert daemon.poll() is None, "the daemon crashed on a node lost mid-plan"
        _after_each(cluster, ids)
        state = cluster.snapshot()
        assert not any(node in j.nodes for j in state.jobs if j.job_id in ids)
        figures.put(plan_step_when_lost=plan[0][2], node=node, replanned_s=round(time.monotonic() - lost_at, 1),
                    gpus_after=sum(got.values()), jobs_held=0, jobs_lost=0, open_plans=0)
    finally:
        _stop_daemon(cluster, daemon, log)
        _restore_nodes(cluster)     # first: a job finishes only on nodes that answer
        cluster.cancel_all()


def test_node_flapping_restarts_are_bounded(elastic_cluster: Any, tmp_path: Path, long_run: bool,
                                            figures: Any) -> None:
    cluster = elastic_cluster
    cluster.cancel_all()
    duration = 120.0 if long_run else 30.0
    period = 4.0
    budget = 3
    hysteresis = 20
    log = tmp_path / "daemon.log"
    daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "1", "--hysteresis", str(hysteresis),
                           "--restart-budget", str(budget), "--ack-timeout", "10", log=log)
    try:
        ids = [cluster.submit("--gpus=4-8", "--gpu-step=4", name=f"flap-{i}") for i in range(2)]
        ids.append(cluster.submit("--gpus=2-4", "--gpu-step=2", name="flap-c"))
        cluster.wait_for(lambda: _settled(cluster, ids), 180, 0.5, "jobs settled")
        restarts_before = {j: cluster.snapshot().job(j).restarts for j in ids}
        flaps = 0
        end = time.monotonic() + duration
        while time.monotonic() < end:
            cluster.local.node_down("n4", mark_down=True)
            time.sleep(period / 2)
            cluster.local.node_up("n4", wait=False)
            time.sleep(period / 2)
            flaps += 1
            assert daemon.poll() is None, "the daemon died while a node flapped"
        _restore_nodes(cluster)
        # Settled means quiet, not "what a fresh solve wants": a job whose restart budget is spent is
        # kept at its size on purpose. Quiet = no open plan and the same sizes over 10 s.
        seen: list[tuple[tuple[int, str, int], ...]] = []

        def quiet() -> bool:
            st = cluster.snapshot()
            seen.append(tuple((j, st.job(j).state.value, st.job(j).gpus) for j in ids))
            return len(seen) >= 6 and len(set(seen[-6:])) == 1 and not _open_plans(cluster)

        cluster.wait_for(quiet, 240, 2.0, "jobs quiet after the flapping")
        _after_each(cluster, ids)
        state = cluster.snapshot()
        restarts = {j: state.job(j).restarts - restarts_before[j] for j in ids}
        plans = _plans_total(cluster, ids)
        journal = Journal(_journal_path(cluster))
        try:
            per_job = {j: sum(1 for r in journal.plans(job_id=j, limit=1000)
                              if r.plan.entry.value == "running" and r.status == "done"
                              and r.created_at >= time.time() - duration - 600 and not r.plan.forced)
                       for j in ids}
        finally:
            journal.close()
        figures.put(flapping_s=duration, flaps=flaps, period_s=period, hysteresis_s=hysteresis,
                    restart_budget_per_hour=budget, slurm_restarts_per_job=restarts,
                    controller_restarts_per_job=per_job, controller_plans=plans["plans"],
                    jobs_held=0, jobs_lost=0, open_plans=0)
        # Restarts the controller chose (not forced by a lost node) stay within the budget per job.
        assert all(n <= budget for n in per_job.values()), per_job
    finally:
        _stop_daemon(cluster, daemon, log)
        _restore_nodes(cluster)
        cluster.cancel_all()
