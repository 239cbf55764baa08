"""The daemon loop on FakeSlurm (a stand-in for Slurm): cycles, heartbeat, metrics, surviving Slurm errors."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from slurm_elastic.control.daemon import Loop
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.metrics import ControllerMetrics
from slurm_elastic.control.protocol import ProtocolSettings
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler
from slurm_elastic.control.state_dir import HEARTBEAT_FILE, read_heartbeat
from slurm_elastic.errors import SlurmUnavailable
from slurm_elastic.spec import ElasticSpec

from control.fake_slurm import FakeSlurm


def _loop(slurm, tmp_path, metrics=None, on_cycle=None) -> Loop:
    config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.1, settle_timeout_s=0.5),
                              min_resize_interval_s=0, node_confirm_s=0)
    return Loop(Reconciler(slurm, Journal(tmp_path / "j.sqlite"), config), interval_s=0.01,
                heartbeat_dir=tmp_path, metrics=metrics, on_cycle=on_cycle)


def test_loop_runs_cycles_beats_and_exports_metrics(tmp_path):
    slurm = FakeSlurm()
    job = slurm.add_job(ElasticSpec(1, 8), nodes=1, gpus_per_node=1)
    metrics = ControllerMetrics()
    beats = []
    loop = _loop(slurm, tmp_path, metrics, on_cycle=lambda r: beats.append(read_heartbeat(tmp_path)))
    loop.run(max_cycles=3)
    assert loop.cycles == 3 and slurm.jobs[job].gpus > 1
    assert beats[1] is not None and beats[1].fresh()
    assert not (tmp_path / HEARTBEAT_FILE).exists()      # removed on a clean stop
    text = generate_latest(metrics.registry).decode()
    assert 'slurm_elastic_plans_total{outcome="done"} 1.0' in text
    assert f'slurm_elastic_job_restarts_total{{job_id="{job}"}} 1.0' in text
    assert "slurm_elastic_cycle_seconds_count 3.0" in text
    assert 'slurm_elastic_gpus{kind="total"} 16.0' in text


def test_a_cycle_that_cannot_reach_slurm_is_counted_and_the_loop_goes_on(tmp_path):
    slurm = FakeSlurm()
    calls = {"n": 0}
    real = slurm.snapshot

    def flaky():
        calls["n"] += 1
        if calls["n"] == 1:
            raise SlurmUnavailable("slurmctld restarting")
        return real()

    slurm.snapshot = flaky  # type: ignore[method-assign]
    metrics = ControllerMetrics()
    loop = _loop(slurm, tmp_path, metrics)
    loop.run(max_cycles=2)
    assert loop.cycles == 2
    assert "slurm_elastic_cycle_errors_total 1.0" in generate_latest(metrics.registry).decode()


def test_the_heartbeat_is_written_before_the_first_cycle_and_during_a_long_one(tmp_path):
    """A cycle can wait minutes for ACKs: the beat must not wait for the cycle to end (issue 14, class 4)."""
    import time

    slurm = FakeSlurm()
    seen = []
    loop = _loop(slurm, tmp_path)
    loop.beat_every_s = 0.05
    real_cycle = loop.reconciler.cycle

    def long_cycle(**kw):
        first = read_heartbeat(tmp_path)
        time.sleep(1.0)                    # stands in for a long ACK wait
        seen.append((first, read_heartbeat(tmp_path)))
        return real_cycle(**kw)
    loop.reconciler.cycle = long_cycle  # type: ignore[method-assign]
    loop.run(max_cycles=1)
    [(first, later)] = seen
    assert first is not None and later is not None
    assert later.at - first.at >= 0.5 and later.every_s == 0.05


def test_a_state_dir_that_cannot_be_written_stops_the_start_with_one_error(tmp_path):
    import os

    import pytest

    from slurm_elastic.control.state_dir import StateDirError

    readonly = tmp_path / "ro"
    readonly.mkdir()
    loop = _loop(FakeSlurm(), tmp_path)
    loop.heartbeat_dir = readonly
    os.chmod(readonly, 0o500)
    try:
        if os.access(readonly, os.W_OK):   # root ignores modes: a missing dir stands in
            loop.heartbeat_dir = tmp_path / "missing"
        with pytest.raises(StateDirError, match="cannot write the daemon heartbeat"):
            loop.run(max_cycles=1)
    finally:
        os.chmod(readonly, 0o700)
    assert loop.cycles == 0


_STALLED_DAEMON = """
import sys, threading, time
from slurm_elastic.control.daemon import Loop

class Stalled:
    config = None
    def cycle(self):
        print("cycle started", flush=True)
        threading.Event().wait()      # a cycle that never ends (a stall)

loop = Loop(Stalled(), interval_s=1.0)
loop.install_signal_handlers()
loop.run()
"""


def test_a_second_stop_signal_ends_a_stalled_daemon_at_once(tmp_path):
    """The first SIGTERM lets the cycle finish (its plans are under way); a cycle stalled on something
    else ended only with it (a probe's daemon did not stop within 10 s), so a second one exits now."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _STALLED_DAEMON], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "cycle started"
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)            # the first one waits for the cycle
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
