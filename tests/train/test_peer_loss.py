"""A vanished rank ends the others with PEER_LOST_EXIT_CODE instead of a hang."""

from __future__ import annotations

import json
import time
from pathlib import Path

from slurm_elastic.train import protocol

from .launch import start_ranks, wait_ranks


def test_killing_one_rank_makes_the_others_exit_for_requeue(tmp_path: Path) -> None:
    log = tmp_path / "loss.jsonl"
    procs = start_ranks("slurm_elastic.train.examples.digits",
                        ["--ckpt-dir", str(tmp_path), "--steps", "100000", "--every-steps", "5", "--step-sleep", "0.02",
                         "--loss-log", str(log), "--timeout-s", "30"], world_size=3, job_id="31")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 12):
        time.sleep(0.2)
    assert log.exists(), "training never started"
    procs[2].kill()
    t0 = time.monotonic()
    results = wait_ranks(procs, timeout=90)
    elapsed = time.monotonic() - t0
    assert [r.returncode for r in results[:2]] == [protocol.PEER_LOST_EXIT_CODE] * 2, results[0].stdout[-3000:]
    assert elapsed < 60     # well inside the collective timeout plus start-up slack: no hang
    # the last periodic checkpoint survives for the requeue
    latest = (tmp_path / "31" / protocol.LATEST_FILE).read_text().strip()
    step = protocol.parse_step_dir_name(latest)
    assert step is not None and step >= 10 and step % 5 == 0
    assert json.loads((tmp_path / "31" / latest / protocol.MANIFEST_FILE).read_text())["world_size"] == 3
