"""The names shared by the training shim and the controller: exit codes, signal, file names (no torch here)."""

from __future__ import annotations

import os
import re

# The controller imports this module, so it must stay free of torch and numpy.

REQUEUE_EXIT_CODE = 85
"""Every rank exits with this after a signalled checkpoint is committed: "requeue expected"."""

PEER_LOST_EXIT_CODE = 86
"""A collective timed out or a peer vanished; the last committed checkpoint is the resume point."""

GEOMETRY_EXIT_CODE = 87
"""The global batch cannot be split over this world size; see GEOMETRY_FILE for valid sizes."""

DEFAULT_SIGNAL = "USR2"
SIGNAL_ENV = "SLURM_ELASTIC_SIGNAL"      # e.g. "USR2", "SIGUSR1", "12"
CKPT_DIR_ENV = "SLURM_ELASTIC_CKPT_DIR"  # the checkpoint root (ElasticSpec.ckpt_dir)
JOB_KEY_ENV = "SLURM_ELASTIC_JOB_KEY"    # overrides the job key (default: the Slurm job id)

METRICS_FILE = "metrics.jsonl"
GEOMETRY_FILE = "geometry.json"
LATEST_FILE = "LATEST"
MANIFEST_FILE = "manifest.json"
STEP_DIR_PREFIX = "step-"

_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")


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


def ack_file_name(slurm_job_id: str | int, restart_count: int) -> str:
    """`ACK-<job id>-<restart count>`: written after the signalled checkpoint is committed."""
    return f"ACK-{slurm_job_id}-{int(restart_count)}"


def ack_path(ckpt_root: str, key: str, slurm_job_id: str | int, restart_count: int) -> str:
    return os.path.join(job_dir(ckpt_root, key), ack_file_name(slurm_job_id, restart_count))


def metrics_path(ckpt_root: str, key: str) -> str:
    return os.path.join(job_dir(ckpt_root, key), METRICS_FILE)


def geometry_path(ckpt_root: str, key: str) -> str:
    return os.path.join(job_dir(ckpt_root, key), GEOMETRY_FILE)


def step_dir_name(step: int) -> str:
    # Zero-padded so a plain directory listing sorts by step.
    return f"{STEP_DIR_PREFIX}{int(step):010d}"


def parse_step_dir_name(name: str) -> int | None:
    m = re.fullmatch(re.escape(STEP_DIR_PREFIX) + r"([0-9]{1,18})", name)
    return int(m[1]) if m else None


def signal_name(value: str | None = None) -> str:
    """Normalise SLURM_ELASTIC_SIGNAL ('USR2', 'SIGUSR2', '12') to the form scancel takes ('USR2')."""
    import signal as _signal

    text = (value if value is not None else os.environ.get(SIGNAL_ENV, DEFAULT_SIGNAL)).strip()
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
