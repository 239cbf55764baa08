"""`slurm-elastic demo`: the whole method on the embedded local cluster."""

from __future__ import annotations

import click

from slurm_elastic.cli._common import not_implemented


@click.command()
def demo() -> None:
    """Run three elastic jobs on the local cluster, lose and gain a node, and report.

    \b
    Example:
      slurm-elastic demo --keep
    """
    not_implemented("demo")
