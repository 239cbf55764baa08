"""The names a job and the controller share: exit codes, signal, environment and file names, directory layout."""

from __future__ import annotations

import os
import re

from slurm_elastic import settings

REQUEUE_EXIT_CODE = 85
"""Every rank exits with this after a signalled checkpoint is committed: "requeue expected"."""

PEER_LOST_EXIT_CODE = 86
"""A collective timed out or a peer vanished; the last committed checkpoint is the resume point."""

GEOMETRY_EXIT_CODE = 87
"""The global batch cannot be split over this world size; see GEOMETRY_FILE for valid sizes."""

# The job's variables are read in slurm_elastic/settings.py; their names stay importable here.
DEFAULT_SIGNAL = settings.SIGNAL.default
SIGNAL_ENV = settings.SIGNAL.env          # e.g. "USR2", "SIGUSR1", "12"
CKPT_DIR_ENV = settings.CKPT_DIR.env      # the checkpoint root (ElasticSpec.ckpt_dir)
JOB_KEY_ENV = settings.JOB_KEY.env        # overrides the job key (default: the Slurm job id)
BATCH_ENV = settings.BATCH.env            # "adaptive:MIN-MAX" (ElasticSpec.batch): the shim chooses the batch

# -- files in a job directory ------------------------------------------------------------------
METRICS_FILE = "metrics.jsonl"
GEOMETRY_FILE = "geometry.json"
BATCH_FILE = "batch.json"   # an adaptive-batch job's range (records.BatchRange)
LATEST_FILE = "LATEST"
MANIFEST_FILE = "manifest.json"
STEP_DIR_PREFIX = "step-"
PEER_LOST_PREFIX = "peer-lost-"
LAUNCHER_STOPPED_PREFIX = "launcher-stopped-"
RELAUNCHES_IN_PLACE = "in-place"
RANKS_KEPT = "kept"       # the survivors went on in their processes: the step's srun still runs

_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def job_key(job_id: str | int) -> str:
    """The directory name of one job under the checkpoint root.

    The Slurm job id: it survives `scontrol requeue` unchanged, and unlike the
    job name it cannot collide between two concurrent jobs of the same user.
    """
    key = str(job_id)
    if not _KEY_RE.fullmatch(key):
        raise ValueError(f"job key must be 1-128 characters of [A-Za-z0-9._+-], got {key!r}")
    return key


def job_dir(ckpt_root: str, key: str) -> str:
    """`<ckpt_root>/<job-key>`: checkpoints, metrics, acknowledgements of one job."""
    return os.path.join(ckpt_root, job_key(key))


def valid_node_name(value: object) -> bool:
    return isinstance(value, str) and _NODE_RE.fullmatch(value) is not None


END_CAUSES = ("time limit", "preemption")
"""What ENDED-<job>-<restart> may say: the job template's reading of Slurm's signal before the job's end."""


def end_cause_file_name(slurm_job_id: str | int, restart_count: int) -> str:
    """`ENDED-<job id>-<restart count>`: the template committed on Slurm's signal at the job's end and names
    which end (one of END_CAUSES); only ever words output, never decides anything."""
    return f"ENDED-{slurm_job_id}-{int(restart_count)}"


def ack_file_name(slurm_job_id: str | int, restart_count: int) -> str:
    """`ACK-<job id>-<restart count>`: written after the signalled checkpoint is committed."""
    return f"ACK-{slurm_job_id}-{int(restart_count)}"


def ack_path(ckpt_root: str, key: str, slurm_job_id: str | int, restart_count: int) -> str:
    return os.path.join(job_dir(ckpt_root, key), ack_file_name(slurm_job_id, restart_count))


def metrics_path(ckpt_root: str, key: str) -> str:
    return os.path.join(job_dir(ckpt_root, key), METRICS_FILE)


def geometry_path(ckpt_root: str, key: str) -> str:
    return os.path.join(job_dir(ckpt_root, key), GEOMETRY_FILE)


def batch_path(ckpt_root: str, key: str) -> str:
    """`<job dir>/batch.json`, written by an adaptive-batch job's rank 0 on every start (the job's word)."""
    return os.path.join(job_dir(ckpt_root, key), BATCH_FILE)


def step_dir_name(step: int) -> str:
    # Zero-padded so a plain directory listing sorts by step.
    return f"{STEP_DIR_PREFIX}{int(step):010d}"


def parse_step_dir_name(name: str) -> int | None:
    m = re.fullmatch(re.escape(STEP_DIR_PREFIX) + r"([0-9]{1,18})", name)
    return int(m[1]) if m else None


def signal_name(value: str | None = None) -> str:
    """Normalise SLURM_ELASTIC_SIGNAL ('USR2', 'SIGUSR2', '12') to the form scancel takes ('USR2')."""
    import signal as _signal

    text = (value if value is not None else settings.SIGNAL.read()).strip()
    if text.isdigit():
        try:
            return _signal.Signals(int(text)).name.removeprefix("SIG")
        except ValueError:
            raise ValueError(f"{SIGNAL_ENV} must name a signal such as USR2, got {text!r}") from None
    name = text.upper().removeprefix("SIG")
    try:
        _signal.Signals["SIG" + name]
    except KeyError:
        raise ValueError(f"{SIGNAL_ENV} must name a signal such as USR2, got {text!r}") from None
    return name


# -- peer loss: `<job dir>/peer-lost-<job id>-<restart count>-<step id>.json` (peer_lost.py) ----------
_PEER_LOST_RE = re.compile(re.escape(PEER_LOST_PREFIX) + r"([0-9A-Za-z._+-]{1,64})-([0-9]{1,9})-([0-9]{1,9})\.json")


def peer_lost_file_name(slurm_job_id: str | int, restart_count: int, step_id: str | int) -> str:
    return f"{PEER_LOST_PREFIX}{slurm_job_id}-{int(restart_count)}-{int(step_id)}.json"


def parse_peer_lost_file_name(name: str) -> tuple[str, int, int] | None:
    """(job id, restart count, step id) of a peer-lost report's file name, else None."""
    m = _PEER_LOST_RE.fullmatch(name)
    return (m[1], int(m[2]), int(m[3])) if m else None


# `<job dir>/launcher-stopped-<job id>-<restart count>-<step id>`, written by the batch script (the
# templates) once that step's peer-lost report is settled and it has SIGKILLed the step's srun.
# Left alone, that srun waits for the dead node until the requeue kills it, and then cancels its
# step by id (J.0), which by then names the next incarnation's first step; so without this file the
# controller holds the release for KillWait. Its content "in-place" says the script relaunches the
# ranks on what the job keeps if the controller shrinks the running job instead of requeuing it.
# A job's word about its own job only (records.LauncherStopped).
def launcher_stopped_file_name(slurm_job_id: str | int, restart_count: int, step_id: str | int) -> str:
    return f"{LAUNCHER_STOPPED_PREFIX}{slurm_job_id}-{int(restart_count)}-{int(step_id)}"


# `<job dir>/keeps-ranks-<job id>-<restart count>`: written by the batch script when it runs the ranks
# under train/regroup.py with `srun --no-kill` and goes on in place when the survivors re-form their group.
# Its presence lets the controller shrink the running job in place on healthy nodes too (Slurm SIGKILLs the
# ranks on the nodes given up; the others commit and go on). A job's word about its own job only: a false
# one costs only that job (its ranks there killed, whatever its script does then).
KEEPS_RANKS_PREFIX = "keeps-ranks-"


def keeps_ranks_file_name(slurm_job_id: str | int, restart_count: int) -> str:
    return f"{KEEPS_RANKS_PREFIX}{slurm_job_id}-{int(restart_count)}"


# -- one srun step's peers: rendezvous, heartbeats, the survivors' agreement ----------------------
#
# `<job dir>/run-<job id>-<restart count>-<step id>/` holds what the ranks of one srun step
# tell each other without the process group (which is what breaks when a peer is lost):
#   rendezvous.json   rank 0's store address and the port it was given by the kernel
#   hb-<rank>         heartbeat (records.Heartbeat): a counter the rank's liveness thread rewrites every second
#   lost              the first survivor to see a lost peer says so here; every rank looks
#   status-<rank>.json  a survivor's completed step and state digest, after it stopped stepping
#   decision.json     the agreed step and the committing rank (created once, never replaced)
#   ready-<rank>.json  a survivor whose training thread can re-form the group in its process (train/regroup.py)
#   regroup.json      whether the survivors re-form the group in place or exit to be relaunched (created once)
# Only the job's own ranks write there; the controller reads only the peer-lost report.

RUN_DIR_PREFIX = "run-"
RENDEZVOUS_FILE = "rendezvous.json"
LOST_FILE = "lost"
DECISION_FILE = "decision.json"
REGROUP_FILE = "regroup.json"


def run_dir_name(slurm_job_id: str | int, restart_count: int, step_id: str | int) -> str:
    return f"{RUN_DIR_PREFIX}{slurm_job_id}-{int(restart_count)}-{int(step_id)}"


def parse_run_dir_name(name: str) -> tuple[str, int, int] | None:
    m = re.fullmatch(re.escape(RUN_DIR_PREFIX) + r"([0-9A-Za-z._+-]{1,64})-([0-9]{1,9})-([0-9]{1,9})", name)
    return (m[1], int(m[2]), int(m[3])) if m else None


def heartbeat_file_name(rank: int) -> str:
    return f"hb-{int(rank)}"


def status_file_name(rank: int) -> str:
    return f"status-{int(rank)}.json"


def ready_file_name(rank: int) -> str:
    return f"ready-{int(rank)}.json"


def exited_file_name(rank: int) -> str:
    """In a re-formed group's run directory: this rank's command ended, with the exit code it holds. Its
    srun still waits for the lost node's tasks, which never report: the batch script ends it on these."""
    return f"exited-{int(rank)}"
