"""The one line a job's output shows at every start: where training continues, from which checkpoint, and why."""

from __future__ import annotations

import os
import sys

from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.environment import JobEnvironment

PREFIX = "slurm-elastic:"
METRICS_TAIL_BYTES = 1 << 16      # the newest rows are enough: a row is a few hundred bytes


def restart_cause(job_dir: str, env: JobEnvironment) -> str:
    """Why this start follows an earlier one, from what the earlier one left in the job's own directory.

    The files are the job's own (this rank's user wrote them); the answer only words a line of
    output, so a missing or odd directory gives the plainest cause, never an error.
    """
    try:
        names = os.listdir(job_dir)
    except OSError:
        names = []
    job, restart = str(env.job_id), env.restart_count
    lost = [parsed for parsed in map(protocol.parse_peer_lost_file_name, names)
            if parsed is not None and parsed[0] == job]
    if env.generation > 0:
        return "a lost peer (the survivors committed and went on in their processes)"
    if any(r == restart and s < env.step_id for _, r, s in lost):
        return "a lost peer (the survivors committed and were relaunched in place)"
    if restart > 0 and protocol.ack_file_name(job, restart - 1) in names:
        cause = protocol.read_end_cause(job_dir, job, restart - 1, owner_uid=os.getuid())
        if cause is not None:
            return f"a {cause} (checkpoint acknowledged at Slurm's signal)"
        return "a signalled stop: a resize by the controller, a time limit or a preemption (checkpoint acknowledged)"
    if any(r == restart - 1 for _, r, _ in lost):
        return "a lost peer (the survivors committed before the requeue)"
    if restart > 0:
        return (f"a requeue (restart {restart}) with no acknowledged checkpoint: a node failure, a time "
                "limit or an unacknowledged stop; the last periodic checkpoint")
    return f"an earlier run under job key {os.path.basename(job_dir)}"


def steps_reached(job_dir: str) -> int | None:
    """The step of the job's newest metrics row: a step an earlier start is known to have completed (rows
    come every few seconds, so it may have gone further). None when there is no readable row."""
    read = protocol.read_metrics(os.path.join(job_dir, protocol.METRICS_FILE), owner_uid=os.getuid(),
                                 max_bytes=METRICS_TAIL_BYTES)
    return read.rows[-1].step if read.rows else None


def start_line(job_dir: str, env: JobEnvironment, *, step: int, restored_step: int | None,
               epoch: int | None = None) -> str:
    """'resumed at step N (epoch E) from <checkpoint> after <cause>', or where a fresh start begins.

    After a stop that committed nothing, the line also says how many steps, at least, are done again."""
    at = f"step {step}" + (f" (epoch {epoch})" if epoch is not None else "")
    reached = steps_reached(job_dir) if env.restart_count > 0 or restored_step is not None else None
    if restored_step is None:
        line = f"{PREFIX} started at {at}: no checkpoint in {job_dir}"
    else:
        checkpoint = os.path.join(job_dir, protocol.step_dir_name(restored_step))
        line = f"{PREFIX} resumed at {at} from {checkpoint} after {restart_cause(job_dir, env)}"
    if reached is not None and reached > step:
        line += f"; an earlier start had reached step {reached}: at least {reached - step} steps are lost"
    return line


def announce(line: str) -> None:
    """Write `line` to the job's stderr itself: a script's logging setup (or none) must not hide it."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
