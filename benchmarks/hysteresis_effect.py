"""The simulator's figures under the shipped controller at several `--hysteresis` values.

The restart charge spreads a restart over the hysteresis (never less than
300 s), so a longer hysteresis makes resizes cheaper in the objective while
it pins a resized job for longer. This replays one Pollux workload under
`ControllerPolicy` with each hysteresis and prints one JSON line per run
(the simulator's summary, and the wall time). Run it on two trees (one
before a change, one after) to see a change's effect. Where the solver stops
on wall time (`Policy.time_limit_s`), two runs of the same tree differ, so
repeat a value before reading a difference into it. Not a test: it reports
what it measures.

    python3 benchmarks/hysteresis_effect.py --workload workload-1 --hysteresis 300 1200
    python3 benchmarks/hysteresis_effect.py --jobs 40 --hysteresis 300 300 1200 1200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from slurm_elastic.sim import RestartModel, SimConfig, Simulation, parse_cluster, parse_failures, summarize
from slurm_elastic.sim.controller import SIM_CONFIG, ControllerPolicy
from slurm_elastic.sim.workload import load_any

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "pollux"


def run(workload: str, hysteresis_s: float, *, jobs: int | None, cluster: str) -> dict[str, object]:
    nodes = parse_cluster(cluster)
    trace = load_any(TRACES / "workloads" / f"{workload}.csv", gpus_per_node=max(n.gpus for n in nodes))
    trace = trace[:jobs] if jobs else trace
    config = SimConfig(nodes, 60.0, RestartModel("forward-layer", 30.0, 1800.0, 30.0), parse_failures(None),
                       immediate=True)
    policy = ControllerPolicy(dataclasses.replace(SIM_CONFIG, min_resize_interval_s=hysteresis_s))
    t0 = time.monotonic()
    result = Simulation(trace, policy, config, None).run()
    policy.close()
    return {"workload": workload, "hysteresis_s": hysteresis_s, "jobs": len(trace), **summarize(result),
            "wall_s": round(time.monotonic() - t0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="workload-1")
    parser.add_argument("--hysteresis", type=float, nargs="+", default=[300.0, 1200.0])
    parser.add_argument("--jobs", type=int, default=None, help="only the first N jobs of the trace")
    parser.add_argument("--cluster", default="16x4")
    args = parser.parse_args()
    for hysteresis_s in args.hysteresis:
        print(json.dumps(run(args.workload, hysteresis_s, jobs=args.jobs, cluster=args.cluster), default=str),
              flush=True)


if __name__ == "__main__":
    main()
