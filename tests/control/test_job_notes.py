"""The running daemon's notes on each user's jobs: one file per user, that user's alone, and what their
`status` shows (it said less than `admin rebalance --explain`: no node kept off, no hysteresis under way)."""

from __future__ import annotations

import getpass
import json
import os
import stat
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.control.daemon import Loop
from slurm_elastic.control.job_notes import NOTES_DIR, read_notes, write_notes
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler
from slurm_elastic.control.state_dir import open_state_dir, write_heartbeat
from slurm_elastic.spec import ElasticSpec

from users import ensure_user

ME = getpass.getuser()


def test_each_user_gets_a_notes_file_of_their_own_and_only_recent_notes_are_read(tmp_path: Path) -> None:
    alice, bob = ensure_user("se-notes-a"), ensure_user("se-notes-b")
    os.close(open_state_dir(tmp_path / "d"))
    directory = tmp_path / "d"
    now = time.time()
    write_notes(directory, {alice.pw_name: {11: "kept off n2 (back since 12:00:00)", 12: ""},
                            bob.pw_name: {13: "hysteresis: 120 s left"}}, now)
    for user in (alice, bob):
        st = os.stat(directory / NOTES_DIR / f"{user.pw_uid}.json")
        assert st.st_uid == user.pw_uid and stat.S_IMODE(st.st_mode) == 0o400
    assert stat.S_IMODE(os.stat(directory / NOTES_DIR).st_mode) == 0o711
    assert read_notes(directory, alice.pw_uid, max_age_s=60, now=now) == {
        11: "kept off n2 (back since 12:00:00)", 12: ""}
    assert read_notes(directory, bob.pw_uid, max_age_s=60, now=now) == {13: "hysteresis: 120 s left"}
    assert read_notes(directory, alice.pw_uid, max_age_s=60, now=now + 120) is None       # stale
    assert read_notes(directory, alice.pw_uid, max_age_s=60, now=now - 60) is None        # from the future
    # A file of that name owned by someone else is not the daemon's word for this user.
    os.chown(directory / NOTES_DIR / f"{bob.pw_uid}.json", alice.pw_uid, alice.pw_gid)
    assert read_notes(directory, bob.pw_uid, max_age_s=60, now=now) is None
    # A user with no job now has no file.
    write_notes(directory, {alice.pw_name: {11: ""}}, now)
    assert sorted(p.name for p in (directory / NOTES_DIR).iterdir()) == [f"{alice.pw_uid}.json"]


def _status_why(job_id: int) -> str | None:
    result = CliRunner().invoke(main, ["status", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return {r["job_id"]: r["why"] for r in json.loads(result.output)}[job_id]


def test_status_shows_what_the_running_daemon_said_of_each_job(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    monkeypatch.setattr("slurm_elastic.cluster.select.select_backend", lambda *a, **k: slurm)
    directory = tmp_path / "daemon"
    monkeypatch.setenv("SLURM_ELASTIC_DAEMON_DIR", str(directory))
    monkeypatch.setenv("SLURM_ELASTIC_STATE_DIR", str(tmp_path / "user"))
    os.close(open_state_dir(directory))
    job = slurm.add_job(ElasticSpec(1, 8, ckpt_dir=str(tmp_path / "ck")), nodes=1, gpus_per_node=4, user=ME)
    reconciler = Reconciler(slurm, Journal(directory / "j.sqlite"), ControllerConfig(node_confirm_s=0))
    Loop(reconciler, interval_s=10.0, heartbeat_dir=directory).run_once()
    notes = json.loads((directory / NOTES_DIR / f"{os.geteuid()}.json").read_text())
    assert str(job) in notes["notes"]                       # the daemon wrote a note (maybe empty) for the job
    write_heartbeat(directory, 10.0, every_s=5.0)           # this process stands in for the running daemon
    said = "stays at 4 GPUs: kept off n2 (back since 12:00:00)"
    write_notes(directory, {ME: {job: said}}, time.time())
    assert _status_why(job) == said
    # Notes the daemon has not renewed are not its word now: status decides in a dry run of its own.
    write_notes(directory, {ME: {job: said}}, time.time() - 3600)
    assert _status_why(job) != said
