"""The event core: conservation of GPU-seconds, restart costs, node failures and repairs."""

from __future__ import annotations

import random

import pytest

from slurm_elastic.errors import AllocationError, TraceError
from slurm_elastic.sim import (POLICIES, FailureSchedule, NodeEvent, RestartModel, SimConfig, Simulation,
                               make_policy, parse_cluster, parse_failures, summarize)
from slurm_elastic.sim.policy import Decision
from slurm_elastic.sim.tiresias import TiresiasPolicy

from tests.sim.conftest import job


def random_jobs(n: int, seed: int) -> list:
    rng = random.Random(seed)
    out = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(1 / 120)
        g = rng.choice([1, 1, 2, 4, 6, 8])
        out.append(job(f"j{i}", round(t, 1), g, rng.uniform(60, 3000), lo=1, hi=min(16, 2 * g),
                       overhead=None))
    return out


def allocated_from_timeline(result) -> list[tuple[float, int]]:
    """Total GPUs held after the changes at each instant, rebuilt from the per-job changes alone."""
    held: dict[str, int] = {}
    out: dict[float, int] = {}
    for t, key, g in result.timeline:
        held[key] = g
        out[t] = sum(held.values())
    return sorted(out.items())


def capacity_at(result, t: float) -> int:
    cap = result.utilisation[0][2]
    for ts, _, c in result.utilisation:
        if ts <= t:
            cap = c
    return cap


@pytest.mark.parametrize("policy", POLICIES)
def test_gpu_seconds_never_exceed_capacity(policy):
    jobs = random_jobs(30, seed=3)
    failures = FailureSchedule(every_s=1500, down_s=400, seed=5)
    result = Simulation(jobs, make_policy(policy), SimConfig(parse_cluster("2x4,1x8"), failures=failures)).run()
    assert not result.unfinished
    assert result.node_failures > 0
    # at every change, the GPUs held (rebuilt from the job timeline) fit in the GPUs up then
    for t, total in allocated_from_timeline(result):
        assert total <= capacity_at(result, t), f"{policy}: {total} GPUs held at t={t} over capacity"
    # and over the whole run, GPU-seconds held by jobs <= GPU-seconds of capacity
    row = summarize(result)
    assert 0 < row["gpu_util"] <= 1.0
    held = sum(r.gpu_s for r in result.jobs)
    cap = sum(c * (t1 - t0) for (t0, _, c), (t1, _, _) in zip(result.utilisation, result.utilisation[1:]))
    assert held <= cap + 1e-6


def test_first_start_pays_the_overhead_but_is_not_a_restart():
    result = Simulation([job("a", 0, 4, 100, overhead=None)], make_policy("static"),
                        SimConfig(parse_cluster("1x4"), restart=RestartModel(overhead_s=30))).run()
    rec = result.jobs[0]
    assert rec.finish_s == pytest.approx(130)
    assert rec.restarts == 0 and rec.restart_loss_gpu_s == 0


def test_node_failure_loses_work_since_the_last_checkpoint():
    # 1 node, checkpoint every 100 s of running; the node dies at t=250 (50 s after the checkpoint at 200)
    # for 50 s: the job redoes 50 s, restarts at 300 and needs 1000-200 = 800 more seconds.
    restart = RestartModel(overhead_s=0, checkpoint_interval_s=100)
    fail = FailureSchedule(events=(NodeEvent(250, "n000", 50),))
    result = Simulation([job("a", 0, 4, 1000)], make_policy("static"),
                        SimConfig(parse_cluster("1x4"), restart=restart, failures=fail)).run()
    rec = result.jobs[0]
    assert rec.finish_s == pytest.approx(1100)
    assert rec.restarts == 1
    assert rec.restart_loss_gpu_s == pytest.approx(50 * 4)
    assert result.node_failures == 1


def test_traditional_restart_stalls_on_checkpoints_and_signalled_stops():
    # Tiresias preempts a at t=50 (threshold 100 GPU-s); forward-layer: no work lost, no stall.
    # traditional: a's periodic checkpoints stall 10 s per 100 s running and its stop writes one (10 s).
    jobs = [job("a", 0, 4, 100), job("b", 50, 4, 20)]
    cfg = dict(nodes=parse_cluster("1x4"))
    fwd = Simulation(jobs, TiresiasPolicy(thresholds_gpu_s=(100.0,)),
                     SimConfig(**cfg, restart=RestartModel("forward-layer", 0, 100, 10))).run()
    trad = Simulation(jobs, TiresiasPolicy(thresholds_gpu_s=(100.0,)),
                      SimConfig(**cfg, restart=RestartModel("traditional", 0, 100, 10))).run()
    f = {r.key: r for r in fwd.jobs}
    t = {r.key: r for r in trad.jobs}
    assert f["a"].finish_s == pytest.approx(120)
    assert t["a"].finish_s > f["a"].finish_s + 10
    assert t["a"].restart_loss_gpu_s > f["a"].restart_loss_gpu_s


def test_policy_that_overcommits_a_node_is_refused():
    class Greedy:
        name = "greedy"

        def decide(self, view):
            return Decision({j.key: {"n000": 4} for j in view.jobs})

    with pytest.raises(AllocationError, match="over-committed node n000"):
        Simulation([job("a", 0, 4, 10), job("b", 0, 4, 10)], Greedy(), SimConfig(parse_cluster("1x4"))).run()


def test_scheduling_interval_and_immediate_resolve():
    # a job arriving at t=7 starts at t=7 (arrival wakes the scheduler), not at the next tick (60)
    result = Simulation([job("a", 7, 1, 10)], make_policy("static"), SimConfig(parse_cluster("1x4"))).run()
    assert result.jobs[0].start_s == 7
    assert result.decisions[0].reasons == ("arrival",)


def test_job_larger_than_the_cluster_is_an_error():
    with pytest.raises(TraceError, match="cannot run even on the empty cluster, e.g. a: 8 GPUs"):
        Simulation([job("a", 0, 8, 10)], make_policy("static"), SimConfig(parse_cluster("1x4")))
    # GPUs are there but not the CPUs each needs
    hungry = job("b", 0, 4, 10)
    from dataclasses import replace
    with pytest.raises(TraceError, match="cluster holds 2 such GPUs"):
        Simulation([replace(hungry, cpus_per_gpu=24)], make_policy("static"), SimConfig(parse_cluster("1x4:48")))


def test_cluster_and_failure_specs():
    nodes = parse_cluster("2x4,1x8:64:512")
    assert [n.gpus for n in nodes] == [4, 4, 8]
    assert nodes[2].cpus == 64 and nodes[2].mem_mb == 512 * 1024
    with pytest.raises(TraceError, match="bad cluster spec"):
        parse_cluster("16by4")
    sched = parse_failures("every:7200:600")
    events = sched.iterate(parse_cluster("4x4"))
    first, second = next(events), next(events)
    assert (first.time_s, second.time_s, first.down_s) == (7200, 14400, 600)
    with pytest.raises(TraceError, match="neither a spec"):
        parse_failures("sometimes")


def test_failure_file(tmp_path):
    path = tmp_path / "f.csv"
    path.write_text("time_s,node,down_s\n100,n001,60\n")
    sched = parse_failures(str(path))
    assert list(sched.iterate(parse_cluster("2x4"))) == [NodeEvent(100.0, "n001", 60.0)]
    with pytest.raises(TraceError, match="unknown node"):
        list(sched.iterate(parse_cluster("1x4")))
    path.write_text("time_s,node\n100,n001\n")
    with pytest.raises(TraceError, match="missing column"):
        parse_failures(str(path))


@pytest.mark.parametrize("method, stall", [("forward-layer", 0.0), ("traditional", 10.0)])
def test_a_time_limit_ends_each_incarnation_and_the_job_rides_through_at_the_restart_cost(method, stall):
    # 1,000 s of work at 4 GPUs, incarnations of at most 300 s, 20 s per (re)start: the job runs
    # 280 s of work per incarnation (4 of them: 280 x 3 + 160) and loses none of it at a limit.
    restart = RestartModel(method, overhead_s=20, checkpoint_interval_s=1e9, sync_checkpoint_s=stall)
    config = SimConfig(parse_cluster("1x4"), restart=restart, wall_time_s=300)
    result = Simulation([job("a", 0, 4, 1000, lo=1, hi=4, overhead=None)], make_policy("static"), config).run()
    rec = result.jobs[0]
    assert rec.time_limits == 3 and rec.restarts == 3
    # traditional: each limit's stop writes a synchronous checkpoint, paid before the next start
    per = 300 - 20 - stall
    assert rec.finish_s == pytest.approx(3 * 300 + 20 + stall + (1000 - 280 - 2 * per))
    assert summarize(result)["time_limits"] == 3
    # a rigid job's time limit is its run time (the trace's): it is not cut
    rigid = Simulation([job("r", 0, 4, 1000, overhead=None)], make_policy("static"), config).run().jobs[0]
    assert rigid.time_limits == 0 and rigid.restarts == 0


def test_without_a_wall_time_nothing_is_cut_and_the_summary_has_no_time_limits():
    result = Simulation([job("a", 0, 4, 1000, lo=1, hi=4, overhead=None)], make_policy("static"),
                        SimConfig(parse_cluster("1x4"), restart=RestartModel(overhead_s=20))).run()
    assert result.jobs[0].restarts == 0 and "time_limits" not in summarize(result)
    with pytest.raises(TraceError, match="wall time"):
        SimConfig(parse_cluster("1x4"), wall_time_s=0)


class _ShrinksAt:
    """A policy that runs job `a` on two nodes and says it shrank it in place to the first at `at` s."""

    name = "shrinks"

    def __init__(self, at: float) -> None:
        self.at = at

    def decide(self, view):
        if view.now < self.at:
            return Decision({"a": {"n000": 4, "n001": 4}})
        return Decision({"a": {"n000": 4}}, in_place=frozenset({"a"}))


@pytest.mark.parametrize("at, restarted", [(100.0, False), (10.0, True)])
def test_a_shrink_in_place_costs_its_stall_once_the_ranks_have_started(at, restarted):
    """Past its 30 s start, the shrink costs 3 s and no work; inside it the ranks have no group to go on in,
    so it costs a restart, and the start's stall is not cut short."""
    config = SimConfig(parse_cluster("2x4"), restart=RestartModel(overhead_s=30, in_place_s=3), interval_s=5)
    result = Simulation([job("a", 0, 8, 1000, lo=4, hi=8, overhead=None)], _ShrinksAt(at), config).run()
    a = result.jobs[0]
    assert a.restarts == 1
    if restarted:       # the 30 s start begins again at 4 GPUs, nothing done at 8
        assert a.finish_s == pytest.approx(at + 30 + 8000 / 4)
        assert a.restart_loss_gpu_s == pytest.approx(30 * 4)
    else:               # 70 s at 8 GPUs done, then 3 s at 4 GPUs and the rest
        assert a.finish_s == pytest.approx(at + 3 + (8000 - 70 * 8) / 4)
        assert a.restart_loss_gpu_s == pytest.approx(3 * 4)
