"""PyTorch's own multigpu_torchrun.py, upstream's bytes plus the edits docs/researcher.md documents, resumes
across world sizes with no step lost, and the docs show exactly the edits the test applies.

Upstream's loss (cross-entropy over a single output) has a zero gradient, so its weights cannot show a
resume's exactness; tests/train/test_prepare.py's digits tutorial compares final weights to the last bit.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from slurm_elastic import jobfiles as protocol

from .upstream_edits import DDP_TUTORIAL
from .launch import rank_envs, wait_ranks

DOCS = Path(__file__).resolve().parents[2] / "docs" / "researcher.md"
JOB = "515"


def _start(run: Path, world: int, restart: int) -> list[subprocess.Popen]:
    path = os.pathsep.join(p for p in (str(run), os.environ.get("PYTHONPATH", "")) if p)
    procs = []
    for env in rank_envs(world_size=world, job_id=JOB, restart_count=restart,
                         extra_env={"SLURM_ELASTIC_CKPT_DIR": str(run / "ck"), "PYTHONPATH": path}):
        procs.append(subprocess.Popen([sys.executable, "multigpu_torchrun.py", "1000", "1", "--batch_size", "4"],
                                      cwd=run, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _stop_at(procs: list[subprocess.Popen], line: str) -> tuple[list[int], list[str]]:
    """Send the checkpoint signal once rank 0 prints `line` (or ends); every rank's exit code and output."""
    head = []
    assert procs[0].stdout is not None
    for text in procs[0].stdout:
        head.append(text)
        if line in text:
            for p in procs:
                p.send_signal(signal.SIGUSR2)
            break
    results = wait_ranks(procs, timeout=600)
    return [r.returncode for r in results], ["".join(head) + r.stdout if i == 0 else r.stdout
                                             for i, r in enumerate(results)]


def _ack(run: Path, restart: int) -> dict:
    import json
    with open(protocol.ack_path(str(run / "ck"), JOB, JOB, restart)) as f:
        return json.load(f)


def test_the_upstream_files_are_upstreams_bytes() -> None:
    for name, digest in DDP_TUTORIAL.sha256.items():
        assert hashlib.sha256((DDP_TUTORIAL.folder / name).read_bytes()).hexdigest() == digest, name


def test_the_docs_show_exactly_the_edits_applied_and_they_touch_at_most_ten_lines() -> None:
    assert DDP_TUTORIAL.lines_touched() <= 10
    diff = DDP_TUTORIAL.diff()
    assert f"```diff\n{diff}\n```" in DOCS.read_text(), diff


def test_upstreams_tutorial_resumes_at_the_acknowledged_step_at_4_2_and_1_ranks(tmp_path: Path) -> None:
    run = DDP_TUTORIAL.write_converted(tmp_path)
    codes, outs = _stop_at(_start(run, 4, 0), "Epoch 1 |")
    assert codes == [protocol.REQUEUE_EXIT_CODE] * 4, outs[0][-3000:]
    first = _ack(run, 0)
    assert first["committed"] and first["world_size"] == 4

    # Epoch 0 is done: the loop starts at epoch 1 (loop.epochs_done), upstream's peek before set_epoch()
    # finds epoch 1's next batch, and epoch 0's line and snapshot are not repeated.
    codes, outs = _stop_at(_start(run, 2, 1), "Epoch 2 |")
    assert codes == [protocol.REQUEUE_EXIT_CODE] * 2, outs[0][-3000:]
    assert f"slurm-elastic: resumed at step {first['step']} " in outs[0], outs[0][-3000:]
    epochs = re.findall(r"\[GPU0\] Epoch (\d+) \| Batchsize: \d+ \| Steps: (\d+)", outs[0])
    assert epochs and epochs[0][0] == "1" and all(int(steps) > 0 for _, steps in epochs), outs[0][-3000:]
    assert "Epoch 0" not in outs[0], outs[0][-3000:]
    second = _ack(run, 1)
    assert second["committed"] and second["step"] > first["step"] and second["world_size"] == 2

    codes, outs = _stop_at(_start(run, 1, 2), "Epoch 3 |")
    assert codes == [protocol.REQUEUE_EXIT_CODE], outs[0][-3000:]
    assert f"slurm-elastic: resumed at step {second['step']} " in outs[0], outs[0][-3000:]


def test_without_the_epochs_done_line_a_peek_after_a_finished_epoch_stops_as_the_docs_say(tmp_path: Path) -> None:
    run = DDP_TUTORIAL.write_converted(tmp_path, skip="trainer = Trainer(")
    codes, outs = _stop_at(_start(run, 2, 0), "Epoch 1 |")
    assert codes == [protocol.REQUEUE_EXIT_CODE] * 2, outs[0][-3000:]
    codes, outs = _stop_at(_start(run, 2, 1), "never printed")
    assert all(c not in (0, protocol.REQUEUE_EXIT_CODE) for c in codes), outs[0][-3000:]
    assert "StopIteration" in outs[0], outs[0][-3000:]
