"""Where a test's private Slurm cluster looks for free ports on 127.0.0.1.

Each xdist worker owns WORKER_WINDOW ports from its own search start (tests/conftest.py); inside that
window each kind of cluster searches from its own offset, so two searches that can run at once (two
workers, or a worker's shared cluster and a test's private one) never walk onto the same ports. A search
walks past a few clusters of its own kind at most, far less than the gap to the next offset. The host's
four workers end below 21000, where .ci/other-slurms starts the next Slurm version's suite.
"""
from __future__ import annotations

from slurm_elastic.devcluster import processes

WORKER_WINDOW = 700
SHARED = 0          # the worker's shared cluster, and tests that start one beside it
CONTROLLER = 200    # tests/control's clusters with the job_submit plugin
LIFECYCLE = 400     # tests/devcluster's up/down cycles


def free_port_base(count: int, offset: int = SHARED) -> int:
    """A base with `count` free ports after it, searched from this worker's start plus offset."""
    return processes.free_port_base(count, start=processes.port_search_start() + offset)
