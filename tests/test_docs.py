"""The docs site builds strictly, and its CLI reference is generated from the click commands."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("mkdocs") is None and not (Path(sys.prefix) / "bin" / "mkdocs").exists(),
                    reason="mkdocs is not installed (pip install '.[dev]')")
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli = (tmp_path / "cli" / "index.html").read_text()
    # every top-level command appears in the generated reference
    for command in ("sbatch", "status", "admin", "simulate", "demo", "cluster", "watch"):
        assert f"slurm-elastic {command}" in cli


def test_every_command_help_has_an_example() -> None:
    import click

    from slurm_elastic.cli import main

    def leaves(cmd: click.Command, path: str):
        if isinstance(cmd, click.Group):
            ctx = click.Context(cmd)
            for name in cmd.list_commands(ctx):
                yield from leaves(cmd.get_command(ctx, name), f"{path} {name}")
        else:
            yield path, cmd

    missing = [path for path, cmd in leaves(main, "slurm-elastic") if "Example" not in (cmd.help or "")]
    assert not missing, f"commands whose --help has no example: {missing}"
