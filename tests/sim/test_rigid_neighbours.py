"""Elastic jobs beside rigid ones in the simulator: rigid jobs are plain Slurm jobs and get borrowed GPUs back."""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from slurm_elastic.sim import SimConfig, Simulation, parse_cluster, summarize
from slurm_elastic.sim.controller import ControllerPolicy
from slurm_elastic.sim.engine import SimResult
from slurm_elastic.sim.jobs import SimJob
from tests.sim.conftest import job

WAIT_BOUND = 1.05   # the target: rigid jobs wait at most 5 % longer than with every job rigid


def run(jobs: list[SimJob], policy: ControllerPolicy, cluster: str) -> SimResult:
    try:
        return Simulation(jobs, policy, SimConfig(parse_cluster(cluster))).run()
    finally:
        policy.close()


def test_rigid_jobs_are_plain_slurm_jobs_with_their_run_time_as_time_limit():
    policy = ControllerPolicy()
    slurm = policy.slurm
    result = Simulation([job("e", 0, 2, 1000, lo=1, hi=4), job("r", 0, 6, 500, overhead=30.0)], policy,
                        SimConfig(parse_cluster("2x4"))).run()
    by_name = {j.name: j for j in slurm.jobs.values()}
    assert by_name["e"].spec is not None
    rigid = by_name["r"]
    assert rigid.spec is None and rigid.comment == ""
    assert (rigid.num_nodes, rigid.gpus_per_node) == (2, 3)
    assert rigid.time_limit_s == 500 + 30.0
    assert summarize(result)["rigid_jobs"] == 1 and summarize(result)["elastic_jobs"] == 1
    policy.close()


def test_an_elastic_job_that_borrowed_the_cluster_gives_gpus_back_when_a_rigid_job_arrives():
    jobs = [job("e", 0, 2, 20000, lo=1, hi=8), job("r", 1000, 4, 1000)]
    result = run(jobs, ControllerPolicy(max_scale=None), "2x4")
    sizes = [g for t, k, g in result.timeline if k == "e" and t < 1000]
    assert max(sizes) == 8                                  # it had grown into every GPU
    r = next(j for j in result.jobs if j.key == "r")
    assert r.wait_s is not None and r.wait_s <= 60         # not until the elastic job ends (~2500 s on)


def test_an_elastic_job_gives_a_rigid_job_a_whole_node_in_place_its_ranks_kept():
    """The templates keep the ranks by default: the shrink to the job's batch host is made without a requeue
    (Slurm's restart count stays 0) and costs the in-place stall, not a restart; without that word it requeues.
    The rigid job outlasts the elastic one, so no grow follows."""
    def scenario(keep_ranks: bool) -> tuple[SimResult, ControllerPolicy]:
        policy = ControllerPolicy(max_scale=None, keep_ranks=keep_ranks)
        result = Simulation([job("e", 0, 8, 20000, lo=4, hi=8, overhead=30.0), job("r", 1000, 4, 80000)], policy,
                            SimConfig(parse_cluster("2x4"))).run()
        return result, policy

    kept, policy = scenario(True)
    elastic = next(j for j in policy.slurm.jobs.values() if j.name == "e")
    policy.close()
    relaunched, policy = scenario(False)
    requeued = next(j for j in policy.slurm.jobs.values() if j.name == "e")
    policy.close()
    sizes = [(t, g) for t, k, g in kept.timeline if k == "e"]
    assert (8 in [g for _, g in sizes]) and (4 in [g for t, g in sizes if t >= 1000])   # 8 GPUs, then 4
    assert elastic.restarts == 0 and requeued.restarts >= 1
    r_kept = next(j for j in kept.jobs if j.key == "r")
    assert r_kept.wait_s is not None and r_kept.wait_s <= 60
    e_kept, e_relaunched = (next(j for j in res.jobs if j.key == "e") for res in (kept, relaunched))
    # every resize of the relaunched run pays the 30 s start; the shrink in place 3 s of it
    assert e_kept.finish_s < e_relaunched.finish_s
    assert e_kept.restart_loss_gpu_s < e_relaunched.restart_loss_gpu_s


def _mixed_workload() -> list[SimJob]:
    """24 jobs of 1-8 GPUs, Poisson arrivals, 3 in 10 elastic (1 .. 2x their request); fixed seed."""
    rng = random.Random(7)
    jobs, t = [], 0.0
    for i in range(24):
        t += rng.expovariate(1 / 300)
        gpus = rng.choice([1, 2, 2, 4, 4, 8])
        elastic = i % 10 in (2, 5, 8)
        jobs.append(job(f"{'e' if elastic else 'r'}{i}", round(t), gpus, rng.choice([600, 1200, 2400, 4800]),
                        lo=1 if elastic else None, hi=2 * gpus if elastic else None, overhead=30.0))
    return jobs


def test_rigid_jobs_wait_no_longer_beside_elastic_jobs_than_with_every_job_rigid():
    jobs = _mixed_workload()
    rigid_keys = {j.key for j in jobs if not j.elastic}
    every_rigid = [dataclasses.replace(j, min_gpus=j.requested_gpus, max_gpus=j.requested_gpus) for j in jobs]
    base = run(every_rigid, ControllerPolicy(), "4x4")     # the in-memory Slurm's priority + backfill alone
    mixed = run(jobs, ControllerPolicy(), "4x4")

    def waits(result: SimResult) -> list[float]:
        return [j.wait_s for j in result.jobs if j.key in rigid_keys]  # type: ignore[misc]

    assert not base.unfinished and not mixed.unfinished
    assert np.mean(waits(mixed)) <= WAIT_BOUND * np.mean(waits(base))
    assert np.percentile(waits(mixed), 95) <= WAIT_BOUND * np.percentile(waits(base), 95)
    assert summarize(mixed)["gpu_util"] > summarize(base)["gpu_util"]
    assert summarize(mixed)["restarts"] > 0                 # the elastic jobs did resize around the rigid ones
