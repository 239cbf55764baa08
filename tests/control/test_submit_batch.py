"""Submit options reaching the job: `--batch adaptive:MIN-MAX` as SLURM_ELASTIC_BATCH, the checkpoint root (required)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.control.submit import parse_command_line
from slurm_elastic.errors import SpecError
from slurm_elastic import jobfiles as protocol


SITE = {"SLURM_ELASTIC_CKPT_DIR": "/scratch/site/ckpt"}   # the site's default checkpoint root


def _script(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "job.sbatch"
    path.write_text("\n".join(["#!/bin/bash", *lines, "srun true", ""]))
    return str(path)


def test_the_command_line_range_reaches_the_job(tmp_path: Path) -> None:
    request = parse_command_line(["--gpus=2-8", "--batch", "adaptive:64-512", _script(tmp_path)], environ=SITE)
    assert request.env[protocol.BATCH_ENV] == "adaptive:64-512"
    assert not any(arg.startswith("--batch") for arg in request.sbatch_args), request.sbatch_args


def test_an_elastic_line_gives_the_range_and_the_command_line_wins(tmp_path: Path) -> None:
    script = _script(tmp_path, "#ELASTIC --gpus 2-8", "#ELASTIC --batch adaptive:32-256")
    assert parse_command_line([script], environ=SITE).env[protocol.BATCH_ENV] == "adaptive:32-256"
    over = parse_command_line(["--batch=adaptive:16-64", script], environ=SITE)
    assert over.env[protocol.BATCH_ENV] == "adaptive:16-64"


def test_fixed_batch_jobs_get_no_range(tmp_path: Path) -> None:
    assert protocol.BATCH_ENV not in parse_command_line(["--gpus=2-8", _script(tmp_path)], environ=SITE).env


@pytest.mark.parametrize("bad", ["64-512", "adaptive:512-64", "adaptive:0-8", "adaptive:x-8", "fixed:8"])
def test_a_bad_range_is_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(SpecError, match="--batch"):
        parse_command_line(["--gpus=2-8", f"--batch={bad}", _script(tmp_path)], environ=SITE)


def test_the_site_checkpoint_root_is_the_default_and_ckpt_dir_wins(tmp_path: Path) -> None:
    script = _script(tmp_path)
    request = parse_command_line(["--gpus=2-8", script], environ=SITE)
    assert request.spec.ckpt_dir == "/scratch/site/ckpt"
    assert request.env[protocol.CKPT_DIR_ENV] == "/scratch/site/ckpt"
    mine = parse_command_line(["--gpus=2-8", "--ckpt-dir", "/scratch/me/ckpt", script], environ={})
    assert mine.spec.ckpt_dir == "/scratch/me/ckpt" and mine.env[protocol.CKPT_DIR_ENV] == "/scratch/me/ckpt"


def test_a_job_without_a_checkpoint_root_is_refused_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="needs --ckpt-dir PATH") as refused:
        parse_command_line(["--gpus=2-8", _script(tmp_path)], environ={})
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("where", ["environment", "export", "sbatch-export", "script"])
def test_a_job_key_of_the_users_choosing_is_refused_naming_what_to_do(tmp_path: Path, where: str) -> None:
    """The controller looks a job's files up by its job id: a chosen key would hide the job from it."""
    environ = {**SITE, **({"SLURM_ELASTIC_JOB_KEY": "1234"} if where == "environment" else {})}
    head = ["#SBATCH --export=ALL,SLURM_ELASTIC_JOB_KEY=1234"] if where == "sbatch-export" else []
    body = ["export SLURM_ELASTIC_JOB_KEY=1234"] if where == "script" else []
    path = tmp_path / "job.sbatch"
    path.write_text("\n".join(["#!/bin/bash", *head, "#ELASTIC --gpus 2-8", *body, "srun true", ""]))
    args = ["--export=ALL,SLURM_ELASTIC_JOB_KEY=1234"] if where == "export" else []
    with pytest.raises(SpecError, match="SLURM_ELASTIC_JOB_KEY is set") as refused:
        parse_command_line([*args, str(path)], environ=environ)
    assert "scontrol requeue OLD_JOB_ID" in str(refused.value) and "\n" not in str(refused.value)


def test_a_script_that_only_mentions_the_job_key_in_a_comment_is_submitted(tmp_path: Path) -> None:
    script = _script(tmp_path, "#ELASTIC --gpus 2-8", "# we no longer set SLURM_ELASTIC_JOB_KEY=1234 here")
    assert parse_command_line([script], environ=SITE).spec.ckpt_dir == SITE["SLURM_ELASTIC_CKPT_DIR"]


def test_a_checkpoint_root_that_is_not_a_directory_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "ckpt"
    plain.write_text("x")
    with pytest.raises(SpecError, match="not a directory"):
        parse_command_line(["--gpus=2-8", "--ckpt-dir", str(plain), _script(tmp_path)], environ={})


def test_a_checkpoint_root_the_submitting_user_cannot_write_is_refused_before_anything_is_submitted() -> None:
    """Found by an adversarial probe: `--ckpt-dir /home/bob/private` was accepted from alice (the job could
    never create its directory there). A real unprivileged user submits; the wrapper refuses in one line."""
    import os
    import subprocess
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import users as user_tools  # tests/users.py

    why = user_tools.runnable_as_user()
    if why:
        pytest.skip(why)
    base = Path(tempfile.mkdtemp(prefix="se-ckptroot-", dir="/var/tmp"))
    made = None
    try:
        os.chmod(base, 0o755)
        closed = base / "not-yours"
        closed.mkdir(mode=0o755)                       # root's, readable, not writable by others
        script = base / "job.sbatch"
        script.write_text("#!/bin/bash\nsrun true\n")
        os.chmod(script, 0o644)
        made = user_tools.user_python("se-ckptroot-user")
        shared = base / "shared"
        shared.mkdir()
        os.chmod(shared, 0o1777)                       # a shared scratch: anyone may create entries
        code = ("import sys; from slurm_elastic.control.submit import parse_command_line; "
                "from slurm_elastic.errors import SpecError\n"
                "for root in sys.argv[2:]:\n"
                "    try:\n        parse_command_line(['--gpus=2-8', '--ckpt-dir', root, sys.argv[1]], environ={})\n"
                "        print('accepted')\n"
                "    except SpecError as exc:\n        print('refused:', exc)")
        # not yet there, under a directory the user cannot write (a docs probe: `/root/ckpt` was accepted and
        # every rank failed with a traceback); and not yet there in a shared scratch: the job creates it
        out = subprocess.run(made.argv(code, str(script), str(closed), str(closed / "a" / "ckpt"),
                                       str(shared / "new" / "ckpt")), capture_output=True, text=True, timeout=120)
        assert out.stdout.splitlines() == [
            f"refused: --ckpt-dir {closed}: you cannot create your job's directory there (not writable by you)",
            f"refused: --ckpt-dir {closed / 'a' / 'ckpt'}: it does not exist and you cannot create it ({closed} "
            f"is not a directory writable by you)",
            "accepted"], (out.stdout, out.stderr)
    finally:
        if made is not None:
            made.close()
        for path in sorted(base.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        base.rmdir()
