"""A stop signal that comes again while a rank leaves after its commit (Slurm signals one node's tasks after
another's) is not a kill: every rank still exits with the requeue code."""

from __future__ import annotations

from pathlib import Path

from slurm_elastic import jobfiles as protocol

from .launch import run_ranks


def test_a_late_sigterm_while_the_ranks_leave_after_their_commit_does_not_kill_them(tmp_path: Path) -> None:
    results = run_ranks("tests.train.late_term_trainer", ["--steps", "30", "--signal-self-at-step", "3"],
                        world_size=2, job_id="31", timeout=300,
                        extra_env={"SLURM_ELASTIC_CKPT_DIR": str(tmp_path)})
    assert [r.returncode for r in results] == [protocol.REQUEUE_EXIT_CODE] * 2, results[0].stdout[-3000:]
    ack = protocol.Ack.parse(protocol.load_json((tmp_path / "31" / protocol.ack_file_name(31, 0)).read_bytes()))
    assert ack.committed and ack.step is not None
