"""User mode and its state dir: one watch per user, deferring to a live daemon, ending with the jobs."""

from __future__ import annotations

import json
import threading
import time

import pytest

from slurm_elastic.control.protocol import ProtocolSettings
from slurm_elastic.control.reconcile import ControllerConfig
from slurm_elastic.control.state_dir import (
    HEARTBEAT_FILE,
    ControllerBusy,
    InstanceLock,
    read_heartbeat,
    write_heartbeat,
)
from slurm_elastic.control.user_mode import run_watch
from slurm_elastic.spec import ElasticSpec

from control.fake_slurm import FakeSlurm

CONFIG = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.1, settle_timeout_s=0.5),
                          min_resize_interval_s=0, node_confirm_s=0)


def test_second_lock_is_refused_with_the_holder_and_freed_on_release(tmp_path):
    first = InstanceLock(tmp_path, "watch")
    first.acquire()
    with pytest.raises(ControllerBusy, match=r"already running \(pid \d+"):
        InstanceLock(tmp_path, "watch").acquire()
    first.release()
    with InstanceLock(tmp_path, "watch"):
        pass


def test_heartbeat_fresh_then_stale(tmp_path):
    assert read_heartbeat(tmp_path) is None
    write_heartbeat(tmp_path, 10.0)
    beat = read_heartbeat(tmp_path)
    assert beat is not None and beat.fresh()
    assert not beat.fresh(now=beat.at + 31)
    (tmp_path / HEARTBEAT_FILE).write_text("{not json")
    assert read_heartbeat(tmp_path) is None


def test_watch_rebalances_only_own_jobs_and_ends_with_them(tmp_path):
    slurm = FakeSlurm()
    mine = slurm.add_job(ElasticSpec(1, 8), nodes=1, gpus_per_node=1, user="alice")
    theirs = slurm.add_job(ElasticSpec(1, 8), nodes=1, gpus_per_node=1, user="bob")
    stop = threading.Event()
    cycles = []

    def on_cycle(report) -> None:
        cycles.append(report)
        if len(cycles) == 2:
            slurm.finish(mine)

    result = run_watch(slurm, "alice", state_dir=tmp_path / "alice", daemon_dir=tmp_path / "daemon",
                       config=CONFIG, interval_s=0.01, stop=stop, on_cycle=on_cycle)
    assert result.reason == "jobs ended" and result.deferred_cycles == 0
    assert slurm.jobs[theirs].gpus == 1 and all(jid != theirs for _, jid in slurm.calls)
    assert cycles[0].plans and cycles[0].plans[0].job_id == mine


def test_watch_defers_while_the_daemon_beats(tmp_path):
    slurm = FakeSlurm()
    mine = slurm.add_job(ElasticSpec(1, 8), nodes=1, gpus_per_node=1, user="alice")
    daemon = tmp_path / "daemon"
    daemon.mkdir()
    write_heartbeat(daemon, 10.0)
    stop = threading.Event()
    threading.Timer(0.3, lambda: slurm.finish(mine)).start()
    result = run_watch(slurm, "alice", state_dir=tmp_path / "alice", daemon_dir=daemon, config=CONFIG,
                       interval_s=0.05, stop=stop)
    assert result.reason == "jobs ended" and result.deferred_cycles == result.cycles > 0
    assert slurm.calls == []      # the daemon's job, not ours
    beat = json.loads((daemon / HEARTBEAT_FILE).read_text())
    assert beat["at"] <= time.time()


# -- the lock and the heartbeat against other users (issue 14, classes 3 and 4) -------------------------------
def test_lock_is_private_names_pid_and_uid_and_refuses_unsafe_places(tmp_path):
    import os
    import stat

    from slurm_elastic.control.state_dir import LOCK_FILE, StateDirError

    with InstanceLock(tmp_path / "d", "watch", mode=0o700):
        assert stat.S_IMODE((tmp_path / "d" / LOCK_FILE).stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o700
        with pytest.raises(ControllerBusy, match=rf"pid {os.getpid()}, uid {os.geteuid()}"):
            InstanceLock(tmp_path / "d", "watch").acquire()
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    (old / LOCK_FILE).write_text("pid 1 on somewhere\n")
    os.chmod(old / LOCK_FILE, 0o644)       # as older versions left it: any user could flock it
    with InstanceLock(old, "daemon"):
        assert stat.S_IMODE((old / LOCK_FILE).stat().st_mode) == 0o600
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(StateDirError, match="writable by group or others"):
        InstanceLock(shared, "daemon").acquire()
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    (planted / LOCK_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StateDirError, match="symlink"):
        InstanceLock(planted, "daemon").acquire()
    assert not (tmp_path / "elsewhere").exists()
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    with pytest.raises(StateDirError, match="symlink"):
        InstanceLock(tmp_path / "alias", "daemon").acquire()


def test_a_heartbeat_from_the_future_or_a_dead_pid_is_not_fresh(tmp_path):
    import socket
    import subprocess

    write_heartbeat(tmp_path, 10.0)
    path = tmp_path / HEARTBEAT_FILE
    beat = json.loads(path.read_text())
    path.write_text(json.dumps({**beat, "at": time.time() + 3600}))
    future = read_heartbeat(tmp_path)
    assert future is not None and not future.fresh()
    gone = subprocess.Popen(["true"])
    gone.wait()
    path.write_text(json.dumps({**beat, "pid": gone.pid, "host": socket.gethostname(), "at": time.time()}))
    assert read_heartbeat(tmp_path) is None
    path.write_text(json.dumps({**beat, "pid": gone.pid, "host": "another-host", "at": time.time()}))
    assert read_heartbeat(tmp_path).fresh()   # another host's pid cannot be checked: its time decides


def test_watch_acts_when_the_heartbeat_is_from_the_future(tmp_path):
    slurm = FakeSlurm()
    mine = slurm.add_job(ElasticSpec(1, 8), nodes=1, gpus_per_node=1, user="alice")
    daemon = tmp_path / "daemon"
    daemon.mkdir()
    write_heartbeat(daemon, 10.0)
    beat = json.loads((daemon / HEARTBEAT_FILE).read_text())
    (daemon / HEARTBEAT_FILE).write_text(json.dumps({**beat, "at": time.time() + 10**6}))
    stop = threading.Event()
    threading.Timer(0.5, lambda: slurm.finish(mine)).start()
    guard = threading.Timer(20.0, stop.set)
    guard.start()
    try:
        result = run_watch(slurm, "alice", state_dir=tmp_path / "alice", daemon_dir=daemon, config=CONFIG,
                           interval_s=0.05, stop=stop)
    finally:
        guard.cancel()
    assert result.reason == "jobs ended" and result.deferred_cycles == 0
    assert ("signal", mine) in slurm.calls


def test_watch_stops_a_plan_when_the_daemon_starts_mid_cycle(tmp_path):
    from slurm_elastic.control.journal import ABANDONED

    slurm = FakeSlurm()
    mine = slurm.add_job(ElasticSpec(1, 8), nodes=1, gpus_per_node=1, user="alice")
    daemon = tmp_path / "daemon"
    daemon.mkdir()
    real = slurm.snapshot
    calls = {"n": 0}

    def daemon_starts_after_the_watch_looked():
        calls["n"] += 1
        if calls["n"] == 1:
            write_heartbeat(daemon, 10.0)   # after the watch read "no daemon", before it acts
        return real()
    slurm.snapshot = daemon_starts_after_the_watch_looked  # type: ignore[method-assign]
    stop = threading.Event()
    outcomes = []

    def on_cycle(report) -> None:
        outcomes.extend(report.outcomes)
        slurm.finish(mine)
    run_watch(slurm, "alice", state_dir=tmp_path / "alice", daemon_dir=daemon, config=CONFIG, interval_s=0.05,
              stop=stop, on_cycle=on_cycle)
    assert [o.status for o in outcomes] == [ABANDONED] and "admin daemon" in outcomes[0].note
    assert slurm.calls == []


def test_a_busy_lock_whose_file_names_a_dead_pid_names_the_real_holder(tmp_path):
    import socket
    import subprocess
    import sys

    from slurm_elastic.control.state_dir import LOCK_FILE

    directory = tmp_path / "d"
    with InstanceLock(directory, "daemon"):
        pass
    gone = subprocess.Popen(["true"])
    gone.wait()
    (directory / LOCK_FILE).write_text(f"pid {gone.pid} uid 0 host {socket.gethostname()}\n")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
                               str(directory / LOCK_FILE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ControllerBusy) as busy:
            InstanceLock(directory, "daemon").acquire()
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert f"held by pid {holder.pid}" in str(busy.value)
    assert f"names pid {gone.pid}, which is not running" in str(busy.value)


@pytest.mark.parametrize("body", ["[" * 2000 + "]" * 2000, '{"pid": "x"}', "[1, 2]", '{"pid": 1, "host": "h", "at": NaN, '
                                  '"interval_s": 10}', "\x00\xff" * 100])
def test_a_damaged_heartbeat_reads_as_no_heartbeat(tmp_path, body):
    (tmp_path / HEARTBEAT_FILE).write_text(body, errors="surrogateescape")
    beat = read_heartbeat(tmp_path)
    assert beat is None or not beat.fresh()
