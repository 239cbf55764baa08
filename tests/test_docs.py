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


def test_the_settings_table_in_the_admin_guide_is_the_settings_modules() -> None:
    import re

    from slurm_elastic.cli.reference import render_settings

    text = (REPO / "docs" / "admin.md").read_text()
    found = re.search(r"<!-- settings-table:[^\n]*-->\n(.*?)<!-- /settings-table -->", text, re.S)
    assert found is not None, "docs/admin.md has no settings table"
    expected = render_settings()
    assert found[1] == expected, "docs/admin.md's settings table is stale; replace it with:\n" + expected


def test_the_cli_reference_is_the_cli_as_it_is() -> None:
    import re

    from slurm_elastic.cli import main
    from slurm_elastic.cli.reference import render_reference

    text = (REPO / "docs" / "cli.md").read_text()
    found = re.search(r"<!-- cli-reference:[^\n]*-->\n(.*?)<!-- /cli-reference -->", text, re.S)
    assert found is not None, "docs/cli.md has no generated reference"
    expected = render_reference(main)
    assert found[1] == expected, "docs/cli.md is stale; replace the reference with:\n" + expected


def test_the_job_templates_defaults_are_the_settings_modules() -> None:
    import re

    from slurm_elastic import settings

    by_env = {s.env: s for s in settings.SETTINGS if s.env}
    seen = set()
    for template in sorted((REPO / "job_templates").glob("*.sbatch")):
        for var, default in re.findall(r"\$\{(SLURM_ELASTIC_[A-Z0-9_]+):-([^}$]*)\}", template.read_text()):
            assert var in by_env, f"{template.name} reads {var}, which slurm_elastic/settings.py does not name"
            seen.add(var)
            if by_env[var].default is not None:
                assert default == str(by_env[var].default), (template.name, var, default)
    assert {s.env for s in settings.SETTINGS if s.read_by == "job_templates"} <= seen
