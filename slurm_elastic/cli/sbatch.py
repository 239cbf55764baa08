"""`slurm-elastic sbatch` and `watch`: submitting elastic jobs and the user-mode controller."""

from __future__ import annotations

import getpass
import logging
import shlex
from typing import Any

import click

from slurm_elastic import settings
from slurm_elastic.cli._common import elastic_errors
from slurm_elastic.cli.controller_options import controller_config, controller_options
from slurm_elastic.control.reconcile import ControllerConfig

log = logging.getLogger(__name__)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@elastic_errors
def sbatch(args: tuple[str, ...]) -> None:
    """Submit an elastic job: sbatch with a GPU range.

    \b
    Elastic options (on the command line or as `#ELASTIC` lines in the
    script; the command line wins):
      --gpus MIN-MAX       GPU range (required), e.g. 4-32
      --gpu-step K         GPU counts are multiples of K (default 1)
      --cpus-per-gpu N     CPUs that go with each GPU (default 1)
      --mem-per-gpu SIZE   memory per GPU, e.g. 8G (default 1024M)
      --weight W           share when GPUs are scarce (default 1)
      --ckpt-dir PATH      checkpoint root of the job (required; exported as
                           SLURM_ELASTIC_CKPT_DIR; default: that variable, if set)
      --batch adaptive:MIN-MAX
                           let the shim choose the global batch by goodput (opt-in;
                           exported as SLURM_ELASTIC_BATCH; default: the fixed batch)
      --signal-before S    Slurm sends the checkpoint signal S seconds before the
                           time limit; the job commits and requeues itself
                           (default 120; 0: none)
      --total-time TIME    stop requeueing at time limits once TIME (Slurm's format)
                           has passed since submission (default: never)
    Own flags:
      --watch              stay in the foreground and rebalance your elastic jobs (user mode)
      --dry-run            print the sbatch command instead of submitting
      --parsable           print only the job id
    Every other sbatch option is passed on (spelled out in full). Refused,
    in any spelling sbatch accepts (an unambiguous prefix such as --arr,
    bundled short options such as -Ha 0-2, #SBATCH or #SLURM lines, SBATCH_*
    variables): --array/-a, --nodes/-N, --gres, -G, --gpus-per-*,
    --tres-per-task, --no-requeue, --comment, --wrap, --mem, --mem-per-cpu,
    --cpus-per-task/-c (the controller sets the shape), --signal (set by
    --signal-before); in #SBATCH lines also
    --gpus, --cpus-per-gpu, --mem-per-gpu (write them as #ELASTIC lines).
    #PBS/#BSUB lines are refused (sbatch runs with --ignore-pbs). Your --export (command line,
    #SBATCH or SBATCH_EXPORT) keeps its meaning; the wrapper's variables
    (SLURM_ELASTIC_CKPT_DIR) are added to it.

    \b
    Examples:
      slurm-elastic sbatch --gpus 4-32 --gpu-step 4 --ckpt-dir /scratch/me/ckpt -t 12:00:00 train.sbatch
      slurm-elastic sbatch --parsable --gpus 2-8 --ckpt-dir /scratch/me/ckpt train.sbatch --lr 0.1
      slurm-elastic sbatch --watch --gpus 1-4 --ckpt-dir /scratch/me/ckpt train.sbatch
    """
    from slurm_elastic.cluster.cli_backend import sbatch_args
    from slurm_elastic.cluster.select import select_backend
    from slurm_elastic.control.submit import SiteView, parse_command_line, submission_notices, submit

    request = parse_command_line(args)
    backend = select_backend()
    site = SiteView.read(backend)          # the partitions and reservations, read once for both
    for notice in submission_notices(backend, request, site=site):
        click.echo(f"slurm-elastic sbatch: note: {notice}", err=True)
    description, job_id = submit(backend, request, site)
    if job_id is None:
        click.echo(shlex.join(sbatch_args(description)))
        return
    click.echo(str(job_id) if request.parsable else f"Submitted batch job {job_id}")
    if request.watch:
        # `sbatch --watch` has no room for controller flags: it takes them from their variables.
        env: Any = settings.controller_from_env()
        _watch(backend, interval=env["interval"],
               config=controller_config(env["ack_timeout"], env["hysteresis"], env["restart_budget"],
                                        env["signal_name"]), job_ids=None)


@click.command()
@controller_options(settings.WATCH)
@click.option("--job", "job_ids", type=int, multiple=True, help="Watch only these of your jobs (repeatable).")
@elastic_errors
def watch(interval: float, ack_timeout: float, hysteresis: float, restart_budget: int, signal_name: str,
          job_ids: tuple[int, ...]) -> None:
    """User mode: rebalance your own elastic jobs in the foreground.

    Solves the allocation over your queued and running elastic jobs with the
    capacity the rest of the cluster leaves, and resizes them with the same
    requeue protocol as the admin daemon. Ends when your elastic jobs have
    ended. One watch per user (a lock beside the per-user journal in
    $SLURM_ELASTIC_STATE_DIR, default ~/.local/state/slurm-elastic); while
    the admin daemon runs (a fresh heartbeat in $SLURM_ELASTIC_DAEMON_DIR,
    default /var/lib/slurm-elastic) it only waits and defers to it.

    \b
    Examples:
      slurm-elastic watch
      slurm-elastic -v watch --interval 5 --job 1234
    """
    from slurm_elastic.cluster.select import select_backend

    backend = select_backend()
    ids = frozenset(job_ids) if job_ids else None
    if ids:
        _check_own_elastic(backend, ids)
    _watch(backend, interval=interval, config=controller_config(ack_timeout, hysteresis, restart_budget,
                                                                  signal_name), job_ids=ids)


def _check_own_elastic(backend: Any, job_ids: frozenset[int]) -> None:
    from slurm_elastic.cli.admin import check_elastic_ids

    check_elastic_ids(backend.snapshot(), job_ids, user=getpass.getuser())


def _watch(backend: Any, *, interval: float, config: ControllerConfig, job_ids: frozenset[int] | None) -> None:
    from slurm_elastic.control.state_dir import daemon_dir, user_dir
    from slurm_elastic.control.user_mode import run_watch

    user = getpass.getuser()
    click.echo(f"watching the elastic jobs of {user} (Ctrl-C to stop; jobs keep running)", err=True)

    said: dict[int, str] = {}

    def on_cycle(report: Any) -> None:
        for outcome in report.outcomes:
            click.echo(f"job {outcome.job_id}: plan {outcome.status} {outcome.note}".rstrip(), err=True)
        # Each wait once, when its kind changes (the seconds left change every cycle).
        waits = report.waits
        for job_id, why in sorted(waits.items()):
            if said.get(job_id) != why.split(" (")[0].split(":")[0]:
                click.echo(f"job {job_id}: not resized now: {why}", err=True)
        said.clear()
        said.update({j: w.split(" (")[0].split(":")[0] for j, w in waits.items()})

    try:
        result = run_watch(backend, user, state_dir=user_dir(), daemon_dir=daemon_dir(), config=config,
                           interval_s=interval, job_ids=job_ids, on_cycle=on_cycle)
    except KeyboardInterrupt:
        click.echo("watch stopped", err=True)
        return
    click.echo(f"watch ended: {result.reason} ({result.cycles} cycles, {result.deferred_cycles} deferred "
               "to the admin daemon)", err=True)


__all__ = ["sbatch", "watch"]
