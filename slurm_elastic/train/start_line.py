"""The one line a job's output shows at every start: where training continues, from which checkpoint, and why."""

from __future__ import annotations

import os
import sys

from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.environment import JobEnvironment

PREFIX = "slurm-elastic:"
METRICS_TAIL_BYTES = 1 << 16      # the newest rows are enough: a row is a few hundred bytes
REPORT_MAX_BYTES = 1 << 16        # a peer-lost report is well under 1 KiB per lost rank


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
        return _lost_peer(job_dir, protocol.peer_lost_file_name(job, restart, env.step_id),
                          "went on in their processes")
    earlier = [s for _, r, s in lost if r == restart and s < env.step_id]
    if earlier:
        return _lost_peer(job_dir, protocol.peer_lost_file_name(job, restart, max(earlier)),
                          "were relaunched in place")
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


def _lost_peer(job_dir: str, report_name: str, then: str) -> str:
    """The cause after a lost peer; what the survivors' report says of their commit where it can be read."""
    try:
        data = protocol.read_user_file(os.path.join(job_dir, report_name), owner_uid=os.getuid(),
                                       max_bytes=REPORT_MAX_BYTES, what="a peer-lost report")
        done = None if data is None else protocol.PeerLostReport.parse(data).commit == "done"
    except (OSError, ValueError):     # the job's own file: an odd one only words the line plainer
        done = None
    if done is False:
        return f"a lost peer (the survivors {then} without a commit: from the last checkpoint)"
    return f"a lost peer (the survivors committed and {then})"


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
