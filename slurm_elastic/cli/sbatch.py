"""`slurm-elastic sbatch` and `watch`: submitting elastic jobs and the user-mode controller."""

from __future__ import annotations

import click

from slurm_elastic.cli._common import not_implemented


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def sbatch(args: tuple[str, ...]) -> None:
    """Submit an elastic job: sbatch with a GPU range.

    \b
    Example:
      slurm-elastic sbatch --gpus 4-32 --gpu-step 4 train.sbatch
    """
    not_implemented("sbatch")


@click.command()
def watch() -> None:
    """User mode: rebalance your own elastic jobs in the foreground.

    \b
    Example:
      slurm-elastic watch
    """
    not_implemented("watch")
