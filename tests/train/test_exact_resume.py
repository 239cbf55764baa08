"""Exact elastic resume: 4 ranks straight through == 4 -> signal -> 2 -> signal -> 3 (real processes, gloo)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from slurm_elastic import jobfiles as protocol

from .launch import run_ranks

MODULE = "slurm_elastic.train.examples.digits"
STEPS = 24


def _losses(path: Path) -> dict[int, float]:
    # A step may be logged twice when an interrupted run logged it before the
    # restart redid it; the last line (the surviving timeline) wins.
    out: dict[int, float] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["loss"]
    return out


def _final(job_dir: Path) -> dict[str, list]:
    return json.loads((job_dir / "final-params.json").read_text())


def _flat(params: dict) -> list[float]:
    out: list[float] = []

    def walk(x: object) -> None:
        if isinstance(x, list):
            for y in x:
                walk(y)
        else:
            out.append(float(x))
    for name in sorted(params):
        walk(params[name])
    return out


def _run(tmp: Path, world: int, log: Path, *, signal_at: int | None, restart: int, job: str = "777",
         fsdp: bool = False) -> list[int]:
    args = ["--ckpt-dir", str(tmp / "ck"), "--steps", str(STEPS), "--loss-log", str(log), "--every-steps", "5"]
    if fsdp:
        args.append("--fsdp")
    if signal_at is not None:
        args += ["--signal-self-at-step", str(signal_at)]
    results = run_ranks(MODULE, args, world_size=world, job_id=job, restart_count=restart)
    for r in results:
        assert r.returncode in (0, protocol.REQUEUE_EXIT_CODE), r.stdout[-4000:]
    return [r.returncode for r in results]


def test_resume_at_other_world_sizes_is_exact(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    assert _run(straight, 4, straight / "loss.jsonl", signal_at=None, restart=0) == [0] * 4

    elastic = tmp_path / "elastic"
    log = elastic / "loss.jsonl"
    assert _run(elastic, 4, log, signal_at=6, restart=0) == [protocol.REQUEUE_EXIT_CODE] * 4
    ack = json.loads((elastic / "ck" / "777" / protocol.ack_file_name("777", 0)).read_text())
    assert ack["committed"] and ack["step"] == 7      # signal seen at the step boundary after step 6's agreement
    assert _run(elastic, 2, log, signal_at=15, restart=1) == [protocol.REQUEUE_EXIT_CODE] * 2
    ack = json.loads((elastic / "ck" / "777" / protocol.ack_file_name("777", 1)).read_text())
    assert ack["committed"] and ack["step"] == 16
    assert _run(elastic, 3, log, signal_at=None, restart=2) == [0] * 3

    ref, got = _losses(straight / "loss.jsonl"), _losses(log)
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert math.isclose(got[step], ref[step], rel_tol=1e-9), (step, got[step], ref[step])
    a, b = _flat(_final(straight / "ck" / "777")["params"]), _flat(_final(elastic / "ck" / "777")["params"])
    assert len(a) == len(b)
    worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b) if abs(x) > 1e-8)
    assert worst <= 1e-5, worst
    # The manifest of the last signalled checkpoint records the world size that wrote it.
    manifest = json.loads((elastic / "ck" / "777" / protocol.step_dir_name(16) / protocol.MANIFEST_FILE).read_text())
    assert manifest["world_size"] == 2 and manifest["samples_consumed"] == 16 * 48
    assert len(manifest["rng"]) == 2
    # Every step logged once per timeline and world sizes as launched.
    worlds = {json.loads(line)["step"]: json.loads(line)["world_size"] for line in log.read_text().splitlines()}
    assert worlds[1] == 4 and worlds[10] == 2 and worlds[STEPS] == 3


def test_metrics_rows_have_the_contract_fields(tmp_path: Path) -> None:
    _run(tmp_path, 2, tmp_path / "loss.jsonl", signal_at=None, restart=0, job="778")
    rows = [json.loads(x) for x in (tmp_path / "ck" / "778" / protocol.METRICS_FILE).read_text().splitlines()]
    assert rows, "no metrics written"
    for row in rows:
        assert {"step", "time", "gpus", "nodes", "steps_per_s", "samples_per_s"} <= row.keys()
        assert row["gpus"] == 2 and row["nodes"] == 1 and row["steps_per_s"] > 0
        assert row["samples_per_s"] == pytest.approx(row["steps_per_s"] * 48)
    assert os.stat(tmp_path / "ck" / "778").st_mode & 0o777 == 0o700


def test_fsdp_shards_resume_exactly_and_interchange_with_ddp(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    assert _run(straight, 4, straight / "loss.jsonl", signal_at=None, restart=0) == [0] * 4
    mixed = tmp_path / "mixed"
    log = mixed / "loss.jsonl"
    assert _run(mixed, 4, log, signal_at=5, restart=0) == [protocol.REQUEUE_EXIT_CODE] * 4          # DDP
    assert _run(mixed, 3, log, signal_at=13, restart=1, fsdp=True) == [protocol.REQUEUE_EXIT_CODE] * 3
    manifest = json.loads((mixed / "ck" / "777" / protocol.step_dir_name(14) / protocol.MANIFEST_FILE).read_text())
    assert manifest["sharded"] and {f["rank"] for f in manifest["files"]} == {0, 1, 2}
    assert _run(mixed, 2, log, signal_at=None, restart=2, fsdp=True) == [0] * 2                     # FSDP 3 -> 2
    ref, got = _losses(straight / "loss.jsonl"), _losses(log)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert math.isclose(got[step], ref[step], rel_tol=1e-9), (step, got[step], ref[step])
    a, b = _flat(_final(straight / "ck" / "777")["params"]), _flat(_final(mixed / "ck" / "777")["params"])
    assert max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b) if abs(x) > 1e-8) <= 1e-5
