"""Two runs of the same workload give the same per-job results, whatever else the machine is doing."""

from __future__ import annotations

import subprocess
import sys

from slurm_elastic.sim import SimConfig, Simulation, parse_cluster
from slurm_elastic.sim.controller import SIM_CONFIG, ControllerPolicy
from slurm_elastic.sim.pollux import load_workload
from slurm_elastic.sim.registry import make_policy


def _run(pollux, objective: str | None = None) -> dict[str, tuple[float | None, int]]:
    jobs = load_workload(pollux / "workloads" / "workload-1.csv")[:12]
    policy = ControllerPolicy() if objective is None else make_policy("controller", objective=objective)
    try:
        result = Simulation(jobs, policy, SimConfig(parse_cluster("8x4"), immediate=False)).run()
    finally:
        policy.close()
    return {r.key: (r.jct_s, r.restarts) for r in result.jobs}


def test_the_simulated_controller_stops_its_solver_on_work_not_wall_time():
    policy = SIM_CONFIG.policy
    assert policy.time_limit_s is None and policy.max_nodes is not None and policy.threads == 1


def test_two_runs_give_identical_jcts_with_the_other_core_busy(pollux):
    quiet = _run(pollux)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        loaded = _run(pollux)
    finally:
        spinner.kill()
        spinner.wait()
    assert all(jct is not None for jct, _ in quiet.values())
    assert loaded == quiet


def test_the_progress_objective_is_repeatable_and_is_what_the_controller_runs(pollux):
    from slurm_elastic.control.requests import ProgressRequests

    policy = make_policy("controller", objective="progress")
    try:
        assert isinstance(policy.reconciler.requests, ProgressRequests)
        assert policy.reconciler.config.policy.objective == "progress"
    finally:
        policy.close()
    first = _run(pollux, "progress")
    assert all(jct is not None for jct, _ in first.values())
    assert _run(pollux, "progress") == first
