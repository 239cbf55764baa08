"""The `slurm-elastic` command: click groups only; each subcommand lives in its own module."""

from __future__ import annotations

import importlib
import logging
import os
import sys

import click

from slurm_elastic import __version__, settings

# name -> "module:attribute". Subcommands are imported only when used, so
# `slurm-elastic cluster up` does not pay for numpy, HiGHS or torch.
SUBCOMMANDS = {
    "admin": "slurm_elastic.cli.admin:admin",
    "cluster": "slurm_elastic.cli.cluster:cluster",
    "demo": "slurm_elastic.cli.demo:demo",
    "sbatch": "slurm_elastic.cli.sbatch:sbatch",
    "simulate": "slurm_elastic.cli.simulate:simulate",
    "status": "slurm_elastic.cli.status:status",
    "watch": "slurm_elastic.cli.sbatch:watch",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *SUBCOMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in SUBCOMMANDS and cmd_name not in self.commands:
            module, attr = SUBCOMMANDS[cmd_name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="slurm-elastic")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.option("--backend", type=click.Choice(["auto", "cli", "pyslurm"]), default=None,
              help="How to talk to Slurm (default: $SLURM_ELASTIC_BACKEND or auto: pyslurm when it "
                   "imports safely, is not known broken, passes its self-check and matches the running "
                   "Slurm, else the CLI/JSON backend).")
def main(verbose: int, backend: str | None) -> None:
    """Elastic deep-learning training on Slurm.

    Submit jobs with a GPU range; a controller re-solves the allocation of
    GPUs, CPUs and memory over all elastic jobs (an L1-norm integer program
    on HiGHS) when nodes are lost or gained, requeues the jobs whose size
    changes, and the training shim resumes from the last forward-layer
    checkpoint.

    \b
    Examples:
      slurm-elastic cluster up                 # a real 4-node Slurm on loopback
      slurm-elastic sbatch --gpus 2-8 --ckpt-dir /scratch/$USER/ckpt train.sbatch
      slurm-elastic admin rebalance --dry-run --explain
      slurm-elastic demo
    """
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    named = settings.LOG.read()
    if named:
        level = getattr(logging, named.upper(), level)
    configure_logging(level)
    if backend is not None:
        # Every command (and a daemon it starts) chooses its backend from this variable.
        os.environ[settings.BACKEND.env] = backend  # type: ignore[index]



# syslog priorities (sd-daemon(3)): journald reads a leading "<N>" as the line's priority.
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


class _JournalFormatter(logging.Formatter):
    """`<N>name: message`: journald stamps the time itself, and N lets `journalctl -p` filter."""

    def format(self, record: logging.LogRecord) -> str:
        priority = _PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        return f"<{priority}>{super().format(record)}"


def _stderr_is_journal() -> bool:
    """True when stderr is the journal stream systemd named in $JOURNAL_STREAM ("dev:inode")."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(part) for part in stream.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def configure_logging(level: int) -> None:
    handler = logging.StreamHandler()
    if _stderr_is_journal():
        handler.setFormatter(_JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
