"""The shape of a local cluster (nodes, ports, resources) and where its files live."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from slurm_elastic import settings
from slurm_elastic.errors import ClusterSetupError

CLUSTER_DIR_ENV = settings.CLUSTER_DIR.env
# slurmctld listens on port_base; node i (1-based) on port_base + 3 + i, so the
# defaults are Slurm's own (6817 for slurmctld, n1 on 6821).
DEFAULT_PORT_BASE = 6817
_NODE_PORT_OFFSET = 3
# A unix socket path is limited to 108 bytes (sun_path).
_MAX_SOCKET_PATH = 107
# slurmstepd's socket in a node's spool: <node>_<job id>.<step id>. Job ids up to Slurm's default MaxJobId
# (67043328), the batch step's id is 4294967291: a longer path and every batch job fails to launch
# ("launch failed requeued held"), which nothing at `up` would show.
_LONGEST_STEP_SOCKET = "_67043328.4294967291"
_RUNTIME_ROOT = Path("/run/slurm-elastic")
# slurm.conf cannot quote: a blank splits a value, '#' starts a comment, '%' is expanded
# (SlurmdSpoolDir=.../%n), ',' and '=' separate AuthInfo's fields. A state directory outside
# this set would be written into slurm.conf and kill slurmctld at start, so it is refused.
_SAFE_PATH = re.compile(r"/[A-Za-z0-9._/+@-]*")
# Slurm's SlurmdTimeout default is 300 s; 10 s makes a killed node DOWN within 13-30 s on this
# loopback cluster, which is what `node-down` and the demo show. Under heavy load a healthy
# slurmd can miss 10 s, so tests that kill no node ask for a long one.
DEFAULT_SLURMD_TIMEOUT_S = 10
MAX_SLURMD_TIMEOUT_S = 65533
# Slurm preemption (`up --preempt-mode`): jobs of PREEMPT_PARTITION (a higher PriorityTier over the
# same nodes) preempt the default partition's, which get `grace_time_s` (GraceTime) to leave.
PREEMPT_MODES = ("", "REQUEUE", "CANCEL")
PREEMPT_PARTITION = "urgent"
DEFAULT_GRACE_TIME_S = 60
MAX_GRACE_TIME_S = 65533


def default_state_dir() -> Path:
    """Where the local cluster's files live (settings.cluster_dir)."""
    return settings.cluster_dir()


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One node as slurm.conf declares it; a spare is configured but not started by `up`."""

    name: str
    port: int
    gpus: int
    cpus: int
    memory_mb: int
    spare: bool


@dataclass(frozen=True, slots=True)
class ClusterLayout:
    """Everything `up` decides once and later commands must agree on (saved as cluster.json)."""

    state_dir: Path
    slurm_version: str
    nodes: int = 4
    spares: int = 2
    gpus_per_node: int = 4
    cpus_per_node: int = 8
    memory_mb: int = 16000
    port_base: int = DEFAULT_PORT_BASE
    partition: str = "gpu"
    cluster_name: str = "elastic-local"
    job_submit_lua: bool = False
    node_prefix: str = "n"
    slurmd_timeout: int = DEFAULT_SLURMD_TIMEOUT_S
    expedited_requeue: bool = False   # SlurmctldParameters=enable_expedited_requeue (Slurm 25.11 on)
    preempt_mode: str = ""            # "": no preemption; REQUEUE or CANCEL (PREEMPT_PARTITION preempts)
    grace_time_s: int = DEFAULT_GRACE_TIME_S

    @property
    def preemption(self) -> bool:
        return bool(self.preempt_mode)

    def __post_init__(self) -> None:
        _check_types(self)
        problems = []
        check_state_dir(self.state_dir)
        if not 1 <= self.slurmd_timeout <= MAX_SLURMD_TIMEOUT_S:
            problems.append(f"--slurmd-timeout must be between 1 and {MAX_SLURMD_TIMEOUT_S} s "
                            f"(got {self.slurmd_timeout})")
        if self.preempt_mode not in PREEMPT_MODES:
            problems.append(f"--preempt-mode must be REQUEUE or CANCEL (got {self.preempt_mode!r})")
        if not 0 <= self.grace_time_s <= MAX_GRACE_TIME_S:
            problems.append(f"--grace-time must be between 0 and {MAX_GRACE_TIME_S} s (got {self.grace_time_s})")
        if self.preempt_mode and self.partition == PREEMPT_PARTITION:
            problems.append(f"the partition cannot be named {PREEMPT_PARTITION!r} with preemption (that is the preemptor's)")
        if self.nodes < 1:
            problems.append(f"--nodes must be at least 1 (got {self.nodes})")
        if self.spares < 0:
            problems.append(f"--spares must be 0 or more (got {self.spares})")
        if self.gpus_per_node < 0 or self.gpus_per_node > 64:
            problems.append(f"--gpus must be between 0 and 64 (got {self.gpus_per_node})")
        if self.cpus_per_node < 1:
            problems.append(f"--cpus must be at least 1 (got {self.cpus_per_node})")
        if self.memory_mb < 100:
            problems.append(f"--mem-mb must be at least 100 (got {self.memory_mb})")
        last_port = self.port_base + _NODE_PORT_OFFSET + self.nodes + self.spares
        if self.port_base < 1024 or last_port > 65535:
            problems.append(f"--port-base {self.port_base} puts ports outside 1024-65535 (last would be {last_port})")
        if len(str(self.munge_socket)) > _MAX_SOCKET_PATH:
            problems.append(f"--state-dir is too long for a unix socket path ({self.munge_socket})")
        if problems:
            raise ClusterSetupError("; ".join(problems))

    # -- nodes and ports -------------------------------------------------
    @property
    def ctld_port(self) -> int:
        return self.port_base

    @property
    def node_specs(self) -> tuple[NodeSpec, ...]:
        return tuple(
            NodeSpec(
                name=f"{self.node_prefix}{i}",
                port=self.port_base + _NODE_PORT_OFFSET + i,
                gpus=self.gpus_per_node,
                cpus=self.cpus_per_node,
                memory_mb=self.memory_mb,
                spare=i > self.nodes,
            )
            for i in range(1, self.nodes + self.spares + 1)
        )

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.node_specs)

    @property
    def spare_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.node_specs if spec.spare)

    def node(self, name: str) -> NodeSpec:
        for spec in self.node_specs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    @property
    def all_ports(self) -> tuple[int, ...]:
        return (self.ctld_port, *(spec.port for spec in self.node_specs))

    # -- files -------------------------------------------------------------
    @property
    def etc_dir(self) -> Path:
        return self.state_dir / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc_dir / "slurm.conf"

    @property
    def gres_conf(self) -> Path:
        return self.etc_dir / "gres.conf"

    @property
    def cgroup_conf(self) -> Path:
        return self.etc_dir / "cgroup.conf"

    @property
    def job_submit_lua_path(self) -> Path:
        # Slurm's lua plugin reads job_submit.lua from the directory of slurm.conf.
        return self.etc_dir / "job_submit.lua"

    @property
    def dev_dir(self) -> Path:
        return self.state_dir / "dev"

    def gpu_files(self, node: str) -> tuple[Path, ...]:
        return tuple(self.dev_dir / f"{node}gpu{i}" for i in range(self.gpus_per_node))

    @property
    def munge_dir(self) -> Path:
        return self.state_dir / "munge"

    @property
    def runtime_dir(self) -> Path:
        """Where munged's socket lives: outside the state directory, in /run.

        munged refuses a socket whose every parent directory is not
        executable by all (a state directory under /root is not), and a unix
        socket path must stay under 108 bytes; a short per-cluster directory in
        /run satisfies both.
        """
        digest = hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:12]
        return _RUNTIME_ROOT / digest

    @property
    def munge_socket(self) -> Path:
        return self.runtime_dir / "munge.socket"

    @property
    def munge_key(self) -> Path:
        return self.munge_dir / "munge.key"

    @property
    def munge_pid(self) -> Path:
        return self.munge_dir / "munged.pid"

    @property
    def munge_log(self) -> Path:
        return self.log_dir / "munged.log"

    @property
    def munge_seed(self) -> Path:
        return self.munge_dir / "munged.seed"

    @property
    def run_dir(self) -> Path:
        return self.state_dir / "run"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "log"

    @property
    def ctld_state_dir(self) -> Path:
        return self.state_dir / "ctld"

    @property
    def ctld_pid(self) -> Path:
        return self.run_dir / "slurmctld.pid"

    @property
    def ctld_log(self) -> Path:
        return self.log_dir / "slurmctld.log"

    @property
    def spool_root(self) -> Path:
        return self.state_dir / "spool"

    def slurmd_pid(self, node: str) -> Path:
        return self.run_dir / f"slurmd-{node}.pid"

    def slurmd_log(self, node: str) -> Path:
        return self.log_dir / f"slurmd-{node}.log"

    def slurmd_spool(self, node: str) -> Path:
        return self.spool_root / node

    @property
    def longest_step_socket(self) -> Path:
        """The longest path slurmstepd may give a step's unix socket in a node's spool."""
        node = max((spec.name for spec in self.node_specs), key=len)
        return self.slurmd_spool(node) / f"{node}{_LONGEST_STEP_SOCKET}"

    def check_step_sockets(self) -> None:
        """Refuse a state directory too long for slurmstepd's sockets, before `up` writes anything.

        Checked at `up` only: a cluster already in such a directory must still load, show and go down.
        """
        step_socket = self.longest_step_socket
        if len(str(step_socket)) > _MAX_SOCKET_PATH:
            raise ClusterSetupError(
                f"--state-dir {self.state_dir} is too long: slurmstepd's socket {step_socket} would be "
                f"{len(str(step_socket))} bytes (at most {_MAX_SOCKET_PATH}), and every batch job would fail to "
                f"launch; choose a shorter directory")

    @property
    def env_file(self) -> Path:
        return self.state_dir / "env"

    @property
    def layout_file(self) -> Path:
        return self.state_dir / "cluster.json"

    # -- persistence -----------------------------------------------------
    def to_json(self) -> str:
        data = asdict(self)
        data["state_dir"] = str(self.state_dir)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def load(cls, state_dir: Path) -> ClusterLayout:
        """The layout `up` saved; a missing, garbled or foreign cluster.json is one ClusterSetupError."""
        path = Path(state_dir) / "cluster.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ClusterSetupError(
                f"no local cluster in {state_dir} (no cluster.json); start one with `slurm-elastic cluster up`"
            ) from None
        except PermissionError:
            raise ClusterSetupError(f"cannot read {path}: permission denied (the local cluster is root's)") from None
        except (OSError, ValueError) as exc:
            raise ClusterSetupError(f"cannot read {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ClusterSetupError(f"{path} is not a cluster layout (expected a JSON object); "
                                    "run `slurm-elastic cluster up` again")
        missing = [key for key in _REQUIRED_KEYS if key not in data]
        if missing:
            raise ClusterSetupError(f"{path} lacks {', '.join(missing)}; run `slurm-elastic cluster up` again")
        if not isinstance(data["state_dir"], str) or Path(data["state_dir"]) != Path(state_dir):
            raise ClusterSetupError(f"{path} belongs to another state directory ({data['state_dir']!r}); "
                                    "run `slurm-elastic cluster up` again")
        data["state_dir"] = Path(data["state_dir"])
        known = set(cls.__dataclass_fields__)
        try:
            return cls(**{key: value for key, value in data.items() if key in known})
        except ClusterSetupError as exc:
            raise ClusterSetupError(f"{path}: {exc}") from None


_REQUIRED_KEYS = ("state_dir", "slurm_version", "nodes", "spares", "gpus_per_node", "cpus_per_node", "memory_mb",
                  "port_base")


def _check_types(layout: ClusterLayout) -> None:
    """A layout read back from cluster.json is input: every field must have its type before any arithmetic."""
    for name, kind in (("slurm_version", str), ("partition", str), ("cluster_name", str), ("node_prefix", str),
                       ("preempt_mode", str)):
        if not isinstance(getattr(layout, name), kind):
            raise ClusterSetupError(f"{name} must be text, got {getattr(layout, name)!r}")
    for name in ("nodes", "spares", "gpus_per_node", "cpus_per_node", "memory_mb", "port_base", "slurmd_timeout",
                 "grace_time_s"):
        value = getattr(layout, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ClusterSetupError(f"{name} must be a whole number, got {value!r}")
    for name in ("job_submit_lua", "expedited_requeue"):
        if not isinstance(getattr(layout, name), bool):
            raise ClusterSetupError(f"{name} must be true or false, got {getattr(layout, name)!r}")
    for name in ("partition", "cluster_name", "node_prefix"):
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,39}", getattr(layout, name)):
            raise ClusterSetupError(f"{name} {getattr(layout, name)!r} is not a plain Slurm name")


class UnusableStateDir(ClusterSetupError):
    """A state directory the user chose that slurm.conf cannot hold (bad input)."""


def check_state_dir(state_dir: Path) -> None:
    """Refuse a state directory that slurm.conf cannot hold (see _SAFE_PATH), before anything is created."""
    text = str(state_dir)
    if not _SAFE_PATH.fullmatch(text):
        bad = sorted({ch for ch in text if not re.fullmatch(r"[A-Za-z0-9._/+@-]", ch)})
        shown = " ".join(repr(ch) for ch in bad) or "a relative path"
        raise UnusableStateDir(f"state directory {text!r} cannot be written into slurm.conf ({shown}); "
                                "choose a path of letters, digits and ._/+@- only")
