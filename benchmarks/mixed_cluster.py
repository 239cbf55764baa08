"""Elastic jobs beside rigid ones: the same trace all rigid under FIFO+backfill, and mixed under the controller.

For each Pollux workload (16 nodes x 4 GPUs, 60 s ticks, 30 s per start)
this takes every job in submission order and keeps `--rigid-share` of them
rigid (at their trace size; the rest elastic, 1 .. 2x their request as the
simulator's default), then runs, in one go:

- `all-rigid`: every job rigid under the simulator's FIFO+EASY backfill
  (sim/static.py, run times known exactly: the best case for backfill);
- `all-rigid-slurm`: every job rigid under the controller, i.e. the
  in-memory Slurm's own priority + backfill scheduler (a check that it
  matches the baseline);
- `mixed`: the rigid jobs as plain Slurm jobs, the others elastic (1 .. 2x
  their request), under the shipped controller (pending rigid jobs take back
  what elastic jobs borrowed: every GPU above an elastic job's minimum);
- `mixed-guarantee`: the same as `mixed` with the daemon's
  `--elastic-guarantee submitted`: an elastic job keeps the GPUs it was
  submitted at (here its request) from rigid jobs of lower priority, as a
  rigid job of that size would; only what it holds above that is borrowed;
- `mixed-requeue-only`: the same as `mixed` with every resize a requeue
  (scripts run without the templates' runner, which keeps the ranks where
  a job gives up whole nodes);
- `mixed-min-request`: the same, the elastic jobs declaring their request as
  their minimum (request .. 2x): what a user who ran rigid at that size keeps
  when going elastic. The two are the ends of the range a user chooses from.

It prints one row per run with the figures of the jobs that are rigid in
the mixed run (their mean and p95 wait and mean JCT) and of the others
(their mean JCT), GPU utilisation and restarts, then the issue's targets:

    .venv/bin/python benchmarks/mixed_cluster.py [--workloads 1 2 3 4] [--rigid-share 0.7] [--perturb K] [--json]

One run of a workload is one draw: the controller's decisions feed back
into the queue, so a change of 0.1 s in the restart overhead moves the
elastic class's mean JCT by up to 5 % and the GPU utilisation (its makespan
tail) by up to 8 points. `--perturb K` also runs every configuration with
the restart overhead 30 +- 0.1 s x 1..K; each row is then the mean of the
2K+1 runs (`*_min`, `*_max` beside the headline figures), and a target is
met when it holds on the mean (`met_every_run` says whether on each).

Not a test: it reports what it measures.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from slurm_elastic.sim import SimConfig, Simulation, parse_cluster, summarize
from slurm_elastic.allocate.from_state import RigidPolicy
from slurm_elastic.sim.controller import SIM_CONFIG, ControllerPolicy
from slurm_elastic.sim.engine import RestartModel, SimResult
from slurm_elastic.sim.jobs import SimJob
from slurm_elastic.sim.pollux import load_workload
from slurm_elastic.sim.static import StaticPolicy
from simulate_targets import MAX_PERTURB, overheads   # the same draws as the targets
from table import print_rows  # benchmarks/table.py: how every benchmark prints

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "pollux"
WAIT_BOUND = 1.05   # the target: rigid jobs wait at most 5 % longer than with every job rigid
GUARANTEE_CONFIG = dataclasses.replace(SIM_CONFIG, rigid=RigidPolicy(guarantee="submitted"))


def mixed_workload(jobs: list[SimJob], rigid_share: float, min_request: bool = False) -> list[SimJob]:
    """`rigid_share` of the jobs rigid: those with one size already, then evenly spread over the others;
    with `min_request` the elastic ones declare their request as their minimum."""
    fixed = sum(not j.elastic for j in jobs)
    flexible = len(jobs) - fixed
    share = min(max((rigid_share * len(jobs) - fixed) / flexible, 0.0), 1.0) if flexible else 0.0
    out = []
    rank = 0
    for job in sorted(jobs, key=lambda j: (j.submit_s, j.key)):
        if job.elastic:
            if int((rank + 1) * share) > int(rank * share):
                job = dataclasses.replace(job, min_gpus=job.requested_gpus, max_gpus=job.requested_gpus)
            elif min_request:
                job = dataclasses.replace(job, min_gpus=job.requested_gpus)
            rank += 1
        out.append(job)
    return out


def all_rigid(jobs: list[SimJob]) -> list[SimJob]:
    return [dataclasses.replace(j, min_gpus=j.requested_gpus, max_gpus=j.requested_gpus) for j in jobs]


def class_figures(result: SimResult, rigid: set[str]) -> dict[str, float]:
    """Figures of the jobs rigid in the mixed run and of the others, whatever they were in this run."""
    waits = [j.wait_s for j in result.jobs if j.key in rigid and j.wait_s is not None]
    r_jct = [j.jct_s for j in result.jobs if j.key in rigid and j.jct_s is not None]
    e_jct = [j.jct_s for j in result.jobs if j.key not in rigid and j.jct_s is not None]
    e_wait = [j.wait_s for j in result.jobs if j.key not in rigid and j.wait_s is not None]
    s = summarize(result)
    return {"rigid_avg_wait_s": float(np.mean(waits)), "rigid_p95_wait_s": float(np.percentile(waits, 95)),
            "rigid_avg_jct_s": float(np.mean(r_jct)), "elastic_avg_jct_s": float(np.mean(e_jct)),
            "elastic_avg_wait_s": float(np.mean(e_wait)),
            "gpu_util_share": float(s["gpu_util"]), "restarts": int(s["restarts"]),  # type: ignore[arg-type]
            "unfinished_jobs": len(result.unfinished)}


FIGURES = ("rigid_avg_wait_s", "rigid_p95_wait_s", "rigid_avg_jct_s", "elastic_avg_jct_s", "elastic_avg_wait_s",
           "gpu_util_share", "restarts")
TARGETS = (("rigid_avg_wait_s", WAIT_BOUND, "<="), ("rigid_p95_wait_s", WAIT_BOUND, "<="),
           ("gpu_util_share", 1.0, ">"), ("elastic_avg_jct_s", 1.0, "<"))


def compare(jobs: list[SimJob], rigid_share: float, cluster: str = "16x4", perturb: int = 0) -> list[dict[str, object]]:
    """The runs side by side (see the module docstring), one row each (the mean over the perturbed runs)."""
    mixed = mixed_workload(jobs, rigid_share)
    rigid = {j.key for j in mixed if not j.elastic}
    rows = []
    for name, workload, make_policy in (
            ("all-rigid", all_rigid(jobs), StaticPolicy),
            ("all-rigid-slurm", all_rigid(jobs), ControllerPolicy),
            ("mixed", mixed, ControllerPolicy),
            ("mixed-guarantee", mixed, lambda: ControllerPolicy(GUARANTEE_CONFIG)),
            ("mixed-requeue-only", mixed, lambda: ControllerPolicy(keep_ranks=False)),
            ("mixed-min-request", mixed_workload(jobs, rigid_share, min_request=True), ControllerPolicy)):
        draws = []
        for overhead in overheads(perturb):
            config = SimConfig(parse_cluster(cluster), immediate=True, restart=RestartModel(overhead_s=overhead))
            policy = make_policy()
            try:
                result = Simulation(workload, policy, config).run()
            finally:
                close = getattr(policy, "close", None)
                if close:
                    close()
            draws.append({**class_figures(result, rigid), "sim_wall_s": result.wall_s})
        row: dict[str, object] = {"run": name, "rigid_jobs": len(rigid), "jobs": len(jobs), "draws": len(draws)}
        for key in (*FIGURES, "unfinished_jobs", "sim_wall_s"):
            row[key] = float(np.mean([d[key] for d in draws]))
        if len(draws) > 1:
            for key in FIGURES:
                row[f"{key}_min"] = min(float(d[key]) for d in draws)
                row[f"{key}_max"] = max(float(d[key]) for d in draws)
        row["per_draw"] = draws
        rows.append(row)
    return rows


def _met(mixed: float, base: float, bound: float, better: str) -> bool:
    return mixed <= bound * base if better == "<=" else (mixed > base if better == ">" else mixed < base)


def targets(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Each target on the mean of the runs, and whether it held in every run (run i against base run i)."""
    base = next(r for r in rows if r["run"] == "all-rigid")
    out = []
    for mixed in (r for r in rows if str(r["run"]).startswith("mixed")):
        for key, bound, better in TARGETS:
            m, b = float(mixed[key]), float(base[key])  # type: ignore[arg-type]
            every = all(_met(float(d[key]), float(e[key]), bound, better)
                        for d, e in zip(mixed["per_draw"], base["per_draw"]))  # type: ignore[call-overload]
            out.append({"mixed_run": mixed["run"], "figure": key, "mixed": m, "all_rigid": b,
                        "target": f"{better} {bound:g}x all-rigid", "met": _met(m, b, bound, better),
                        "met_every_run": every})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["1"], help="Pollux workload numbers (1-4)")
    parser.add_argument("--rigid-share", type=float, default=0.7)
    parser.add_argument("--perturb", type=int, default=0, metavar="K",
                        help="also run at a restart overhead of 30 +- 0.1 s x 1..K; rows are then means")
    parser.add_argument("--json", action="store_true", help="a JSON list of rows (units in the key names)")
    args = parser.parse_args()
    if not 0 <= args.rigid_share <= 1:
        parser.error("--rigid-share must lie in [0, 1]")
    if not 0 <= args.perturb <= MAX_PERTURB:
        parser.error(f"--perturb must lie in [0, {MAX_PERTURB}]")
    rows: list[dict[str, object]] = []
    for w in args.workloads:
        jobs = load_workload(TRACES / "workloads" / f"workload-{w}.csv")
        runs = compare(jobs, args.rigid_share, perturb=args.perturb)
        met = targets(runs)
        for row in runs:
            row.pop("per_draw")
            rows.append({"workload": f"workload-{w}", **row})
        for t in met:
            rows.append({"workload": f"workload-{w}", "run": "target", **t})
    if args.json:
        print_rows(rows, True)
        return
    columns = None
    if args.perturb:
        columns = ["workload", "run", "draws", "rigid_avg_wait_s", "rigid_p95_wait_s", "rigid_p95_wait_s_min",
                   "rigid_p95_wait_s_max",
                   "elastic_avg_jct_s", "elastic_avg_jct_s_min", "elastic_avg_jct_s_max", "gpu_util_share",
                   "gpu_util_share_min", "gpu_util_share_max", "restarts"]
    print_rows([r for r in rows if r["run"] != "target"], False, columns, title="runs")
    print()
    print_rows([r for r in rows if r["run"] == "target"], False, title="targets")


if __name__ == "__main__":
    main()
