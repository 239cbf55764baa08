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
