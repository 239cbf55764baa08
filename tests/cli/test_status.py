"""`status`: ended jobs stay listed with their state; each job's LATEST is read from a directory its user controls
(never a link, a FIFO or a long read)."""

from __future__ import annotations

import getpass
import json
import os
from pathlib import Path

import pytest

from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.cli.status import newest_checkpoint_step
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.model import Job, JobState
from slurm_elastic.spec import ElasticSpec


def _job(root: Path) -> Job:
    return Job(job_id=77, user="alice", name="train", state=JobState.RUNNING,
               spec=ElasticSpec(1, 4, ckpt_dir=str(root)))


def _latest(root: Path) -> Path:
    (root / "77").mkdir(parents=True)
    return root / "77" / "LATEST"


def test_a_plain_latest_gives_its_step(tmp_path: Path) -> None:
    _latest(tmp_path).write_text("step-0000001200\n")
    assert newest_checkpoint_step(_job(tmp_path)) == 1200


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero", "link-to-a-good-file", "binary", "huge"])
def test_a_hostile_latest_is_unknown_and_never_hangs(tmp_path: Path, kind: str) -> None:
    latest = _latest(tmp_path)
    if kind == "fifo":
        os.mkfifo(latest)                       # an open() without O_NONBLOCK would wait for a writer
    elif kind == "link-to-dev-zero":
        latest.symlink_to("/dev/zero")          # an unbounded read would never end
    elif kind == "link-to-a-good-file":
        (tmp_path / "elsewhere").write_text("step-0000000005\n")
        latest.symlink_to(tmp_path / "elsewhere")
    elif kind == "binary":
        latest.write_bytes(b"\xff\xfe\x00step")
    else:
        latest.write_text("step-" + "9" * 10_000_000)
    assert newest_checkpoint_step(_job(tmp_path)) is None


def test_ended_jobs_are_listed_with_their_state_and_how_they_ended(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = InMemorySlurm(nodes=2, gpus_per_node=2)
    monkeypatch.setattr("slurm_elastic.cluster.select.select_backend", lambda *a, **k: slurm)
    monkeypatch.setenv("SLURM_ELASTIC_DAEMON_DIR", str(tmp_path / "daemon"))
    monkeypatch.setenv("SLURM_ELASTIC_STATE_DIR", str(tmp_path / "user"))
    me = getpass.getuser()
    failed = slurm.add_job(ElasticSpec(1, 2, ckpt_dir=str(tmp_path / "ck")), nodes=1, gpus_per_node=2, user=me)
    running = slurm.add_job(ElasticSpec(1, 2, ckpt_dir=str(tmp_path / "ck")), nodes=1, gpus_per_node=2, user=me)
    killed = slurm.add_job(ElasticSpec(1, 2, ckpt_dir=str(tmp_path / "ck")), nodes=1, gpus_per_node=2, user=me)
    slurm.finish(failed, JobState.FAILED)
    slurm.finish(killed, JobState.CANCELLED, signal=9)

    result = CliRunner().invoke(main, ["status", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = {r["job_id"]: r for r in json.loads(result.output)}
    assert {j: (rows[j]["state"], rows[j]["ended"]) for j in rows} == {
        failed: ("FAILED", True), running: (slurm.jobs[running].state.value, False), killed: ("CANCELLED", True)}
    assert rows[killed]["exit_signal"] == 9 and rows[failed]["end_time"] is not None

    text = CliRunner().invoke(main, ["status"], catch_exceptions=False).output
    lines = {int(line.split()[0]): line for line in text.splitlines()[1:]}
    assert "FAILED" in lines[failed] and "ended FAILED at " in lines[failed]
    assert "ended CANCELLED by signal 9 at " in lines[killed]
    assert "ended" not in lines[running]


def test_a_pending_rigid_job_is_listed_with_why_elastic_jobs_do_not_yield_to_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = InMemorySlurm(nodes=2, gpus_per_node=4)
    monkeypatch.setattr("slurm_elastic.cluster.select.select_backend", lambda *a, **k: slurm)
    monkeypatch.setenv("SLURM_ELASTIC_DAEMON_DIR", str(tmp_path / "daemon"))
    monkeypatch.setenv("SLURM_ELASTIC_STATE_DIR", str(tmp_path / "user"))
    me = getpass.getuser()
    # The elastic job's minimum (6) is protected: a rigid job needing a whole node (4 of 8) must wait.
    slurm.add_job(ElasticSpec(6, 8, gpu_step=2), nodes=2, gpus_per_node=4, user=me, priority=100)
    rigid = slurm.add_job(None, nodes=1, gpus_per_node=4, user=me, priority=1)
    other = slurm.add_job(None, nodes=1, gpus_per_node=4, user="someone-else", priority=1)
    assert slurm.jobs[rigid].state is JobState.PENDING

    rows = {r["job_id"]: r for r in json.loads(
        CliRunner().invoke(main, ["status", "--json"], catch_exceptions=False).output)}
    assert other not in rows
    assert rows[rigid]["min_gpus"] is None and rows[rigid]["state"] == "PENDING"
    assert "elastic jobs' minimums (6 GPUs) are protected from it" in rows[rigid]["why"]
    # No daemon wrote notes: the word is this user's own view, and says so (a probe read "does not fit even
    # without elastic jobs" of a job that fitted once another user's elastic jobs shrank)
    assert rows[rigid]["why"].endswith("other users' elastic jobs counted as fixed)")
    text = CliRunner().invoke(main, ["status"], catch_exceptions=False).output
    assert any(line.split()[0] == str(rigid) and "protected" in line for line in text.splitlines()[1:])


def test_a_jobs_why_uses_the_watchs_settings_from_its_variables(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """No daemon runs: the dry run decides as a watch started in the same environment would (seen: a watch
    at SLURM_ELASTIC_HYSTERESIS=30 while status said "hysteresis 300s")."""
    from slurm_elastic.cli import admin

    slurm = InMemorySlurm(nodes=2, gpus_per_node=2)
    monkeypatch.setattr("slurm_elastic.cluster.select.select_backend", lambda *a, **k: slurm)
    monkeypatch.setenv("SLURM_ELASTIC_DAEMON_DIR", str(tmp_path / "daemon"))
    monkeypatch.setenv("SLURM_ELASTIC_STATE_DIR", str(tmp_path / "user"))
    monkeypatch.setenv("SLURM_ELASTIC_HYSTERESIS", "30")
    monkeypatch.setenv("SLURM_ELASTIC_RESTART_BUDGET", "7")
    seen = []
    real = admin.observer
    monkeypatch.setattr(admin, "observer", lambda backend, config, **kw: seen.append(config) or real(backend, config, **kw))
    slurm.add_job(ElasticSpec(1, 4, ckpt_dir=str(tmp_path / "ck")), nodes=1, gpus_per_node=2, user=getpass.getuser())
    assert CliRunner().invoke(main, ["status"], catch_exceptions=False).exit_code == 0
    assert [(c.min_resize_interval_s, c.restart_budget_per_hour) for c in seen] == [(30.0, 7)]


def test_escape_sequences_in_a_job_name_never_reach_the_terminal(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's name is its user's: `\\e[2J\\e[3J\\e[H` (16 characters) cleared the screen and scrollback of
    whoever ran `status` on that user's jobs (found by a probe)."""
    slurm = InMemorySlurm(nodes=1, gpus_per_node=2)
    monkeypatch.setattr("slurm_elastic.cluster.select.select_backend", lambda *a, **k: slurm)
    monkeypatch.setenv("SLURM_ELASTIC_DAEMON_DIR", str(tmp_path / "daemon"))
    monkeypatch.setenv("SLURM_ELASTIC_STATE_DIR", str(tmp_path / "user"))
    me = getpass.getuser()
    slurm.add_job(ElasticSpec(1, 2, ckpt_dir=str(tmp_path / "ck")), nodes=1, gpus_per_node=2, user=me,
                  name="\x1b[2J\x1b[3J\x1b[H\x9b8m\x07")
    text = CliRunner().invoke(main, ["status"], catch_exceptions=False).output
    assert not any(ord(c) < 0x20 and c != "\n" or 0x7f <= ord(c) < 0xa0 for c in text), repr(text)
    assert "?[2J?[3J?[H" in text
