"""Where the ranks of one srun step meet: rank 0's TCP store on a kernel-picked port, published in the job dir."""

from __future__ import annotations

import datetime
import logging
import time

import torch.distributed as dist

from slurm_elastic.errors import ElasticError
from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.environment import JobEnvironment, node_address
from slurm_elastic.train.peers import RunDirectory

log = logging.getLogger(__name__)


def connect(env: JobEnvironment, run: RunDirectory, *, timeout_s: float) -> dist.Store | None:
    """The store `init_process_group` starts from, or None when the launcher named a port
    (MASTER_PORT, torchrun's agent): then `env.init_method` is the way in.

    Rank 0 binds port 0, so the kernel gives it a port nothing else holds at that moment
    and the store keeps it: there is no window in which another job can take it. The
    address and port go to `rendezvous.json` in this step's run directory, whose name
    carries job id, restart count and step id, so a rank never reads another
    incarnation's port.
    """
    if env.launcher != "slurm" or env.master_port:
        return None
    timeout = datetime.timedelta(seconds=timeout_s)
    if env.rank == 0:
        # Rank 0 sits on the step's first node; under another task distribution it may not.
        addr = env.master_addr if env.node_rank == 0 else (node_address(env.node_name) or env.master_addr)
        store = dist.TCPStore(addr, 0, env.world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        run.publish(protocol.RENDEZVOUS_FILE, {"addr": addr, "port": store.port, "world_size": env.world_size})
        log.info("rendezvous: rank 0 listens on %s:%d (%s)", addr, store.port, run.path)
        return store
    end = time.monotonic() + timeout_s
    while True:
        try:
            body = run.read(protocol.RENDEZVOUS_FILE)
        except (OSError, ValueError):
            body = None    # a directory of a shared filesystem not visible here yet
        if body is not None:
            break
        if time.monotonic() >= end:
            raise ElasticError(f"rank {env.rank}: rank 0 published no rendezvous in {run.path} within "
                               f"{timeout_s:g} s (is the checkpoint directory shared by all nodes?)")
        time.sleep(0.05)
    if body.get("world_size") != env.world_size:
        raise ElasticError(f"rendezvous in {run.path} is for {body.get('world_size')} ranks, this step has "
                           f"{env.world_size}")
    return dist.TCPStore(str(body["addr"]), int(body["port"]), env.world_size, is_master=False, timeout=timeout)
