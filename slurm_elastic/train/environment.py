"""Where this process sits in the job: rank, world size, master address and port, read once from Slurm or torchrun."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from slurm_elastic import settings
from slurm_elastic.errors import ElasticError

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class JobEnvironment:
    """One process's coordinates; every Slurm/torchrun variable is read in `from_env` and nowhere else."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: str
    job_name: str
    restart_count: int
    launcher: str                      # "slurm", "torchrun" or "single"
    node_name: str = ""                # the Slurm node name (not always the host name)
    step_id: int = 0                   # the srun step: ranks relaunched inside one job get a new one
    generation: int = 0                # times this step's surviving ranks re-formed their group (train/regroup.py)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobEnvironment:
        env = os.environ if env is None else env
        # torchrun sets its own rank variables (and TORCHELASTIC_RUN_ID); they win
        # because under torchrun SLURM_PROCID describes the launcher, not the worker.
        if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and "SLURM_PROCID" not in env):
            return cls._from_torchrun(env)
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            return cls._from_slurm(env)
        return cls(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1,
                   master_addr="127.0.0.1", master_port=_free_port(), job_id=env.get("SLURM_JOB_ID", "local"),
                   job_name=env.get("SLURM_JOB_NAME", "local"),
                   restart_count=_int(env, "SLURM_RESTART_COUNT", 0), launcher="single",
                   node_name=_node_name(env), step_id=_int(env, "SLURM_STEP_ID", 0))

    @classmethod
    def _from_slurm(cls, env: Mapping[str, str]) -> JobEnvironment:
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0"
        restart = _int(env, "SLURM_RESTART_COUNT", 0)
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        master = env.get("MASTER_ADDR") or node_address(first_hostname(nodelist)) or "127.0.0.1"
        # Without MASTER_PORT, rank 0 takes a port from the kernel and publishes it in the
        # job directory (train/rendezvous.py): a port computed from the job id collides
        # between two clusters on one host, and with anything else that holds it.
        port = _int(env, "MASTER_PORT", 0)
        return cls(
            rank=_int(env, "SLURM_PROCID", 0),
            world_size=_int(env, "SLURM_NTASKS", 1),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            local_world_size=_tasks_on_this_node(env),
            node_rank=_int(env, "SLURM_NODEID", 0),
            num_nodes=_int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_NNODES", _int(env, "SLURM_JOB_NUM_NODES", 1))),
            master_addr=master,
            master_port=port,
            job_id=job_id,
            job_name=env.get("SLURM_JOB_NAME", ""),
            restart_count=restart,
            launcher="slurm",
            node_name=_node_name(env),
            step_id=_int(env, "SLURM_STEP_ID", 0),
            generation=settings.GENERATION.read(env),
        )

    @classmethod
    def _from_torchrun(cls, env: Mapping[str, str]) -> JobEnvironment:
        world = _int(env, "WORLD_SIZE", 1)
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        return cls(
            rank=_int(env, "RANK", 0),
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=local_world,
            node_rank=_int(env, "GROUP_RANK", 0),
            num_nodes=max(1, world // max(1, local_world)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", 29500),
            job_id=env.get("SLURM_JOB_ID", env.get("TORCHELASTIC_RUN_ID", "local")),
            job_name=env.get("SLURM_JOB_NAME", ""),
            restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
            launcher="torchrun",
            node_name=_node_name(env),
            step_id=_int(env, "SLURM_STEP_ID", 0),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def init_method(self) -> str:
        # Under torchrun the agent already hosts the rendezvous store at MASTER_PORT;
        # env:// reuses it (TORCHELASTIC_USE_AGENT_STORE) instead of binding the port again.
        if self.launcher == "torchrun":
            return "env://"
        if not self.master_port:
            raise ElasticError("no MASTER_PORT: rank 0 publishes its port in the job directory "
                               "(slurm_elastic.train.rendezvous.connect), there is no init method URL")
        return f"tcp://{self.master_addr}:{self.master_port}"


def export_torch_env(env: JobEnvironment) -> None:
    """Set torchrun's variables under srun too: a torchrun-ready script reads os.environ["LOCAL_RANK"], and
    one that decides whether it runs distributed from RANK (nanoGPT) must find it, or each rank trains
    a model of its own."""
    if env.launcher != "slurm":
        return
    os.environ.update({"RANK": str(env.rank), "WORLD_SIZE": str(env.world_size), "LOCAL_RANK": str(env.local_rank),
                       "LOCAL_WORLD_SIZE": str(env.local_world_size), "GROUP_RANK": str(env.node_rank),
                       "MASTER_ADDR": env.master_addr})
    if env.master_port:     # else the ranks met through the job directory's rendezvous, on a port of its own
        os.environ["MASTER_PORT"] = str(env.master_port)


def group_backend(requested: str | None, *, cuda: bool) -> str:
    """The backend the ranks' process group is formed with: the one asked for (default NCCL on GPUs, gloo
    without), always with a CPU backend in it. The session's own collectives (its per-step agreement, the
    checkpoint's commit) are small CPU tensors, and a group formed as plain "nccl" has no backend for the
    CPU: each would fail ("No backend type associated with device type cpu"). Gloo carries them beside
    NCCL's GPU collectives."""
    import torch.distributed as dist

    if requested is None:
        requested = "nccl" if cuda else "gloo"
    if ":" in requested:                  # device-qualified already ("cuda:nccl"), perhaps without the CPU
        return requested if "cpu:" in requested else f"cpu:gloo,{requested}"
    devices = dist.Backend.backend_capability.get(requested.lower(), ["cpu"])
    if "cpu" in devices:
        return requested
    return ",".join(["cpu:gloo", *(f"{device}:{requested.lower()}" for device in devices)])


def first_hostname(nodelist: str) -> str | None:
    """The first host of a Slurm node list ('n[1-3],m1' -> 'n1'), via `scontrol show hostnames`."""
    if not nodelist:
        return None
    if not any(ch in nodelist for ch in "[,"):
        return nodelist
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ElasticError(f"cannot expand the node list {nodelist!r} with 'scontrol show hostnames': {exc}; "
                           f"set MASTER_ADDR to the first node's name") from exc
    hosts = out.split()
    return hosts[0] if hosts else None


def node_address(node: str | None) -> str | None:
    """An address for a Slurm node name: the name itself when it resolves, else Slurm's NodeAddr
    (node names need not be host names, e.g. several slurmd on one host)."""
    if not node:
        return None
    try:
        socket.getaddrinfo(node, None)
        return node
    except OSError:
        pass
    try:
        out = subprocess.run(["scontrol", "-o", "show", "node", node], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ElasticError(f"node {node!r} does not resolve and 'scontrol show node' failed ({exc}); "
                           f"set MASTER_ADDR") from exc
    for field in out.split():
        if field.startswith("NodeAddr="):
            return field.removeprefix("NodeAddr=")
    raise ElasticError(f"node {node!r} does not resolve and Slurm reports no NodeAddr for it; set MASTER_ADDR")


def _node_name(env: Mapping[str, str]) -> str:
    # Several slurmd may share a host (the local cluster, some test setups): the
    # controller acts on Slurm's node name, which only SLURMD_NODENAME gives.
    return env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _tasks_on_this_node(env: Mapping[str, str]) -> int:
    # SLURM_TASKS_PER_NODE looks like "2(x3),1"; the node's own count is SLURM_STEP_TASKS_PER_NODE
    # only for uniform steps, so use the node id to index the expanded list.
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        if "(x" in part:
            n, rep = part.rstrip(")").split("(x")
            counts.extend([int(n)] * int(rep))
        elif part.isdigit():
            counts.append(int(part))
    node = _int(env, "SLURM_NODEID", 0)
    return counts[node] if node < len(counts) else 1


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "")
    try:
        return int(value) if value != "" else default
    except ValueError:
        raise ElasticError(f"environment variable {name}={value!r} is not a whole number") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
