"""The names shared by the training shim and the controller: exit codes, signal, file names (no torch here)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from slurm_elastic import settings

# The controller imports this module, so it must stay free of torch and numpy.

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

METRICS_FILE = "metrics.jsonl"
GEOMETRY_FILE = "geometry.json"
BATCH_FILE = "batch.json"   # an adaptive-batch job's range: {"min": int, "max": int, "base": int}
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


# -- peer loss: what a job tells the controller about the peers it lost -------------------------
#
# `<job dir>/peer-lost-<job id>-<restart count>-<step id>.json`, one per srun step that lost a
# peer, written (temp name, rename) by the survivor that commits the just-in-time checkpoint:
# first with "commit": "pending" as soon as the survivors agree, then replaced once with
# "done" or "failed". The controller may act on the first version (the lost nodes are known);
# the resume step is `committed_step` once "commit" is "done", else the last committed
# checkpoint. A job's word: the controller uses it for this job only.

PEER_LOST_FORMAT = "slurm-elastic-peer-lost/1"
PEER_LOST_PREFIX = "peer-lost-"
COMMIT_STATES = ("pending", "done", "failed", "none")   # none: nothing to commit (no full replica survived)
DETECTORS = ("heartbeat", "collective-error")
_PEER_LOST_RE = re.compile(re.escape(PEER_LOST_PREFIX) + r"([0-9A-Za-z._+-]{1,64})-([0-9]{1,9})-([0-9]{1,9})\.json")


def peer_lost_file_name(slurm_job_id: str | int, restart_count: int, step_id: str | int) -> str:
    return f"{PEER_LOST_PREFIX}{slurm_job_id}-{int(restart_count)}-{int(step_id)}.json"


# `<job dir>/launcher-stopped-<job id>-<restart count>-<step id>`, written by the batch script (the
# templates) once that step's peer-lost report is settled and it has SIGKILLed the step's srun.
# Left alone, that srun waits for the dead node until the requeue kills it, and then cancels its
# step by id (J.0), which by then names the next incarnation's first step; so without this file the
# controller holds the release for KillWait. Its content "in-place" says the script relaunches the
# ranks on what the job keeps if the controller shrinks the running job instead of requeuing it.
# A job's word about its own job only.
LAUNCHER_STOPPED_PREFIX = "launcher-stopped-"
RELAUNCHES_IN_PLACE = "in-place"


def launcher_stopped_file_name(slurm_job_id: str | int, restart_count: int, step_id: str | int) -> str:
    return f"{LAUNCHER_STOPPED_PREFIX}{slurm_job_id}-{int(restart_count)}-{int(step_id)}"


def parse_peer_lost_file_name(name: str) -> tuple[str, int, int] | None:
    """(job id, restart count, step id) of a peer-lost report's file name, else None."""
    m = _PEER_LOST_RE.fullmatch(name)
    return (m[1], int(m[2]), int(m[3])) if m else None


@dataclass(frozen=True, slots=True)
class LostRank:
    rank: int
    node: str


@dataclass(frozen=True, slots=True)
class PeerLostReport:
    """Which peers one srun step of a job lost, and what the survivors committed."""

    job_id: str
    restart_count: int
    step_id: int
    world_size: int
    detected_by: str                  # one of DETECTORS
    detected_at: float                # unix time the first survivor saw it
    lost: tuple[LostRank, ...]        # every rank that did not take part in the agreement
    lost_nodes: tuple[str, ...]       # nodes none of whose ranks survived: the ones to avoid
    surviving_nodes: tuple[str, ...]
    agreed_step: int | None           # the last step every survivor completed (None: no full replica)
    commit: str                       # one of COMMIT_STATES
    committed_step: int | None        # the step the job resumes from when commit == "done"
    reason: str                       # one line for people

    def to_json(self) -> dict[str, Any]:
        body = {f: getattr(self, f) for f in self.__slots__}
        body["lost"] = [{"rank": r.rank, "node": r.node} for r in self.lost]
        body["lost_nodes"] = list(self.lost_nodes)
        body["surviving_nodes"] = list(self.surviving_nodes)
        body["format"] = PEER_LOST_FORMAT
        return body

    @classmethod
    def parse(cls, data: bytes | str, where: str = "peer-lost report") -> PeerLostReport:
        """Validate a report written by a job (its user's data: checked, never trusted further)."""
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("format") != PEER_LOST_FORMAT:
            raise ValueError(f"{where}: not a {PEER_LOST_FORMAT} document")
        try:
            lost = tuple(LostRank(_nonneg(r["rank"]), _name(r["node"])) for r in body["lost"])
            report = cls(job_id=_name(body["job_id"]), restart_count=_nonneg(body["restart_count"]),
                         step_id=_nonneg(body["step_id"]), world_size=_nonneg(body["world_size"]),
                         detected_by=_choice(body["detected_by"], DETECTORS),
                         detected_at=float(body["detected_at"]), lost=lost,
                         lost_nodes=tuple(_name(n) for n in body["lost_nodes"]),
                         surviving_nodes=tuple(_name(n) for n in body["surviving_nodes"]),
                         agreed_step=_opt_nonneg(body["agreed_step"]), commit=_choice(body["commit"], COMMIT_STATES),
                         committed_step=_opt_nonneg(body["committed_step"]), reason=str(body["reason"])[:1000])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: malformed ({type(exc).__name__}: {exc})") from None
        if any(r.rank >= report.world_size for r in report.lost):
            raise ValueError(f"{where}: a lost rank is outside the world size {report.world_size}")
        return report


_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def valid_node_name(value: Any) -> bool:
    return isinstance(value, str) and _NODE_RE.fullmatch(value) is not None


def _name(value: Any) -> str:
    if not valid_node_name(value):
        raise ValueError(f"{value!r} is not a node name or job id")
    return value


def _nonneg(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _opt_nonneg(value: Any) -> int | None:
    return None if value is None else _nonneg(value)


def _choice(value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
    return value


# -- one srun step's peers: rendezvous, heartbeats, the survivors' agreement ----------------------
#
# `<job dir>/run-<job id>-<restart count>-<step id>/` holds what the ranks of one srun step
# tell each other without the process group (which is what breaks when a peer is lost):
#   rendezvous.json   rank 0's store address and the port it was given by the kernel
#   hb-<rank>         heartbeat: a counter the rank's liveness thread rewrites every second
#   lost              the first survivor to see a lost peer says so here; every rank looks
#   status-<rank>.json  a survivor's completed step and state digest, after it stopped stepping
#   decision.json     the agreed step and the committing rank (created once, never replaced)
# Only the job's own ranks write there; the controller reads only the peer-lost report.

RUN_DIR_PREFIX = "run-"
RENDEZVOUS_FILE = "rendezvous.json"
LOST_FILE = "lost"
DECISION_FILE = "decision.json"


def run_dir_name(slurm_job_id: str | int, restart_count: int, step_id: str | int) -> str:
    return f"{RUN_DIR_PREFIX}{slurm_job_id}-{int(restart_count)}-{int(step_id)}"


def parse_run_dir_name(name: str) -> tuple[str, int, int] | None:
    m = re.fullmatch(re.escape(RUN_DIR_PREFIX) + r"([0-9A-Za-z._+-]{1,64})-([0-9]{1,9})-([0-9]{1,9})", name)
    return (m[1], int(m[2]), int(m[3])) if m else None


def heartbeat_file_name(rank: int) -> str:
    return f"hb-{int(rank)}"


def status_file_name(rank: int) -> str:
    return f"status-{int(rank)}.json"
