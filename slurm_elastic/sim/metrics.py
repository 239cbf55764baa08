"""Summary figures of one simulation: JCTs, makespan, utilisation, throughput, restarts and their cost."""

from __future__ import annotations

import math

import numpy as np

from slurm_elastic.sim.engine import SimResult


def summarize(result: SimResult) -> dict[str, object]:
    """One row of the results table (units in key names)."""
    done = [j for j in result.jobs if j.finish_s is not None]
    jcts = np.array([j.jct_s for j in done], dtype=float)
    first_submit = min(j.submit_s for j in result.jobs)
    last_finish = max((j.finish_s for j in done), default=first_submit)
    makespan = last_finish - first_submit
    allocated, capacity = _integrate(result.utilisation, first_submit, last_finish)
    held = sum(j.gpu_s for j in result.jobs)
    loss = sum(j.restart_loss_gpu_s for j in result.jobs)
    solve = [d.solve_s for d in result.decisions if d.solve_s > 0]
    return {
        "policy": result.policy,
        "restart_method": result.restart_method,
        "jobs": len(result.jobs),
        "finished": len(done),
        "avg_jct_s": float(jcts.mean()) if len(jcts) else math.nan,
        "p99_jct_s": float(np.percentile(jcts, 99)) if len(jcts) else math.nan,
        "makespan_s": makespan,
        "gpu_util": allocated / capacity if capacity > 0 else 0.0,
        "jobs_per_hour": len(done) / (makespan / 3600.0) if makespan > 0 else 0.0,
        "restarts": sum(j.restarts for j in result.jobs),
        # only where a wall time was set (SimConfig.wall_time_s): the restarts that were time limits
        **({"time_limits": limits} if (limits := sum(j.time_limits for j in result.jobs)) else {}),
        "restart_loss_share": loss / held if held > 0 else 0.0,
        "node_failures": result.node_failures,
        "decision_points": len(result.decisions),
        "solve_s_total": float(sum(solve)),
        "solve_s_max": float(max(solve, default=0.0)),
        "wall_s": result.wall_s,
        **per_class(result),
    }


def per_class(result: SimResult) -> dict[str, object]:
    """Rigid jobs' wait and JCT beside elastic jobs' JCT (nan for a class with no finished job)."""
    rigid = [j for j in result.jobs if not j.elastic]
    elastic = [j for j in result.jobs if j.elastic]
    waits = np.array([j.wait_s for j in rigid if j.wait_s is not None], dtype=float)
    return {
        "rigid_jobs": len(rigid),
        "rigid_avg_wait_s": float(waits.mean()) if len(waits) else math.nan,
        "rigid_p95_wait_s": float(np.percentile(waits, 95)) if len(waits) else math.nan,
        "rigid_avg_jct_s": _mean_jct(rigid),
        "elastic_jobs": len(elastic),
        "elastic_avg_jct_s": _mean_jct(elastic),
    }


def _mean_jct(jobs: list) -> float:
    jcts = [j.jct_s for j in jobs if j.jct_s is not None]
    return float(np.mean(jcts)) if jcts else math.nan


def _integrate(samples: tuple[tuple[float, int, int], ...], start: float, end: float) -> tuple[float, float]:
    """GPU-seconds allocated and GPU-seconds of up capacity over [start, end] (samples are step functions)."""
    allocated = capacity = 0.0
    for (t0, a, c), (t1, _, _) in zip(samples, samples[1:] + ((math.inf, 0, 0),)):
        lo, hi = max(t0, start), min(t1, end)
        if hi > lo:
            allocated += a * (hi - lo)
            capacity += c * (hi - lo)
    return allocated, capacity

