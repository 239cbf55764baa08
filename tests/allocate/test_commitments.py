"""Must-run commitments given up in rank order, fewest first, never all at once."""

from __future__ import annotations

import numpy as np
import pytest

from slurm_elastic.allocate import AllocationProblem, JobRequest, NodeCapacity, solve
from slurm_elastic.allocate.commitments import Commitment, feasible_subset
from slurm_elastic.errors import AllocationError

NODES = (NodeCapacity("n0", 4, 32, 128_000), NodeCapacity("n1", 4, 32, 128_000))


def _held(key: str, node: str, gpus: int) -> JobRequest:
    """A job started or resized within the hysteresis, as the Reconciler pins it (count fixed, must run)."""
    return JobRequest(key, gpus, gpus, gpus, current={node: gpus}, restart_cost_s=30.0, must_run=True,
                      commitment=Commitment.HELD)


@pytest.mark.parametrize("mode", ["auto", "exact", "two-stage"])
def test_jobs_held_by_the_hysteresis_keep_their_gpus_when_must_runs_overflow(mode):
    # 4 + 4 GPUs held, and a starving job worth ten times either of them asks for 4 more: 12 must-run GPUs on 8
    jobs = (_held("h1", "n0", 4), _held("h2", "n1", 4),
            JobRequest("starving", 4, 4, weight=10.0, must_run=True, commitment=Commitment.STARVING))
    alloc = solve(AllocationProblem(jobs, NODES), mode=mode)
    assert alloc.placement["h1"] == {"n0": 4} and alloc.placement["h2"] == {"n1": 4}
    assert alloc.gpus["starving"] == 0
    assert any("must-run commitments given up" in n and "starving (starving)" in n for n in alloc.notes)


def test_only_as_many_commitments_are_given_up_as_the_cluster_needs():
    # floors of 2 GPUs on three running jobs and a held job of 4: 10 on 8, so one floor goes, not three
    jobs = (_held("h", "n0", 4),
            *(JobRequest(f"f{i}", 2, 4, current={"n1": 2} if i == 0 else {}, weight=0.1, must_run=True,
                         commitment=Commitment.SHARE_FLOOR) for i in range(3)))
    alloc = solve(AllocationProblem(jobs, NODES))
    assert alloc.placement["h"] == {"n0": 4}
    assert sorted(alloc.gpus[f"f{i}"] for i in range(3)) == [0, 2, 2]


def test_the_keep_order_is_rank_then_size_then_key():
    ranks = [Commitment.STARVING, Commitment.HELD, Commitment.SHARE_FLOOR, Commitment.SHARE_FLOOR, 0]
    demand = np.array([[1, 0, 0], [4, 0, 0], [3, 0, 0], [1, 0, 0], [1, 0, 0]], float)
    kept, given_up = feasible_subset(ranks, demand, np.array([6.0, 0, 0]), list("abcde"))
    # held (4) first, then the smaller floor (1), the larger floor (3) does not fit, the starving one (1) does
    assert kept == [1, 3, 0] and given_up == [2]


@pytest.mark.parametrize("bad", [-1, 6, True, 2.0, "held"])
def test_an_unknown_commitment_rank_is_refused(bad):
    with pytest.raises(AllocationError, match="commitment must be one of"):
        solve(AllocationProblem((JobRequest("a", 1, 4, must_run=True, commitment=bad),), NODES))
