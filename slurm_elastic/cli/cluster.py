"""`slurm-elastic cluster`: the embedded local multi-node Slurm on loopback."""

from __future__ import annotations

import click

from slurm_elastic.cli._common import not_implemented


@click.group()
def cluster() -> None:
    """A real multi-node Slurm on 127.0.0.1 for the demo, tests and newcomers.

    \b
    Examples:
      slurm-elastic cluster up
      slurm-elastic cluster node-down n2
    """


@cluster.command("up")
def cluster_up() -> None:
    """Start slurmctld, munged and the slurmd of each node."""
    not_implemented("cluster up")
