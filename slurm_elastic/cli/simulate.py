"""`slurm-elastic simulate`: replay a workload under elastic L1 scheduling and baselines."""

from __future__ import annotations

import click

from slurm_elastic.cli._common import not_implemented


@click.command()
def simulate() -> None:
    """Replay a workload trace under the l1 policy and the baselines.

    \b
    Example:
      slurm-elastic simulate workload-1.csv --policy all --cluster 16x4
    """
    not_implemented("simulate")
