"""Must-run commitments: their ranks, and the order in which the solver gives them up when they cannot all hold.

A must-run job carries the rank of the commitment behind it. When the
must-run jobs need more than the cluster has, commitments are given up
lowest rank first and never all at once: the newest commitment (a job
started or resized within the hysteresis) is given up last, a promise not
yet kept (a job starving in the queue) first.
"""

from __future__ import annotations

import enum
from typing import Sequence

import numpy as np


class Commitment(enum.IntEnum):
    """Why a job must run; a higher rank is given up later."""

    NONE = 0
    MUST_RUN = 1        # must_run without a stated reason
    STARVING = 2        # waited past the starvation limit without GPUs: a promise not yet kept
    SHARE_FLOOR = 3     # a running job held at its share floor
    NODE_LOST = 4       # was running until a node under it failed: comes back at once on what is left
    HELD = 5            # started or resized within the hysteresis, or its restart budget is spent


def rank(must_run: bool, commitment: int) -> int:
    """The effective rank of a job: 0 when it need not run."""
    if not must_run:
        return Commitment.NONE
    return max(int(commitment), Commitment.MUST_RUN)


def keep_order(ranks: Sequence[int], min_demand: np.ndarray, keys: Sequence[str]) -> list[int]:
    """Indices of the committed jobs, the one kept first at the head.

    Highest rank first; within a rank the smallest minimum demand first (so
    the fewest commitments are given up), then the key, so the order never
    depends on anything but the problem.
    """
    committed = [i for i, r in enumerate(ranks) if r > 0]
    size = [float(min_demand[i].sum()) for i in range(len(ranks))]
    return sorted(committed, key=lambda i: (-ranks[i], size[i], keys[i]))


def feasible_subset(ranks: Sequence[int], min_demand: np.ndarray, capacity: np.ndarray,
                    keys: Sequence[str]) -> tuple[list[int], list[int]]:
    """(kept, given up): a greedy pass in keep order over aggregate capacity.

    `min_demand[i]` is job i's resources at its smallest placeable count,
    `capacity` what the GPU nodes have in all. A job whose minimum no longer
    fits beside those kept before it gives its commitment up; a later,
    smaller one may still be kept.
    """
    used = np.zeros_like(capacity, dtype=float)
    kept: list[int] = []
    given_up: list[int] = []
    for i in keep_order(ranks, min_demand, keys):
        if np.all(used + min_demand[i] <= capacity + 1e-9):
            used += min_demand[i]
            kept.append(i)
        else:
            given_up.append(i)
    return kept, given_up
