"""`slurm-elastic status`: the caller's elastic jobs."""

from __future__ import annotations

import click

from slurm_elastic.cli._common import not_implemented


@click.command()
def status() -> None:
    """Show your elastic jobs: GPUs now/min/max, state, restarts, newest checkpoint.

    \b
    Example:
      slurm-elastic status --json
    """
    not_implemented("status")
