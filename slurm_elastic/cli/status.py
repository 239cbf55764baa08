"""`slurm-elastic status`: the caller's elastic jobs, and its pending rigid jobs the controller yields to or not."""

from __future__ import annotations

import getpass
import os
import stat
import time
from typing import Mapping

import click

from slurm_elastic.cli._common import echo_json, elastic_errors, printable
from slurm_elastic.cluster.model import Job, JobState
from slurm_elastic import jobfiles as shim


def newest_checkpoint_step(job: Job) -> int | None:
    """The step LATEST points to under the job's checkpoint dir (None when unknown)."""
    if job.spec is None or not job.spec.ckpt_dir:
        return None
    path = os.path.join(shim.job_dir(job.spec.ckpt_dir, shim.job_key(job.job_id)), shim.LATEST_FILE)
    try:
        # The directory is the job user's and may be hostile: never follow a link, never block on a
        # FIFO, never read more than a step name.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return shim.parse_step_dir_name(os.read(fd, 64).decode("ascii").strip())
    except (OSError, ValueError):   # UnicodeDecodeError is a ValueError
        return None
    finally:
        os.close(fd)


def job_row(job: Job, why: str | None = None) -> dict[str, object]:
    spec = job.spec
    return {"job_id": job.job_id, "name": job.name, "user": job.user, "state": job.state.value,
            "reason": job.reason, "held": job.held, "gpus": job.gpus, "nodes": list(job.nodes),
            "min_gpus": spec.min_gpus if spec else None, "max_gpus": spec.max_gpus if spec else None,
            "gpu_step": spec.gpu_step if spec else None, "restarts": job.restarts,
            "checkpoint_step": newest_checkpoint_step(job), "spec_error": job.spec_error, "why": why,
            "ended": job.state.finished, "end_time": job.end_time, "exit_signal": job.exit_signal}


OWN_VIEW = "no daemon's notes found: as a watch of yours would decide, other users' elastic jobs counted as fixed"


def _daemon_notes(who: str) -> Mapping[int, str] | None:
    """The running daemon's notes on `who`'s jobs (control/job_notes.py), when a fresh daemon wrote them and
    the caller may read them; else None."""
    import pwd

    from slurm_elastic.control.job_notes import read_notes
    from slurm_elastic.control.state_dir import daemon_dir, read_heartbeat

    beat = read_heartbeat(daemon_dir())
    if beat is None or not beat.fresh():
        return None
    try:
        uid = pwd.getpwnam(who).pw_uid
    except KeyError:
        return None
    return read_notes(daemon_dir(), uid, max_age_s=max(3 * beat.interval_s, 60.0))


def how_it_ended(job: Job) -> str:
    """A finished job's note: its final state, the signal that ended it, when (Slurm keeps it a while)."""
    parts = [f"ended {job.state.value}"]
    if job.exit_signal is not None:
        parts.append(f"by signal {job.exit_signal}")
    if job.end_time is not None:
        parts.append("at " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.end_time)))
    return " ".join(parts)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per job.")
@click.option("--user", "-u", default=None, help="Whose jobs (default: you).")
@elastic_errors
def status(as_json: bool, user: str | None) -> None:
    """Show your elastic jobs: GPUs now/min/max, state, restarts, newest checkpoint.

    Your pending rigid (non-elastic) GPU jobs are listed too when elastic jobs
    gave GPUs back to them, or with why they do not (e.g. their priority is
    below the elastic jobs' protected minimums).

    Jobs that ended (completed, failed, cancelled...) are listed with their final
    state for as long as Slurm still reports them.

    Jobs whose comment claims an elastic spec that does not parse are listed
    too, with the error: the controller never touches them.

    \b
    Examples:
      slurm-elastic status
      slurm-elastic status --json
    """
    from slurm_elastic import settings
    from slurm_elastic.cli.admin import observer
    from slurm_elastic.cli.controller_options import controller_config
    from slurm_elastic.cluster.select import select_backend

    who = user or getpass.getuser()
    backend = select_backend()
    state = backend.snapshot()
    # Ended jobs stay listed, with their state, for as long as Slurm still reports them (MinJobAge).
    jobs = [j for j in state.jobs if j.user == who and (j.spec or j.spec_error)]
    # A pending rigid GPU job of the caller is listed when the controller has a word on it: elastic
    # jobs gave GPUs back to it, or why they do not (its priority against their protected minimums).
    rigid = [j for j in state.jobs if j.user == who and j.spec is None and not j.spec_error
             and j.state is JobState.PENDING and j.gpus > 0]
    waits: Mapping[int, str] = {}
    notes = _daemon_notes(who)
    if notes is not None:
        waits = notes            # what the running daemon itself says of each job
    elif rigid or any(j.spec and not j.state.finished for j in jobs):
        # Why each job is not being resized now: the decision the running controller would take
        # (the daemon's settings when one runs, else a watch's: its variables, as `sbatch --watch` reads
        # them), as a dry run.
        env = settings.controller_from_env()
        config = controller_config(env["ack_timeout"], env["hysteresis"], env["restart_budget"],  # type: ignore[arg-type]
                                   env["signal_name"])  # type: ignore[arg-type]
        reconciler, _ = observer(backend, config, user=who)
        waits = dict(reconciler.cycle(dry_run=True).waits)
        # That view sizes the caller's own elastic jobs only: to it, other users' count as fixed usage
        for job in rigid:
            if job.job_id in waits:
                waits[job.job_id] += f" ({OWN_VIEW})"
    jobs += [j for j in rigid if j.job_id in waits]
    rows = [job_row(j, waits.get(j.job_id)) for j in sorted(jobs, key=lambda j: j.job_id)]
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo(f"no elastic jobs of {who}")
        return
    ended = {j.job_id: how_it_ended(j) for j in jobs if j.state.finished}
    click.echo(f"{'JOBID':>8} {'NAME':<16} {'STATE':<10} {'GPUS':>4} {'MIN-MAX':>9} {'RESTARTS':>8} {'CKPT':>8}  NOTE")
    for r in rows:
        rng = f"{r['min_gpus']}-{r['max_gpus']}" if r["min_gpus"] is not None else "-"
        note = f"malformed spec: {r['spec_error']}" if r["spec_error"] else (
            ended[r["job_id"]] if r["ended"] else
            "held" if r["held"] else (r["why"] or (r["reason"] if r["state"] == "PENDING" else "")))
        ckpt = "-" if r["checkpoint_step"] is None else r["checkpoint_step"]
        click.echo(f"{r['job_id']:>8} {printable(r['name'])[:16]:<16} {r['state']:<10} {r['gpus']:>4} {rng:>9} "
                   f"{r['restarts']:>8} {ckpt:>8}  {printable(note)}")
