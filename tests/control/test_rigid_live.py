"""Live: elastic jobs that filled the cluster give borrowed GPUs back to a rigid job, and keep their minimums.

Two elastic jobs (4-8 GPUs, step 4) fill the private 4-node x 4-GPU cluster
under the daemon. A rigid job (plain sbatch, two whole nodes) arrives: the
daemon shrinks both elastic jobs to their minimum in place (each gives up the
node it does not run its batch script on; its ranks there commit and go on in
their processes) and Slurm starts the rigid job on the two nodes they left.
The seconds from submission to RUNNING are printed (the 30 s goal of issue 26
is a figure, docs/admin.md; not asserted here, as the machine may be loaded).
The digits jobs log every completed step: the steps they ran are consecutive
across the shrink, so none was lost (one some survivors had applied may run
once more, docs/training.md).

A rigid job that needs more than the elastic jobs borrowed (three whole
nodes: only their minimums could make room), with a lower Slurm priority than
theirs, waits under the default `--elastic-minimum protected`, and
`admin rebalance --dry-run` says why, naming it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_elastic.cluster.model import JobState

pytestmark = pytest.mark.slurm

TEMPLATE = Path(__file__).resolve().parents[2] / "job_templates" / "ddp.sbatch"
ELASTIC = ("--gpus=4-8", "--gpu-step=4")
DAEMON = ("-v", "admin", "daemon", "--interval", "2", "--ack-timeout", "60")   # hysteresis as shipped


def _rigid(cluster, nodes: int, name: str) -> int:
    """A plain Slurm job (no elastic comment) asking for `nodes` whole nodes."""
    proc = subprocess.run(["sbatch", "--parsable", f"-N{nodes}", "--gres=gpu:4", "--exclusive", "--no-requeue",
                           f"--job-name={name}", "--output=/dev/null", "--wrap", "sleep 3000"],
                          env=cluster.env, capture_output=True, text=True, check=True, timeout=30)
    return int(proc.stdout.strip().split(";")[0])


def _digits(cluster, name: str, loss_log: Path) -> int:
    out = cluster.cli("sbatch", "--parsable", *ELASTIC, f"--ckpt-dir={cluster.root / 'ckpt'}", f"--job-name={name}",
                      f"--output={cluster.root / 'out'}/%j.out", "--open-mode=append", str(TEMPLATE),
                      sys.executable, "-m", "slurm_elastic.train.examples.digits", "--steps", "100000",
                      "--global-batch", "64", "--micro-batch", "4", "--step-sleep", "0.05",
                      "--loss-log", str(loss_log), "--timeout-s", "600")
    return int(out.stdout.strip())


def _steps(loss_log: Path) -> list[int]:
    if not loss_log.exists():
        return []
    steps = []
    for line in loss_log.read_text().splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            pass    # a line being written
    return steps


def _running(cluster, ids: list[int]) -> dict[int, tuple[int, int, tuple[str, ...]]]:
    """{job: (GPUs, restarts, nodes)} of the jobs running now (not held)."""
    return {j.job_id: (j.gpus, j.restarts, j.nodes) for j in cluster.snapshot().jobs
            if j.job_id in ids and j.state is JobState.RUNNING and not j.held}


def _stop(daemon, log: Path) -> int:
    daemon.send_signal(signal.SIGTERM)
    rc = daemon.wait(60)
    print(log.read_text()[-4000:])
    return rc


def test_a_rigid_job_gets_two_whole_nodes_from_elastic_jobs_with_no_step_lost(elastic_cluster, tmp_path):
    cluster = elastic_cluster
    cluster.cancel_all()
    log = tmp_path / "daemon.log"
    daemon = cluster.spawn(*DAEMON, log=log)
    try:
        logs = {name: cluster.root / "out" / f"rigid-{name}-{time.time_ns()}.jsonl" for name in ("a", "b")}
        ids = [_digits(cluster, f"elastic-{name}", path) for name, path in logs.items()]
        by_id = dict(zip(ids, logs.values()))

        def full() -> bool:
            now = _running(cluster, ids)
            return len(now) == 2 and all(g == 8 for g, _, _ in now.values())
        cluster.wait_for(full, 300, 1, lambda: f"both elastic jobs at 8 GPUs; {cluster.slurm_view()}")
        before = _running(cluster, ids)
        seen = {j: len(_steps(p)) for j, p in by_id.items()}
        cluster.wait_for(lambda: all(len(_steps(p)) >= seen[j] + 3 for j, p in by_id.items()), 300, 1,
                         lambda: f"both jobs training at 8 GPUs; {cluster.job_outputs()}")
        assert _running(cluster, ids) == before, "the elastic jobs moved before the rigid job came"

        submitted = time.time()
        rigid = _rigid(cluster, 2, "rigid-two-nodes")
        cluster.wait_for(lambda: cluster.snapshot().job(rigid).state is JobState.RUNNING, 300, 0.25,
                         lambda: f"the rigid job running; {cluster.slurm_view()}")
        started = time.time() - submitted
        print(f"rigid job {rigid} (2 whole nodes) RUNNING {started:.1f} s after submission")

        after = cluster.wait_for(lambda: (r := _running(cluster, ids)) and len(r) == 2 and r, 300, 1,
                                 lambda: f"both elastic jobs running again; {cluster.slurm_view()}")
        resumed_from = {j: len(_steps(p)) for j, p in by_id.items()}
        cluster.wait_for(lambda: all(len(_steps(p)) >= resumed_from[j] + 3 for j, p in by_id.items()), 300, 1,
                         lambda: f"both jobs training again; {cluster.job_outputs()}")
        state = cluster.snapshot()
        rigid_nodes = set(state.job(rigid).nodes)
        assert len(rigid_nodes) == 2
        for job_id in ids:
            gpus, restarts, nodes = after[job_id]
            # Shrunk in place to one of its own nodes, its ranks kept (the DDP template's default:
            # docs/controller.md, "Shrinking on healthy nodes in place"): the rigid job was given the node
            # each job does not run its batch script on (allocate/from_state.reserve_for_rigid).
            in_place = restarts == before[job_id][1] and set(nodes) < set(before[job_id][2])
            print(f"job {job_id}: {'shrunk in place' if in_place else 'requeued'} {before[job_id]} -> {after[job_id]}")
            assert gpus == 4 and in_place, (job_id, before[job_id], after[job_id])
            assert not rigid_nodes & set(nodes), (rigid_nodes, nodes)
            # rank 0 logs each completed step; the commit at the shrink is the last of them, and the
            # job resumed at the next: the steps run are consecutive (none lost, none run twice). Shrunk in
            # place, the survivors commit the last step all of them completed (docs/training.md, "Agreement
            # without the process group"): one step rank 0 had already applied may run again, never more.
            steps = _steps(by_id[job_id])
            gaps = [b - a for a, b in zip(steps, steps[1:])]
            assert set(gaps) <= {0, 1} and gaps.count(0) <= 1, (job_id, steps)
        assert f"gave 8 GPUs back to job {rigid} (rigid, priority " in log.read_text()
    finally:
        rc = _stop(daemon, log)
        cluster.cancel_all()
    assert rc == 0


def test_a_lower_priority_rigid_job_that_needs_elastic_minimums_waits_and_status_says_why(elastic_cluster,
                                                                                             tmp_path):
    cluster = elastic_cluster
    cluster.cancel_all()
    log = tmp_path / "daemon.log"
    daemon = cluster.spawn(*DAEMON, log=log)   # --elastic-minimum protected: the default
    try:
        ids = [cluster.submit(*ELASTIC, name=f"elastic-{n}") for n in ("a", "b")]

        def full() -> bool:
            now = _running(cluster, ids)
            return len(now) == 2 and all(g == 8 for g, _, _ in now.values())
        cluster.wait_for(full, 180, 1, lambda: f"both elastic jobs at 8 GPUs; {cluster.slurm_view()}")
        before = _running(cluster, ids)

        rigid = _rigid(cluster, 3, "rigid-three-nodes")
        # The local cluster schedules with priority/basic: a later job has a lower priority on 22.05, and
        # every job has priority 1 from 24.11 on. An admin's explicit priorities make "lower than the
        # elastic jobs'" hold on any version and PriorityType.
        for job_id, priority in ((rigid, 1), *((j, 100) for j in ids)):
            subprocess.run(["scontrol", "update", f"JobId={job_id}", f"Priority={priority}"], env=cluster.env,
                           check=True, capture_output=True, text=True, timeout=30)
        state = cluster.snapshot()
        assert state.job(rigid).priority == 1
        assert all((state.job(j).priority or 0) > 1 for j in ids), [state.job(j).priority for j in ids]

        time.sleep(10)   # five daemon cycles
        state = cluster.snapshot()
        assert state.job(rigid).state is JobState.PENDING
        assert _running(cluster, ids) == before, "an elastic job gave up GPUs it could not spare"
        out = cluster.cli("admin", "rebalance", "--dry-run").stdout
        assert (f"job {rigid}: not resized now: rigid job {rigid} waits: elastic jobs' minimums (8 GPUs) "
                f"are protected from it") in out, out
        print(out)
        # The rigid job's owner sees the same word in `status`, beside their elastic jobs.
        mine = cluster.cli("status").stdout
        assert any(line.split()[:1] == [str(rigid)] and "are protected from it" in line
                   for line in mine.splitlines()), mine
    finally:
        rc = _stop(daemon, log)
        cluster.cancel_all()
    assert rc == 0
