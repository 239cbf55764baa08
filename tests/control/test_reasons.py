"""Every wait says why: `status --json` and `admin status --json` name, per elastic job, why it is not being
resized now, deciding with the running daemon's settings (its heartbeat); a job stuck on a bad batch geometry
(it wrote geometry.json and exited 87) is re-planned at once at a valid size.

Slurm is the in-memory backend (slurm_elastic/cluster/memory.py) on a clock that is wall time plus what the
test skipped (the CLI and the journal read wall time).
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import signal
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.model import JobState
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.plan import Plan, PlanEntry
from slurm_elastic.control.protocol import ProtocolSettings
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler
from slurm_elastic.control.state_dir import JOURNAL_FILE, open_state_dir, read_heartbeat, write_heartbeat
from slurm_elastic.spec import ElasticSpec
from slurm_elastic import jobfiles as shim

ME = getpass.getuser()


class Clock:
    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.time() + self.skipped

    def sleep(self, s: float) -> None:
        self.skipped += s


@pytest.fixture
def cluster(monkeypatch, tmp_path):
    clock = Clock()
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4, clock=clock)
    monkeypatch.setattr("slurm_elastic.cluster.select.select_backend", lambda *a, **k: slurm)
    monkeypatch.setenv("SLURM_ELASTIC_DAEMON_DIR", str(tmp_path / "daemon"))
    monkeypatch.setenv("SLURM_ELASTIC_STATE_DIR", str(tmp_path / "user"))
    return slurm, clock, tmp_path


def _daemon_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "daemon"
    os.close(open_state_dir(directory))
    return directory


def _announce(tmp_path: Path, **settings: object) -> None:
    """A heartbeat as the running daemon writes it (this process stands in for the daemon: its pid is alive)."""
    directory = _daemon_dir(tmp_path)
    write_heartbeat(directory, 10.0, every_s=5.0, settings=settings)  # type: ignore[arg-type]
    beat = read_heartbeat(directory)
    assert beat is not None and beat.fresh() and beat.settings == settings


def _json(*args: str) -> object:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _status_why(job_id: int) -> str | None:
    rows = _json("status", "--json", "--user", ME)
    return {r["job_id"]: r["why"] for r in rows}[job_id]  # type: ignore[index, union-attr]


def _admin_why(job_id: int) -> str | None:
    payload = _json("admin", "status", "--json")
    return {r["job_id"]: r["why"] for r in payload["jobs"]}[job_id]  # type: ignore[index]


def _geometry(ckpt: str, job_id: int, world: int, valid: list[int]) -> str:
    path = shim.geometry_path(ckpt, shim.job_key(job_id))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"global_batch": 64, "micro_batch": 8, "world_size": world, "valid_world_sizes": valid,
                   "nearest_valid_world_size": min(valid, key=lambda w: abs(w - world))}, f)
    return path


def test_a_job_just_started_is_held_by_hysteresis_with_the_time_left(cluster):
    slurm, _, tmp = cluster
    job = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp / "ckpt")), nodes=1, gpus_per_node=2, user=ME)
    assert slurm.jobs[job].state is JobState.RUNNING
    why = _status_why(job)        # 6 GPUs are free, yet a job that started seconds ago is not grown
    assert why is not None and why.startswith("hysteresis: started") and "s left (hysteresis 300s)" in why
    assert _admin_why(job) == why
    payload = _json("admin", "status", "--json")
    assert payload["plans"] == [] and "no daemon running" in payload["deciding"]  # type: ignore[index]


def test_status_and_dry_run_decide_with_the_running_daemons_settings(cluster):
    slurm, _, tmp = cluster
    job = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp / "ckpt")), nodes=1, gpus_per_node=2, user=ME)
    _announce(tmp, hysteresis_s=1000.0, restart_budget_per_hour=6, ack_timeout_s=60.0, signal="USR2")
    assert "(hysteresis 1000s)" in (_status_why(job) or "")
    payload = _json("admin", "status", "--json")
    assert payload["settings"]["hysteresis_s"] == 1000.0  # type: ignore[index]
    assert "running daemon's settings" in payload["deciding"]  # type: ignore[index]

    _announce(tmp, hysteresis_s=0.0, restart_budget_per_hour=6, ack_timeout_s=60.0, signal="USR2")
    # Not held any more: the job is not measured yet, so the request source keeps it at its size, and says so.
    assert (_status_why(job) or "").startswith("kept at 2 GPUs until measured")
    # The dry run, given a longer hysteresis on its command line, still decides as the daemon would.
    out = CliRunner().invoke(main, ["admin", "rebalance", "--dry-run", "--hysteresis", "5000"],
                             catch_exceptions=False).output
    assert "running daemon's settings" in out and "hysteresis_s 0.0" in out
    assert f"job {job}: not resized now: kept at 2 GPUs until measured" in out


def test_a_spent_restart_budget_says_when_the_next_restart_is_allowed(cluster):
    slurm, clock, tmp = cluster
    clock.skipped = -600.0        # it started ten minutes ago: past any hysteresis
    job = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp / "ckpt")), nodes=1, gpus_per_node=2, user=ME)
    clock.skipped = 0.0
    journal = Journal(_daemon_dir(tmp) / JOURNAL_FILE)
    now = clock()
    for k in range(2):    # two controller restarts, 30 and 20 minutes ago
        plan = Plan(job_id=job, from_gpus=2, to_gpus=2, shape=RequestShape(1, 2, 1, 1024), entry=PlanEntry.RUNNING,
                    reason="grow", user=ME)
        plan_id = journal.open_plan(plan, restarts=k, now=now - 1800 + 600 * k)
        journal.finish(plan_id, "done", now=now - 1800 + 600 * k)
    journal.close()
    _announce(tmp, hysteresis_s=0.0, restart_budget_per_hour=2, ack_timeout_s=60.0, signal="USR2")
    why = _admin_why(job) or ""
    assert why.startswith("restart budget of 2/hour spent (next restart allowed in")
    left = float(why.split("allowed in ")[1].split("s)")[0])
    assert 1700 <= left <= 1810   # the older restart (30 min ago) leaves the hour in 30 min
    assert _status_why(job) == why


def test_an_open_plan_means_waiting_for_the_ack(cluster):
    slurm, _, tmp = cluster
    job = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp / "ckpt")), nodes=1, gpus_per_node=2, user=ME)
    journal = Journal(_daemon_dir(tmp) / JOURNAL_FILE)
    journal.open_plan(Plan(job_id=job, from_gpus=2, to_gpus=8, shape=RequestShape(2, 4, 1, 1024),
                           entry=PlanEntry.RUNNING, reason="grow", user=ME), restarts=0)
    journal.close()
    _announce(tmp, hysteresis_s=0.0, restart_budget_per_hour=6, ack_timeout_s=90.0, signal="USR2")
    why = _admin_why(job) or ""
    assert why.startswith("waiting for its checkpoint ACK (plan 1, 2->8 GPUs") and "requeued anyway in" in why


def test_a_job_that_cannot_fit_beside_the_others_is_not_placeable_now(cluster):
    slurm, _, tmp = cluster
    slurm.add_job(None, nodes=2, gpus_per_node=4, user="bob")          # a rigid job holds both nodes
    job = slurm.add_job(ElasticSpec(4, 8, ckpt_dir=str(tmp / "ckpt")), nodes=1, gpus_per_node=4, user=ME)
    assert slurm.jobs[job].state is JobState.PENDING
    why = _status_why(job) or ""
    assert why.startswith("not placeable: its minimum of 4 GPUs does not fit beside the others now"), why


@pytest.mark.parametrize("low, high", [(3, 3), (6, 6), (16, 32)])
def test_a_job_no_shape_of_which_fits_the_nodes_is_told_it_can_never_start(cluster, low, high):
    """2 nodes x 4 GPUs: 3 GPUs fit one node; 6 is neither one node nor whole nodes; 16 needs 4 whole nodes."""
    slurm, _, tmp = cluster
    job = slurm.add_job(ElasticSpec(low, high, ckpt_dir=str(tmp / "ckpt")), nodes=1, gpus_per_node=low, user=ME)
    why = _status_why(job) or ""
    if low == 3:
        assert "never" not in why, why
        return
    assert slurm.jobs[job].state is JobState.PENDING
    assert why == (f"not placeable: no size it allows ({low}..{high} GPUs) fits one node (at most 4 GPUs) or spans "
                   f"whole nodes (4 GPUs each; Slurm's --gres is per node): it can never start on the nodes up "
                   f"now"), why


def _reconciler(slurm: InMemorySlurm, clock: Clock, tmp: Path, **config: object) -> Reconciler:
    cfg = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=5.0, settle_timeout_s=5.0), node_confirm_s=0,
                           **config)  # type: ignore[arg-type]
    return Reconciler(slurm, Journal(tmp / "j.sqlite"), cfg, clock=clock, sleep=clock.sleep)


def test_a_bad_geometry_is_replanned_at_once_at_a_valid_size(cluster):
    slurm, clock, tmp = cluster
    ckpt = str(tmp / "ckpt")
    job = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=ckpt), nodes=1, gpus_per_node=3, user=ME)
    assert slurm.jobs[job].gpus == 3
    rec = _reconciler(slurm, clock, tmp)           # hysteresis 300 s, the job started just now
    assert rec.cycle(dry_run=True).plans == ()     # no geometry file: held (hysteresis)

    _geometry(ckpt, job, 3, [1, 2, 4, 8])          # its ranks found 64 samples cannot be split over 3: exit 87
    dry = rec.cycle(dry_run=True)
    assert [p.job_id for p in dry.plans] == [job] and dry.plans[0].to_gpus in (1, 2, 4, 8)
    report = rec.cycle()
    assert [o.status for o in report.outcomes] == ["done"]
    assert slurm.jobs[job].gpus in (1, 2, 4, 8)


def test_a_bad_geometry_shrink_is_a_requeue_never_in_place(cluster):
    """Its ranks exited 87: none are left to go on in their processes. Found by an adversarial probe: a job
    at 8 GPUs on two nodes, whose batch splits over 2, 4 or 6 ranks only, was shrunk in place to its first
    node, nothing ran on, and Slurm ended it FAILED."""
    slurm, clock, tmp = cluster
    ckpt = str(tmp / "ckpt")
    job = slurm.add_job(ElasticSpec(2, 8, gpu_step=2, ckpt_dir=ckpt), nodes=2, gpus_per_node=4, user=ME)
    _geometry(ckpt, job, 8, [2, 4, 6])
    dry = _reconciler(slurm, clock, tmp).cycle(dry_run=True)
    [plan] = dry.plans
    assert plan.job_id == job and plan.to_gpus in (2, 4, 6) and plan.keep == (), plan


def test_a_bad_geometry_says_why_while_no_valid_size_fits(cluster):
    slurm, _, tmp = cluster
    ckpt = str(tmp / "ckpt")
    job = slurm.add_job(ElasticSpec(3, 3, ckpt_dir=ckpt), nodes=1, gpus_per_node=3, user=ME)
    _geometry(ckpt, job, 3, [1, 2, 4, 8])
    why = _status_why(job) or ""
    assert why.startswith("bad geometry: its batch cannot be split over 3 GPUs (exit 87; valid 1, 2, 4, 8)")


@pytest.mark.parametrize("hostile", ["symlink", "huge", "garbage", "wrong-types"])
def test_a_hostile_geometry_file_is_ignored(cluster, hostile):
    slurm, clock, tmp = cluster
    ckpt = str(tmp / "ckpt")
    job = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=ckpt), nodes=1, gpus_per_node=3, user=ME)
    path = _geometry(ckpt, job, 3, [1, 2, 4, 8])
    if hostile == "symlink":
        real = tmp / "elsewhere.json"
        os.replace(path, real)
        os.symlink(real, path)
    elif hostile == "huge":
        with open(path, "a") as f:
            f.write(" " * (1 << 15))
    elif hostile == "garbage":
        Path(path).write_bytes(b"\xff\x00{")
    else:
        Path(path).write_text(json.dumps({"world_size": True, "valid_world_sizes": [2, "4", -1]}))
    rec = _reconciler(slurm, clock, tmp)
    assert rec.cycle(dry_run=True).plans == ()     # not believed: the job stays held by hysteresis
    assert job not in rec.decide(rec.backend.snapshot(), clock()).bad_geometry


# -- live: the local cluster (tests/control/conftest.py) -------------------------------------------------
GEOMETRY_JOB = r"""#!/bin/bash
#SBATCH --time=30
# Stands in for a job whose global batch (6, micro-batch 3) splits over 1 or 2 ranks only: like the shim it writes
# geometry.json at every start and, at any other size, "exits 87", after which the batch shell waits to be
# requeued, as the job templates do (the GPUs stay held until the controller acts).
trap '' USR2
G=$((SLURM_GPUS_ON_NODE * SLURM_JOB_NUM_NODES))
D="$SLURM_ELASTIC_CKPT_DIR/$SLURM_JOB_ID"
mkdir -p "$D"
echo "{\"restart\": ${SLURM_RESTART_COUNT:-0}, \"gpus\": $G}" >> "$D/sizes.log"
VALID='"valid_world_sizes": [1, 2], "nearest_valid_world_size": 2'
printf '{"global_batch": 6, "micro_batch": 3, "world_size": %d, %s}' "$G" "$VALID" > "$D/geometry.json.tmp"
mv "$D/geometry.json.tmp" "$D/geometry.json"
if [ "$G" -gt 2 ]; then
    echo "batch geometry: 6 samples cannot be split over $G ranks (valid: 1, 2); exiting with 87" >&2
    while true; do sleep 5; done
fi
exec "$FAKE_PYTHON" "$FAKE_TRAINER"
"""


@pytest.mark.slurm
def test_live_a_job_exiting_87_is_replanned_at_once_to_a_valid_size(elastic_cluster, tmp_path):
    cluster = elastic_cluster
    cluster.cancel_all()
    script = cluster.root / "geometry_job.sbatch"
    script.write_text(GEOMETRY_JOB)
    script.chmod(0o755)
    # The default hysteresis (300 s) would hold a job that just started: the bad geometry must not wait for it.
    daemon = cluster.spawn("-v", "admin", "daemon", "--interval", "2", "--ack-timeout", "5",
                           log=tmp_path / "daemon.log")
    try:
        out = cluster.cli("sbatch", "--parsable", "--gpus=2-4", f"--ckpt-dir={cluster.root / 'ckpt'}",
                          "--job-name=geometry", f"--output={cluster.root / 'out'}/%j.out", "--open-mode=append",
                          str(script))
        job = int(out.stdout.strip())
        sizes = cluster.root / "ckpt" / str(job) / "sizes.log"

        def runs() -> list[dict[str, int]]:
            return [json.loads(line) for line in sizes.read_text().splitlines()] if sizes.exists() else []

        first = cluster.wait_for(runs, 120, what="the job's first start")[0]
        assert first["gpus"] > 2, "the job must start at a size its batch cannot use for this test to mean anything"
        # Well inside the 300 s hysteresis (the ACK timeout is 5 s: the stuck ranks never acknowledge).
        cluster.wait_for(lambda: any(r["restart"] >= 1 and r["gpus"] == 2 for r in runs()), 180,
                         what=lambda: f"a restart at 2 GPUs (runs {runs()}; {cluster.job_outputs()})")
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(60)
        print((tmp_path / "daemon.log").read_text()[-3000:])
    assert rc == 0
    log = (tmp_path / "daemon.log").read_text()
    assert f"job {job}: {first['gpus']}->2 GPUs" in log     # one plan, straight to the one valid size
    cluster.cancel_all()


def test_the_daemon_announces_its_settings_and_a_forged_setting_is_dropped(cluster):
    from slurm_elastic.control.daemon import Loop

    slurm, clock, tmp = cluster
    directory = _daemon_dir(tmp)
    config = ControllerConfig(min_resize_interval_s=42.0, restart_budget_per_hour=3,
                              protocol=ProtocolSettings(ack_timeout_s=17.0), node_confirm_s=0, measured_speed=False)
    seen = []
    loop = Loop(Reconciler(slurm, Journal(tmp / "j.sqlite"), config, clock=clock, sleep=clock.sleep),
                interval_s=1.0, heartbeat_dir=directory, on_cycle=lambda report: seen.append(read_heartbeat(directory)))
    loop.run(max_cycles=1)
    beat = seen[0]
    assert beat is not None and beat.settings == {"hysteresis_s": 42.0, "restart_budget_per_hour": 3,
                                                  "ack_timeout_s": 17.0, "signal": "USR2", "speed": "linear"}
    assert ControllerConfig().with_settings(beat.settings) == dataclasses.replace(config, node_confirm_s=1.0)

    write_heartbeat(directory, 10.0, settings={"hysteresis_s": "0", "restart_budget_per_hour": True,  # type: ignore
                                               "ack_timeout_s": 1e300, "signal": "x" * 100, "other": 1,
                                               "speed": "optimistic"})
    beat = read_heartbeat(directory)
    assert beat is not None and beat.settings == {}
    assert ControllerConfig().with_settings({"hysteresis_s": -5, "restart_budget_per_hour": 2.5e9}) == ControllerConfig()
