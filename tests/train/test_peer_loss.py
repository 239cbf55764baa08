"""A vanished rank ends the others with PEER_LOST_EXIT_CODE after they committed the last step all of them completed."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from slurm_elastic import jobfiles as protocol

from .launch import start_ranks, wait_ranks

NODES = ["nodeA", "nodeA", "nodeB"]


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_rank_makes_the_others_commit_and_exit_for_requeue(tmp_path: Path, how: str) -> None:
    """kill: the connections close and a collective fails. stop: nothing closes (a frozen node);
    only the heartbeat tells, within seconds and not after the collective timeout (600 s here)."""
    log = tmp_path / "loss.jsonl"
    procs = start_ranks("slurm_elastic.train.examples.digits",
                        ["--ckpt-dir", str(tmp_path), "--steps", "100000", "--every-steps", "5", "--step-sleep", "0.02",
                         "--loss-log", str(log), "--timeout-s", "600"], world_size=3, job_id="31", nodes=NODES)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 12):
        time.sleep(0.2)
    assert log.exists(), "training never started"
    lost_at = time.time()
    os.kill(procs[2].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        results = wait_ranks(procs[:2], timeout=290)
    finally:
        procs[2].kill()
        procs[2].wait()
    elapsed = time.monotonic() - t0
    assert [r.returncode for r in results] == [protocol.PEER_LOST_EXIT_CODE] * 2, results[0].stdout[-3000:]
    assert elapsed < 300     # half the collective timeout: it was not what ended the wait
    job = tmp_path / "31"
    report = protocol.PeerLostReport.parse((job / protocol.peer_lost_file_name("31", 0, 0)).read_bytes())
    assert report.lost == (protocol.LostRank(2, "nodeB"),) and report.lost_nodes == ("nodeB",)
    assert report.surviving_nodes == ("nodeA",) and report.commit == "done"
    if how == "stop":
        assert report.detected_by == "heartbeat"
    # The just-in-time checkpoint is the resume point: the last step all survivors completed. Rank 0, which
    # logs, can be one step ahead of a survivor still inside that step's collective with the lost rank (seen
    # under load with a frozen rank): that step did not complete on every survivor and runs again.
    last_logged = max(json.loads(x)["step"] for x in log.read_text().splitlines())
    latest = protocol.parse_step_dir_name((job / protocol.LATEST_FILE).read_text().strip())
    assert latest == report.committed_step == report.agreed_step and latest >= last_logged - 1
    manifest = json.loads((job / protocol.step_dir_name(latest) / protocol.MANIFEST_FILE).read_text())
    assert manifest["world_size"] == 3 and manifest["jit"]["lost"] == [{"rank": 2, "node": "nodeB"}]
    print(f"{how}: detected {report.detected_at - lost_at:.1f} s after the loss, survivors gone after "
          f"{elapsed:.1f} s, committed step {latest} (last logged {last_logged})")


def test_plain_fsdp_has_no_replica_to_commit_and_says_so(tmp_path: Path) -> None:
    """Every FSDP rank holds a shard: with one rank gone its shard is gone, so the survivors commit
    nothing, and the report says the last committed (periodic) checkpoint is the resume point."""
    log = tmp_path / "loss.jsonl"
    procs = start_ranks("slurm_elastic.train.examples.digits",
                        ["--ckpt-dir", str(tmp_path), "--steps", "100000", "--every-steps", "5", "--step-sleep", "0.02",
                         "--loss-log", str(log), "--timeout-s", "600", "--fsdp"], world_size=3, job_id="32",
                        nodes=NODES)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 12):
        time.sleep(0.2)
    assert log.exists(), "training never started"
    os.kill(procs[2].pid, signal.SIGKILL)
    results = wait_ranks(procs[:2], timeout=290)
    procs[2].wait()
    assert [r.returncode for r in results] == [protocol.PEER_LOST_EXIT_CODE] * 2, results[0].stdout[-3000:]
    job = tmp_path / "32"
    report = protocol.PeerLostReport.parse((job / protocol.peer_lost_file_name("32", 0, 0)).read_bytes())
    assert report.commit == "none" and report.agreed_step is None
    assert "no survivor holds a full replica" in report.reason
    latest = protocol.parse_step_dir_name((job / protocol.LATEST_FILE).read_text().strip())
    assert latest is not None and latest % 5 == 0 and report.committed_step == latest
    manifest = json.loads((job / protocol.step_dir_name(latest) / protocol.MANIFEST_FILE).read_text())
    assert manifest["sharded"] and "jit" not in manifest
