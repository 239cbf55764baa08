"""The SQLite journal: plans and steps survive a reopen; hysteresis and budget queries."""

from __future__ import annotations

import dataclasses
import os
import sqlite3

import pytest

from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.control.journal import DONE, ROLLED_BACK, Journal, JournalError
from slurm_elastic.control.plan import Plan, PlanEntry


def _plan(job_id: int = 7, entry: PlanEntry = PlanEntry.RUNNING) -> Plan:
    return Plan(job_id=job_id, from_gpus=8, to_gpus=4, shape=RequestShape(1, 4, 2, 2048), entry=entry, reason="shrink")


def test_open_plan_survives_reopen_with_its_last_step(tmp_path):
    j = Journal(tmp_path / "j.sqlite")
    pid = j.open_plan(_plan(), restarts=3, now=100.0)
    j.record(pid, "signal", now=101.0)
    j.record(pid, "hold", now=102.0)
    j.close()
    j2 = Journal(tmp_path / "j.sqlite")
    [rec] = j2.open_plans()
    assert rec.plan == _plan() and rec.step == "hold" and rec.restarts == 3
    assert [s for s, _, _ in j2.steps(pid)] == ["open", "signal", "hold"]
    mode = sqlite3.connect(tmp_path / "j.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_finished_plans_are_not_open_and_feed_hysteresis(tmp_path):
    j = Journal(tmp_path / "j.sqlite")
    a = j.open_plan(_plan(7), restarts=0, now=10.0)
    j.finish(a, DONE, now=20.0)
    b = j.open_plan(_plan(7), restarts=1, now=30.0)
    j.finish(b, ROLLED_BACK, "x", now=31.0)
    assert j.open_plans() == []
    assert j.last_change_at(7) == 20.0          # a rolled-back plan changed nothing
    assert j.last_change_at(8) is None
    assert j.restarts_since(7, 0.0) == 1
    assert j.restarts_since(7, 15.0) == 0


def test_a_jobs_first_size_is_the_one_before_its_first_plan_since_its_submission(tmp_path):
    j = Journal(tmp_path / "j.sqlite")
    j.open_plan(dataclasses.replace(_plan(7), from_gpus=2), restarts=0, now=10.0)    # an earlier job 7
    j.open_plan(_plan(7), restarts=0, now=50.0)
    j.open_plan(dataclasses.replace(_plan(7), from_gpus=4, to_gpus=12), restarts=1, now=60.0)
    assert j.first_size(7) == 2
    assert j.first_size(7, since=40.0) == 8        # the id's reuse after 40 s: the later job's own
    assert j.first_size(7, since=70.0) is None and j.first_size(8) is None


def test_pending_plans_do_not_count_as_restarts(tmp_path):
    j = Journal(tmp_path / "j.sqlite")
    j.finish(j.open_plan(_plan(9, PlanEntry.PENDING), restarts=1, now=5.0), DONE, now=6.0)
    assert j.restarts_since(9, 0.0) == 0


def test_unknown_step_is_refused(tmp_path):
    j = Journal(tmp_path / "j.sqlite")
    pid = j.open_plan(_plan(), restarts=0)
    with pytest.raises(ValueError):
        j.record(pid, "teleport")


# -- the journal holds every user's plans (issue 14, class 3) ----------------------------------------------
def test_journal_is_private_and_narrowed_from_older_modes(tmp_path):
    import os
    import stat

    from slurm_elastic.control.state_dir import StateDirError

    fresh = tmp_path / "fresh" / "j.sqlite"
    Journal(fresh).open_plan(_plan(), restarts=0)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
    assert stat.S_IMODE(fresh.parent.stat().st_mode) == 0o700
    for side in ("j.sqlite-wal", "j.sqlite-shm"):
        if (fresh.parent / side).exists():
            assert stat.S_IMODE((fresh.parent / side).stat().st_mode) & 0o077 == 0

    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    (old / "j.sqlite").touch(mode=0o644)
    os.chmod(old / "j.sqlite", 0o644)
    Journal(old / "j.sqlite")
    assert stat.S_IMODE((old / "j.sqlite").stat().st_mode) == 0o600

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(StateDirError, match="writable by group or others"):
        Journal(shared / "j.sqlite")
    link = tmp_path / "link"
    link.mkdir(mode=0o700)
    (link / "j.sqlite").symlink_to(fresh)
    with pytest.raises(StateDirError, match="symlink"):
        Journal(link / "j.sqlite")


def test_a_journal_from_before_plans_named_their_owner_is_migrated(tmp_path):
    path = tmp_path / "j.sqlite"
    j = Journal(path)
    pid = j.open_plan(_plan(), restarts=0)
    j.close()
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE plans DROP COLUMN user")
    db.close()
    j2 = Journal(path)
    [rec] = j2.open_plans()
    assert rec.plan_id == pid and rec.plan.user == ""
    j2.open_plan(dataclasses.replace(_plan(), user="alice"), restarts=0)
    assert {r.plan.user for r in j2.open_plans()} == {"", "alice"}


def test_a_journal_write_on_a_full_disk_is_one_elastic_error(tmp_path):
    from slurm_elastic.control.journal import JournalError

    j = Journal(tmp_path / "j.sqlite")
    j._db.execute("PRAGMA max_page_count=1")   # stands in for a full disk: no page can be added
    with pytest.raises(JournalError, match="cannot write the controller journal"):
        for _ in range(200):
            j.open_plan(_plan(), restarts=0)


# -- the request shape: one type, stored once (issue 24, item 5) ----------------------------------------------
def test_every_field_of_a_plan_and_its_shape_round_trips(tmp_path):
    plan = Plan(job_id=11, from_gpus=2, to_gpus=12, shape=RequestShape(3, 4, 6, 5000), entry=PlanEntry.PENDING,
                reason="requeued by Slurm after a node failure", forced=True, user="alice", exclude=("n2", "n5"))
    j = Journal(tmp_path / "j.sqlite")
    pid = j.open_plan(plan, restarts=2, now=50.0)
    j.close()
    [rec] = Journal(tmp_path / "j.sqlite").open_plans()
    assert rec.plan == plan and rec.plan_id == pid
    stored = sqlite3.connect(tmp_path / "j.sqlite").execute("SELECT shape FROM plans").fetchone()[0]
    assert RequestShape.loads(stored) == plan.shape


# The plans table as the journal wrote it before the request shape had one type: a column per field.
_COLUMN_LAYOUT = """
CREATE TABLE plans (
    plan_id        INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id         INTEGER NOT NULL,
    from_gpus      INTEGER NOT NULL,
    to_gpus        INTEGER NOT NULL,
    nodes          INTEGER NOT NULL,
    gpus_per_node  INTEGER NOT NULL,
    cpus_per_gpu   INTEGER NOT NULL,
    mem_per_gpu_mb INTEGER NOT NULL,
    entry          TEXT    NOT NULL,
    reason         TEXT    NOT NULL,
    user           TEXT    NOT NULL DEFAULT '',
    exclude        TEXT    NOT NULL DEFAULT '',
    forced         INTEGER NOT NULL,
    restarts       INTEGER NOT NULL,
    step           TEXT    NOT NULL,
    status         TEXT    NOT NULL,
    created_at     REAL    NOT NULL,
    updated_at     REAL    NOT NULL,
    note           TEXT    NOT NULL DEFAULT ''
);
CREATE INDEX plans_open ON plans(status);
CREATE INDEX plans_job ON plans(job_id, created_at);
CREATE TABLE steps (
    plan_id INTEGER NOT NULL REFERENCES plans(plan_id),
    step    TEXT    NOT NULL,
    at      REAL    NOT NULL,
    note    TEXT    NOT NULL DEFAULT ''
);
"""


def _column_layout_journal(path, rows):
    """A journal as the previous version left it: (job, from, to, nodes, per node, cpus, mem, entry, step, status)."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(_COLUMN_LAYOUT)
    for i, (job, g0, g1, nodes, per_node, cpus, mem, entry, step, status) in enumerate(rows):
        db.execute("INSERT INTO plans (job_id, from_gpus, to_gpus, nodes, gpus_per_node, cpus_per_gpu, mem_per_gpu_mb,"
                   " entry, reason, user, exclude, forced, restarts, step, status, created_at, updated_at)"
                   " VALUES (?,?,?,?,?,?,?,?,'shrink','alice','',0,0,?,?,?,?)",
                   (job, g0, g1, nodes, per_node, cpus, mem, entry, step, status, 10.0 + i, 11.0 + i))
        db.execute("INSERT INTO steps VALUES (?, 'open', ?, '')", (i + 1, 10.0 + i))
    db.close()
    os.chmod(path, 0o600)


def test_a_journal_of_the_column_layout_keeps_its_plans(tmp_path):
    path = tmp_path / "d" / "j.sqlite"
    _column_layout_journal(path, [(5, 8, 4, 1, 4, 2, 1536, "running", "release", DONE),
                                  (6, 2, 8, 2, 4, 3, 2048, "running", "hold", "open")])
    j = Journal(path)
    [rec] = j.open_plans()
    assert rec.plan.shape == RequestShape(2, 4, 3, 2048) and rec.step == "hold" and rec.plan.user == "alice"
    assert [r.plan.shape for r in j.plans()] == [RequestShape(2, 4, 3, 2048), RequestShape(1, 4, 2, 1536)]
    assert j.last_change_at(5) == 11.0 and [s for s, _, _ in j.steps(2)] == ["open"]
    assert j.open_plan(_plan(), restarts=0) == 3     # ids go on after the moved plans
    columns = {row[1] for row in sqlite3.connect(path).execute("PRAGMA table_info(plans)")}
    assert "shape" in columns and "nodes" not in columns
    j.close()
    assert len(Journal(path).plans()) == 3          # moved once: a second open finds the shape column


def test_a_plan_in_flight_across_the_upgrade_is_finished_with_its_shape(tmp_path):
    from slurm_elastic.cluster.memory import InMemorySlurm
    from slurm_elastic.cluster.model import JobState
    from slurm_elastic.control.protocol import ProtocolSettings, RequeueProtocol
    from slurm_elastic.spec import ElasticSpec

    slurm = InMemorySlurm()
    job_id = slurm.add_job(ElasticSpec(4, 8, gpu_step=4, ckpt_dir=str(tmp_path / "ckpt")), nodes=2, gpus_per_node=4,
                           user="alice")
    slurm.requeue_hold(job_id)   # the old daemon took the hold step, journaled it, and died
    path = tmp_path / "d" / "j.sqlite"
    _column_layout_journal(path, [(job_id, 8, 4, 1, 4, 2, 1536, "running", "hold", "open")])
    now = [0.0]     # the protocol's waits pass on this clock, not the test's
    proto = RequeueProtocol(slurm, Journal(path), ProtocolSettings(ack_timeout_s=5.0, settle_timeout_s=2.0),
                            clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    [out] = proto.recover(slurm.snapshot())
    job = slurm.snapshot().job(job_id)
    assert out.status == DONE and not job.held and job.state is JobState.RUNNING
    assert (job.num_nodes, job.gpus_per_node, job.cpus_per_gpu, job.mem_per_gpu_mb) == (1, 4, 2, 1536)


@pytest.mark.parametrize("stored", ['{"nodes": 1}', '{"nodes": 1, "gpus_per_node": 4, "cpus_per_gpu": true, '
                                    '"mem_per_gpu_mb": 1}', "not json", '[1, 4, 1, 1]'])
def test_a_damaged_shape_is_one_journal_error(tmp_path, stored):
    j = Journal(tmp_path / "j.sqlite")
    j.open_plan(_plan(), restarts=0)
    sqlite3.connect(tmp_path / "j.sqlite", isolation_level=None).execute("UPDATE plans SET shape=?", (stored,))
    with pytest.raises(JournalError, match="damaged: plan 1: "):
        j.open_plans()


def test_a_journal_from_before_drains_expired_gives_its_drains_the_default_hour(tmp_path):
    path = tmp_path / "j.sqlite"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE drains (node TEXT NOT NULL, user TEXT NOT NULL, job_id INTEGER NOT NULL,"
                " at REAL NOT NULL, reason TEXT NOT NULL)")
    old.execute("INSERT INTO drains VALUES ('n2', 'alice', 7, 1000.0, 'slurm-elastic: job 7')")
    old.commit()
    old.close()
    j = Journal(path)
    [drain] = j.drains()
    assert (drain.node, drain.until, drain.ended_at) == ("n2", 4600.0, None)
    j.record_drain("n3", user="bob", job_id=8, reason="r", until=2000.0, now=1500.0)
    j.end_drain(drain.drain_id, "expired; resumed", now=4601.0)
    assert [d.node for d in j.drains()] == ["n3"]
    assert [(d.node, d.end_note) for d in j.drains(active=False)] == [("n2", "expired; resumed"), ("n3", "")]
