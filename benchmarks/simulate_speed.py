"""How long the simulator takes on the 160-job Pollux workloads, per policy (goal: under 60 s; 1,000 jobs: under 5 minutes).

    .venv/bin/python benchmarks/simulate_speed.py [--workload PATH ...] [--policy controller]
        [--adaptive none|all|half] [--ticks-only] [--json]
    .venv/bin/python benchmarks/simulate_speed.py --jobs 1000 --cluster 100x4 --ticks-only

`--jobs N`: Pollux's workloads 1-4 in turn, repeated until N jobs (names made unique, submission
times kept, so N jobs arrive in the trace's 8 hours).

The machine is shared: note its load (printed) next to any figure you quote; CPU seconds (this
process, HiGHS included: the l1 policy solves single-threaded) are less sensitive to other load.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

from slurm_elastic.sim import SimConfig, Simulation, make_policy, parse_cluster, summarize
from slurm_elastic.sim.pollux import ADAPTIVE
from slurm_elastic.sim.workload import load_any

DEFAULT = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "pollux" / "workloads" / "workload-1.csv"


def cycled(count: int, adaptive: str) -> list:
    """`count` jobs: Pollux's workloads 1-4 in turn, repeated, each job renamed by workload and round."""
    sources = [load_any(DEFAULT.with_name(f"workload-{w}.csv"), adaptive=adaptive) for w in (1, 2, 3, 4)]
    jobs: list = []
    for turn in itertools.count():
        for w, source in enumerate(sources, 1):
            for job in source:
                if len(jobs) == count:
                    return jobs
                jobs.append(dataclasses.replace(job, key=f"{job.key}-w{w}r{turn}"))
    return jobs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", type=Path, action="append", help="workload file (repeatable)")
    parser.add_argument("--policy", action="append", help="policy (repeatable; default controller)")
    parser.add_argument("--cluster", default="16x4")
    parser.add_argument("--adaptive", default="none", choices=ADAPTIVE,
                        help="Pollux workloads: which jobs adapt their batch (all: as in Pollux's runs)")
    parser.add_argument("--max-scale", type=float, default=2.0, help="controller: range as a multiple of the request "
                        "(0: the trace's)")
    parser.add_argument("--ticks-only", action="store_true",
                        help="decide only at the 60 s ticks, as the original simulator (and simulate_targets.py)")
    parser.add_argument("--jobs", type=int, metavar="N",
                        help="instead of --workload: Pollux's workloads 1-4 in turn, repeated until N jobs")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    args = parser.parse_args()
    if args.jobs is not None and (args.jobs < 1 or args.workload):
        print("--jobs needs a count >= 1 and no --workload", file=sys.stderr)
        return 2
    workloads = [Path(f"pollux-1-4-cycled-{args.jobs}")] if args.jobs else args.workload or [DEFAULT]
    policies = args.policy or ["controller"]
    rows = []
    for path in workloads:
        source = DEFAULT if args.jobs else path
        if not source.exists():
            print(f"workload {source} not found (the Pollux traces live in shared/ beside the repository)",
                  file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        jobs = cycled(args.jobs, args.adaptive) if args.jobs else load_any(path, adaptive=args.adaptive)
        load_s = time.perf_counter() - t0
        for name in policies:
            load_before = os.getloadavg()[0]
            policy = make_policy(name, max_scale=args.max_scale)
            solves: list[float] = []
            decide = policy.decide

            def counted(view, _decide=decide, _solves=solves):  # every decision, not only those that changed
                decision = _decide(view)
                if decision.solve_s:
                    _solves.append(decision.solve_s)
                return decision

            policy.decide = counted  # type: ignore[method-assign]
            t0, c0 = time.perf_counter(), time.process_time()
            result = Simulation(jobs, policy, SimConfig(parse_cluster(args.cluster), immediate=not args.ticks_only)).run()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            s = summarize(result)
            rows.append({"workload": path.name, "policy": name, "adaptive": args.adaptive,
                         "ticks_only": args.ticks_only, "jobs": len(jobs), "load_s": round(load_s, 3),
                         "simulate_s": round(wall, 2), "cpu_s": round(cpu, 2), "solve_s": round(sum(solves), 2),
                         "solve_max_s": round(max(solves, default=0.0), 3), "solves": len(solves),
                         "decision_points": s["decision_points"],
                         "avg_jct_s": round(s["avg_jct_s"], 1), "loadavg_1m": round(load_before, 2),
                         "cpus": os.cpu_count()})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'workload':24} {'policy':9} {'jobs':>5} {'simulate s':>11} {'CPU s':>6} {'solve s':>8} {'max solve s':>12} "
              f"{'solves':>7} {'records':>8} {'load':>5}")
        for r in rows:
            print(f"{r['workload']:24} {r['policy']:9} {r['jobs']:5} {r['simulate_s']:11.1f} {r['cpu_s']:6.1f} {r['solve_s']:8.1f} "
                  f"{r['solve_max_s']:12.3f} {r['solves']:7} {r['decision_points']:8} {r['loadavg_1m']:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
