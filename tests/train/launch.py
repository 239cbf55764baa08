"""Start N real ranks of a module locally with the variables srun would set (no Slurm needed)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(module: str, args: Sequence[str], *, world_size: int, job_id: str = "4242", restart_count: int = 0,
              timeout: float = 300, extra_env: dict[str, str] | None = None,
              nodes: Sequence[str] | None = None) -> list[subprocess.CompletedProcess]:
    """Run `python -m module args` as `world_size` ranks; returns each rank's result (rank order)."""
    procs = start_ranks(module, args, world_size=world_size, job_id=job_id, restart_count=restart_count,
                        extra_env=extra_env, nodes=nodes)
    return wait_ranks(procs, timeout=timeout)


def start_ranks(module: str, args: Sequence[str], *, world_size: int, job_id: str = "4242", restart_count: int = 0,
                extra_env: dict[str, str] | None = None, nodes: Sequence[str] | None = None) -> list[subprocess.Popen]:
    """`nodes[rank]` is the Slurm node name the rank believes it runs on (SLURMD_NODENAME)."""
    procs = []
    for env in rank_envs(world_size=world_size, job_id=job_id, restart_count=restart_count, extra_env=extra_env,
                         nodes=nodes):
        procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def rank_envs(*, world_size: int, job_id: str, restart_count: int = 0, extra_env: dict[str, str] | None = None,
              nodes: Sequence[str] | None = None) -> list[dict[str, str]]:
    """The environment of each rank as srun would set it, with a free MASTER_PORT."""
    port = free_port()
    envs = []
    for rank in range(world_size):
        env = dict(os.environ)
        for k in [k for k in env if k.startswith(("SLURM", "TORCHELASTIC", "RANK", "WORLD_SIZE", "MASTER_"))]:
            del env[k]
        env.update({
            "SLURM_JOB_ID": job_id, "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world_size),
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NNODES": "1",
            "SLURM_TASKS_PER_NODE": str(world_size), "SLURM_NODELIST": "localhost",
            "SLURM_RESTART_COUNT": str(restart_count), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        })
        if nodes is not None:
            env["SLURMD_NODENAME"] = nodes[rank]
        env.update(extra_env or {})
        envs.append(env)
    return envs


def wait_ranks(procs: list[subprocess.Popen], *, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    results = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            raise AssertionError(f"rank {rank} did not finish in {timeout} s:\n{out[-3000:]}") from None
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    return results
