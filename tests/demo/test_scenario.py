"""The demo script's pieces that need no Slurm: submission and daemon arguments, the report directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from slurm_elastic.control.submit import parse_command_line
from slurm_elastic.demo.scenario import (DEFAULT_JOBS, MARKER, DemoError, DemoOptions, daemon_args, job_template,
                                         prepare_report_dir, submit_args)


def test_default_jobs_fill_sixteen_gpus_at_their_maxima():
    assert sum(j.max_gpus for j in DEFAULT_JOBS) == 16
    assert all(j.max_gpus % j.gpu_step == 0 and j.min_gpus % j.gpu_step == 0 for j in DEFAULT_JOBS)
    # The trainer's global batch of 48 in micro-batches of 2 splits over every allowed GPU count.
    assert all(24 % g == 0 for j in DEFAULT_JOBS for g in range(j.min_gpus, j.max_gpus + 1, j.gpu_step))


def test_submit_args_parse_as_an_elastic_submission(tmp_path):
    options = DemoOptions(report_dir=tmp_path)
    args = submit_args(DEFAULT_JOBS[0], options, ckpt_root=tmp_path / "ckpt", log_dir=tmp_path / "logs")
    request = parse_command_line(["--parsable", *args])
    spec = request.spec
    assert (spec.min_gpus, spec.max_gpus, spec.gpu_step, spec.cpus_per_gpu) == (4, 8, 4, 2)
    assert spec.ckpt_dir == str(tmp_path / "ckpt")
    assert Path(request.script) == job_template("ddp.sbatch")
    assert request.script_args[:3] == (sys.executable, "-m", "slurm_elastic.train.examples.digits")


def test_daemon_args_carry_interval_and_hysteresis(tmp_path):
    from slurm_elastic.cli.admin import admin_daemon

    args = daemon_args(DemoOptions(report_dir=tmp_path, interval_s=1.5, hysteresis_s=7))
    assert args[:4] == ["--interval", "1.5", "--hysteresis", "7"]
    ctx = admin_daemon.make_context("daemon", list(args))
    assert ctx.params["interval"] == 1.5 and ctx.params["hysteresis"] == 7.0


def test_report_dir_is_created_marked_and_reused(tmp_path):
    d = tmp_path / "report"
    prepare_report_dir(d)
    assert (d / MARKER).is_file()
    (d / "index.html").write_text("old")
    prepare_report_dir(d)   # an earlier report may be replaced


def test_report_dir_with_foreign_files_or_odd_characters_is_refused(tmp_path):
    (tmp_path / "mine.txt").write_text("x")
    with pytest.raises(DemoError, match="not a demo report directory"):
        prepare_report_dir(tmp_path)
    with pytest.raises(DemoError, match="letters, digits"):
        prepare_report_dir(tmp_path / "with space")
    assert not (tmp_path / "with space").exists()


def test_missing_python_packages_are_named_with_the_pip_command(monkeypatch):
    import importlib.util

    from slurm_elastic.demo.scenario import check_prerequisites

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "sklearn" else real(name))
    with pytest.raises(DemoError, match="needs scikit-learn.*pip install scikit-learn"):
        check_prerequisites()
