"""`--batch adaptive:MIN-MAX` (command line or #ELASTIC line) reaches the job as SLURM_ELASTIC_BATCH; bad ranges refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.control.submit import parse_command_line
from slurm_elastic.errors import SpecError
from slurm_elastic import jobfiles as protocol


def _script(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "job.sbatch"
    path.write_text("\n".join(["#!/bin/bash", *lines, "srun true", ""]))
    return str(path)


def test_the_command_line_range_reaches_the_job(tmp_path: Path) -> None:
    request = parse_command_line(["--gpus=2-8", "--batch", "adaptive:64-512", _script(tmp_path)], environ={})
    assert request.env[protocol.BATCH_ENV] == "adaptive:64-512"
    assert not any(arg.startswith("--batch") for arg in request.sbatch_args), request.sbatch_args


def test_an_elastic_line_gives_the_range_and_the_command_line_wins(tmp_path: Path) -> None:
    script = _script(tmp_path, "#ELASTIC --gpus 2-8", "#ELASTIC --batch adaptive:32-256")
    assert parse_command_line([script], environ={}).env[protocol.BATCH_ENV] == "adaptive:32-256"
    over = parse_command_line(["--batch=adaptive:16-64", script], environ={})
    assert over.env[protocol.BATCH_ENV] == "adaptive:16-64"


def test_fixed_batch_jobs_get_no_range(tmp_path: Path) -> None:
    assert protocol.BATCH_ENV not in parse_command_line(["--gpus=2-8", _script(tmp_path)], environ={}).env


@pytest.mark.parametrize("bad", ["64-512", "adaptive:512-64", "adaptive:0-8", "adaptive:x-8", "fixed:8"])
def test_a_bad_range_is_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(SpecError, match="--batch"):
        parse_command_line(["--gpus=2-8", f"--batch={bad}", _script(tmp_path)], environ={})
