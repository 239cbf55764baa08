"""Every setting of slurm-elastic once: its default, environment variable, CLI option and heartbeat key.

This is the one module that reads `SLURM_ELASTIC_*` variables; everything else
asks a `Setting` (`HYSTERESIS.read()`) or one of the path accessors below. The
controller's click options (cli/controller_options.py), ControllerConfig and
RequestSettings take their defaults from here, and docs/admin.md's table is
checked against `SETTINGS`. Stdlib only: the torch shim imports it too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Literal, Mapping, TypeVar

from slurm_elastic.errors import SettingError

T = TypeVar("T")
Kind = Literal["float", "int", "str", "choice", "flag", "path"]

# Sections of the table (docs/admin.md groups the settings by them).
CONTROLLER = "controller"   # how a controller decides and acts (daemon, rebalance, watch, sbatch --watch)
SITE = "site"               # where state lives, how Slurm is reached, logging
JOB = "job"                 # what a job is told by the wrapper; read by the shim or the job templates
DEVCLUSTER = "devcluster"   # the local test cluster's own knobs
TEST = "test"               # hooks for the test suite

# The commands whose controller options come from this table.
DAEMON, REBALANCE, WATCH = "daemon", "rebalance", "watch"
ALL_CONTROLLERS = (DAEMON, REBALANCE, WATCH)


@dataclass(frozen=True, slots=True)
class Setting(Generic[T]):
    """One setting; its bounds and choices apply to every source (variable, option, heartbeat)."""

    name: str                            # the Python name (ControllerConfig field or click parameter)
    default: T
    help: str
    section: str
    kind: Kind = "str"
    env: str | None = None               # the environment variable, where it has one
    option: str | None = None            # the CLI option, where it has one
    commands: tuple[str, ...] = ()       # the controller commands that carry `option`
    heartbeat: str | None = None         # its key in the daemon heartbeat, where the daemon announces it
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    read_by: str = "slurm_elastic"       # who reads the variable: this package, or the job templates

    def read(self, environ: Mapping[str, str] | None = None) -> T:
        """The value from the environment (`os.environ` unless given), else the default; an unset or
        empty variable is the default. A value the setting cannot take raises SettingError (one line)."""
        if self.env is None:
            return self.default
        text = (os.environ if environ is None else environ).get(self.env)
        if not text:
            return self.default
        try:
            return self.parse(text)  # type: ignore[return-value]
        except ValueError as exc:
            raise SettingError(f"{self.env}={text!r}: {exc}") from None

    def parse(self, text: str) -> object:
        """`text` as this setting's kind, in its bounds; ValueError saying what it must be otherwise.
        A string or a path is taken as written."""
        value: object
        if self.kind in ("float", "int"):
            try:
                value = float(text) if self.kind == "float" else int(text)
            except ValueError:
                raise ValueError(f"must be {'a number' if self.kind == 'float' else 'a whole number'}") from None
            if not self.in_bounds(value):  # type: ignore[arg-type]
                raise ValueError(f"must be {self.bounds()}")
            return value
        word = text.strip().lower()
        if self.kind == "choice":
            if word not in self.choices:
                raise ValueError(f"must be one of {', '.join(self.choices)}")
            return word
        if self.kind == "flag":
            if word not in ("0", "1", "true", "false", "yes", "no"):
                raise ValueError("must be 0 or 1")
            return word in ("1", "true", "yes")
        return text

    def in_bounds(self, value: float) -> bool:
        return value == value and ((self.minimum is None or value >= self.minimum)
                                   and (self.maximum is None or value <= self.maximum))

    def bounds(self) -> str:
        if self.minimum is not None and self.maximum is not None:
            return f"between {self.minimum:g} and {self.maximum:g}"
        if self.minimum is not None:
            return f"at least {self.minimum:g}"
        return f"at most {self.maximum:g}" if self.maximum is not None else "a number"


# -- the controller ---------------------------------------------------------------------------------------
INTERVAL: Setting[float] = Setting(
    "interval", 10.0, "Seconds between reconcile cycles.", CONTROLLER, kind="float",
    env="SLURM_ELASTIC_INTERVAL", option="--interval", commands=ALL_CONTROLLERS, heartbeat="interval_s",
    minimum=0.5)
ACK_TIMEOUT: Setting[float] = Setting(
    "ack_timeout", 60.0, "Seconds to wait for a job's checkpoint ACK before requeueing it anyway.", CONTROLLER,
    kind="float", env="SLURM_ELASTIC_ACK_TIMEOUT", option="--ack-timeout", commands=ALL_CONTROLLERS,
    heartbeat="ack_timeout_s", minimum=0, maximum=1e7)
HYSTERESIS: Setting[float] = Setting(
    "hysteresis", 300.0, "No resize of a job within this many seconds of its last one, unless it lost a node.",
    CONTROLLER, kind="float", env="SLURM_ELASTIC_HYSTERESIS", option="--hysteresis", commands=ALL_CONTROLLERS,
    heartbeat="hysteresis_s", minimum=0, maximum=1e7)
RESTART_BUDGET: Setting[int] = Setting(
    "restart_budget", 6, "Controller-caused restarts allowed per job per hour.", CONTROLLER, kind="int",
    env="SLURM_ELASTIC_RESTART_BUDGET", option="--restart-budget", commands=ALL_CONTROLLERS,
    heartbeat="restart_budget_per_hour", minimum=0, maximum=1e6)
# Both sides read this one: the controller sends it, the shim (and the job templates) wait for it.
SIGNAL: Setting[str] = Setting(
    "signal_name", "USR2", "Checkpoint signal sent to every step of a job before it is requeued.", CONTROLLER,
    env="SLURM_ELASTIC_SIGNAL", option="--signal", commands=ALL_CONTROLLERS, heartbeat="signal")
METRICS_PORT: Setting[int | None] = Setting(
    "metrics_port", None, "Serve Prometheus metrics on this port (0: none).", CONTROLLER, kind="int",
    option="--metrics-port", commands=(DAEMON,), minimum=0, maximum=65535)
METRICS_ADDR: Setting[str] = Setting(
    "metrics_addr", "127.0.0.1", "Address the metrics server binds (0.0.0.0: all interfaces).", CONTROLLER,
    option="--metrics-addr", commands=(DAEMON,))
SPEED: Setting[str] = Setting(
    "speed", "measured", "Jobs' speed per GPU count: fitted from their metrics, or the default linear model "
    "(for GPUs that are not real, such as the local cluster's, which share CPU cores).", CONTROLLER,
    kind="choice", option="--speed", commands=(DAEMON,), heartbeat="speed", choices=("measured", "linear"))
OBJECTIVE: Setting[str] = Setting(
    "objective", "legacy", "What the allocator maximises: the rule chain's weighted speed, each restart "
    "charged once (legacy), or each job's progress with heSRPT rank weights, the restart priced in lost progress and "
    "finish-time-fairness floors as penalised slacks (progress; docs/allocator.md).", CONTROLLER, kind="choice",
    env="SLURM_ELASTIC_OBJECTIVE", choices=("legacy", "progress"))
DRAIN_ON_PEER_LOSS: Setting[bool] = Setting(
    "drain_on_peer_loss", False, "Also drain a node that a job reports its ranks lost on (with the job and user "
    "as the reason; at most 2 nodes per user per hour). Off: only that job avoids the node.", CONTROLLER,
    kind="flag", option="--drain-on-peer-loss", commands=(DAEMON,))
DRAIN_EXPIRY: Setting[float] = Setting(
    "drain_expiry", 3600.0, "Seconds after which a drain made on a job's report is resumed (if still ours).",
    CONTROLLER, kind="float", option="--drain-expiry", commands=(DAEMON,), minimum=0, maximum=1e7)
# The site's rules for pending rigid jobs (allocate/from_state.py RigidPolicy; docs/admin.md).
RIGID_PARTITIONS: Setting[str] = Setting(
    "rigid_partitions", "", "Comma-separated partitions whose pending rigid jobs elastic jobs give borrowed GPUs "
    "back to (empty: every partition).", CONTROLLER, env="SLURM_ELASTIC_RIGID_PARTITIONS",
    option="--rigid-partitions", commands=(DAEMON,))
RIGID_YIELD_AFTER: Setting[float] = Setting(
    "rigid_yield_after", 0.0, "Seconds a pending rigid job waits before elastic jobs give GPUs back to it.",
    CONTROLLER, kind="float", env="SLURM_ELASTIC_RIGID_YIELD_AFTER", option="--rigid-yield-after",
    commands=(DAEMON,), minimum=0, maximum=1e7)
ELASTIC_MINIMUM: Setting[str] = Setting(
    "elastic_minimum", "protected", "An elastic job's minimum: kept from pending rigid jobs (protected), or given "
    "to a rigid job of higher Slurm priority (by-priority).", CONTROLLER, kind="choice",
    env="SLURM_ELASTIC_MINIMUM", option="--elastic-minimum", commands=(DAEMON,),
    choices=("protected", "by-priority"))
ELASTIC_GUARANTEE: Setting[str] = Setting(
    "elastic_guarantee", "minimum", "What an elastic job keeps from pending rigid jobs of lower Slurm priority than "
    "its own: its minimum, or the GPUs it was submitted at (submitted), as a rigid job of that size would; what "
    "it holds above that is borrowed.", CONTROLLER, kind="choice", env="SLURM_ELASTIC_GUARANTEE",
    option="--elastic-guarantee", commands=(DAEMON,), choices=("minimum", "submitted"))
NODE_CONFIRM_S: Setting[float] = Setting(
    "node_confirm_s", 1.0, "Seconds to wait before reading a node's state again, before acting on a node "
    "that just went away.", CONTROLLER, kind="float", minimum=0)
RECENT_PLAN_S: Setting[float] = Setting(
    "recent_plan_s", 10.0, "Seconds for which the controller's own requeue explains a BeginTime reason.",
    CONTROLLER, kind="float", minimum=0)

# -- the site ---------------------------------------------------------------------------------------------
DAEMON_DIR: Setting[str] = Setting(
    "daemon_dir", "/var/lib/slurm-elastic", "The admin daemon's state (journal, lock, heartbeat); user-mode "
    "watches read the heartbeat here.", SITE, kind="path", env="SLURM_ELASTIC_DAEMON_DIR")
STATE_DIR: Setting[str | None] = Setting(
    "state_dir", None, "A user's own watch state (default $XDG_STATE_HOME/slurm-elastic, "
    "else ~/.local/state/slurm-elastic).", SITE, kind="path", env="SLURM_ELASTIC_STATE_DIR")
BACKEND: Setting[str | None] = Setting(
    "backend", None, "How to talk to Slurm: auto, cli or pyslurm (default auto).", SITE,
    env="SLURM_ELASTIC_BACKEND", option="--backend")
LOG: Setting[str | None] = Setting(
    "log", None, "Log level name (DEBUG, INFO, ...) over -v, for the CLI and the example job.", SITE,
    env="SLURM_ELASTIC_LOG")

# -- what a job is told ---------------------------------------------------------------------------------
CKPT_DIR: Setting[str | None] = Setting(
    "ckpt_dir", None, "The job's checkpoint root (its elastic spec's ckpt=), exported by the wrapper; at "
    "submit, the default for --ckpt-dir.", JOB,
    kind="path", env="SLURM_ELASTIC_CKPT_DIR")
JOB_KEY: Setting[str | None] = Setting(
    "job_key", None, "The job's directory name under the checkpoint root (default: the Slurm job id).", JOB,
    env="SLURM_ELASTIC_JOB_KEY")
BATCH: Setting[str | None] = Setting(
    "batch", None, "adaptive:MIN-MAX: the shim chooses the global batch by goodput (the spec's --batch).", JOB,
    env="SLURM_ELASTIC_BATCH")
PYTHON: Setting[str | None] = Setting(
    "python", None, "The interpreter the job templates run (the wrapper records its own).", JOB, kind="path",
    env="SLURM_ELASTIC_PYTHON")
HOME: Setting[str | None] = Setting(
    "home", None, "An installation the job templates take their interpreter from when no "
    "SLURM_ELASTIC_PYTHON is set (set by the module file).", JOB, kind="path", env="SLURM_ELASTIC_HOME",
    read_by="job_templates")
REQUEUE_WAIT_S: Setting[int] = Setting(
    "requeue_wait_s", 900, "Seconds a job template waits for the controller's requeue after a checkpoint.",
    JOB, kind="int", env="SLURM_ELASTIC_REQUEUE_WAIT_S", minimum=0, read_by="job_templates")
IN_PLACE_WAIT_S: Setting[int] = Setting(
    "in_place_wait_s", 120, "Seconds a job template whose ranks lost a node watches for Slurm shrinking the "
    "job in place (else it waits for the requeue).", JOB, kind="int", env="SLURM_ELASTIC_IN_PLACE_WAIT_S",
    minimum=0, read_by="job_templates")
KEEP_RANKS: Setting[int] = Setting(
    "keep_ranks", 1, "After a lost node the surviving ranks keep their processes and re-form the group at "
    "the new size (the job templates run the training command under slurm_elastic.train.regroup); 0: they "
    "exit and are relaunched.", JOB, kind="int", env="SLURM_ELASTIC_KEEP_RANKS", minimum=0, maximum=1,
    read_by="job_templates")
MIN_GPUS: Setting[int] = Setting(
    "min_gpus", 1, "The job's minimum GPU count (set by `slurm-elastic sbatch` from --gpus): its surviving ranks "
    "go on in their processes only when at least this many survive a lost node.", JOB, kind="int",
    env="SLURM_ELASTIC_MIN_GPUS", minimum=1)
GENERATION: Setting[int] = Setting(
    "generation", 0, "How many times this srun step's surviving ranks re-formed their group (set by "
    "slurm_elastic.train.regroup, not by users).", JOB, kind="int", env="SLURM_ELASTIC_GENERATION", minimum=0)
LIMIT_WARNING_S: Setting[int] = Setting(
    "limit_warning_s", 0, "Seconds before its time limit a job gets the checkpoint signal and then requeues "
    "itself (set by `slurm-elastic sbatch --signal-before`; 0: none).", JOB, kind="int",
    env="SLURM_ELASTIC_LIMIT_WARNING_S", minimum=0, maximum=65535, read_by="job_templates")
RUN_DEADLINE: Setting[int] = Setting(
    "run_deadline", 0, "Epoch seconds after which a job at its time limit commits but no longer requeues itself "
    "(set by `slurm-elastic sbatch --total-time`; 0: none).", JOB, kind="int", env="SLURM_ELASTIC_RUN_DEADLINE",
    minimum=0, read_by="job_templates")

# -- the local test cluster ---------------------------------------------------------------------------------
CLUSTER_DIR: Setting[str | None] = Setting(
    "cluster_dir", None, "The local cluster's state (default $XDG_STATE_HOME/slurm-elastic/cluster).",
    DEVCLUSTER, kind="path", env="SLURM_ELASTIC_CLUSTER_DIR")
PORT_SEARCH_START: Setting[int] = Setting(
    "port_search_start", 17817, "Where the search for free ports of a second cluster starts (test suites that "
    "run at once each get their own).", DEVCLUSTER, kind="int", env="SLURM_ELASTIC_PORT_SEARCH_START",
    minimum=1024, maximum=60000)

# -- test hooks ---------------------------------------------------------------------------------------------
CRASH_AFTER: Setting[str | None] = Setting(
    "crash_after", None, "SIGKILL the controller right after the named protocol step (open, signal, ack, "
    "hold, resize, release).", TEST, env="SLURM_ELASTIC_CRASH_AFTER")

SETTINGS: tuple[Setting[object], ...] = (
    INTERVAL, ACK_TIMEOUT, HYSTERESIS, RESTART_BUDGET, SIGNAL, METRICS_PORT, METRICS_ADDR, SPEED, OBJECTIVE,
    DRAIN_ON_PEER_LOSS, DRAIN_EXPIRY, RIGID_PARTITIONS, RIGID_YIELD_AFTER, ELASTIC_MINIMUM, ELASTIC_GUARANTEE,
    NODE_CONFIRM_S,
    RECENT_PLAN_S,
    DAEMON_DIR, STATE_DIR, BACKEND, LOG,
    CKPT_DIR, JOB_KEY, BATCH, PYTHON, HOME, REQUEUE_WAIT_S, IN_PLACE_WAIT_S, KEEP_RANKS, MIN_GPUS, GENERATION, LIMIT_WARNING_S, RUN_DEADLINE,
    CLUSTER_DIR, PORT_SEARCH_START,
    CRASH_AFTER,
)


def for_command(command: str) -> tuple[Setting[object], ...]:
    """The settings whose CLI option `command` (daemon, rebalance, watch) carries, in table order."""
    return tuple(s for s in SETTINGS if command in s.commands)


def controller_from_env(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """`sbatch --watch` has no room for controller flags: the settings every controller command carries,
    from their variables (else their defaults), keyed by name."""
    return {s.name: s.read(environ) for s in SETTINGS if s.commands == ALL_CONTROLLERS}


# -- paths with defaults that depend on the environment ------------------------------------------------------
def _state_home(environ: Mapping[str, str]) -> Path:
    xdg = environ.get("XDG_STATE_HOME")
    return Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"


def daemon_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The admin daemon's directory: $SLURM_ELASTIC_DAEMON_DIR, else /var/lib/slurm-elastic."""
    return Path(DAEMON_DIR.read(environ))


def user_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """A user's own watch state: $SLURM_ELASTIC_STATE_DIR, else $XDG_STATE_HOME/slurm-elastic."""
    environ = os.environ if environ is None else environ
    own = STATE_DIR.read(environ)
    return Path(own) if own else _state_home(environ) / "slurm-elastic"


def cluster_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The local cluster's state: $SLURM_ELASTIC_CLUSTER_DIR, else $XDG_STATE_HOME/slurm-elastic/cluster."""
    environ = os.environ if environ is None else environ
    own = CLUSTER_DIR.read(environ)
    return Path(own).expanduser() if own else _state_home(environ) / "slurm-elastic" / "cluster"
