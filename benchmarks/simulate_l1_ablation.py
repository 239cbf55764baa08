"""What each choice in how the l1 policy builds its JobRequests is worth (avg JCT on one Pollux workload).

    python3 benchmarks/simulate_l1_ablation.py [--workload PATH] [--json]

Each variant changes one thing from the default l1 policy (slurm_elastic/sim/l1.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from slurm_elastic.allocate import Policy
from slurm_elastic.sim import SimConfig, Simulation, parse_cluster, summarize
from slurm_elastic.sim.l1 import SIM_POLICY, L1Policy
from slurm_elastic.sim.workload import load_any

DEFAULT = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "pollux" / "workloads" / "workload-1.csv"

VARIANTS = {
    "default": {},
    "equal weights": {"weights": "equal"},
    "raw restart cost (30 s)": {"kappa": "raw"},
    "no speed frontier": {"frontier": False},
    "no 2x cap": {"max_scale": None},
    "re-solve every quiet tick": {"quiet_every": 1},
    "0.5 % MIP gap": {"policy": Policy(time_limit_s=SIM_POLICY.time_limit_s, mip_rel_gap=0.005, threads=1)},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", type=Path, default=DEFAULT)
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="repeatable; default all")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not args.workload.exists():
        print(f"workload {args.workload} not found", file=sys.stderr)
        return 2
    jobs = load_any(args.workload)
    rows = []
    for name in args.variant or list(VARIANTS):
        c0 = time.process_time()
        result = Simulation(jobs, L1Policy(**VARIANTS[name]), SimConfig(parse_cluster("16x4"))).run()
        s = summarize(result)
        rows.append({"variant": name, "avg_jct_s": round(s["avg_jct_s"], 1), "p99_jct_s": round(s["p99_jct_s"], 1),
                     "restarts": s["restarts"], "cpu_s": round(time.process_time() - c0, 1)})
        if not args.json:
            r = rows[-1]
            print(f"{r['variant']:28} avg JCT {r['avg_jct_s']:8.0f} s  p99 {r['p99_jct_s']:8.0f} s  "
                  f"restarts {r['restarts']:5}  CPU {r['cpu_s']:6.1f} s", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
