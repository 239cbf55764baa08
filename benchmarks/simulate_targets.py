"""The shipped controller against the original Pollux simulator's reference JCTs, and the calibration beside it.

For each of the shared workloads 1-4 (16 nodes x 4 GPUs, 60 s ticks, 30 s per
(re)start, statistical progress as the original counts it), this runs the
project's Tiresias and Optimus+Oracle (calibration: how near the original's
per-job JCTs they land) and the shipped controller (sim/controller.py: the
daemon's Reconciler over the in-memory Slurm), and prints one row per
(workload, policy) with the reference figures side by side.

    python3 benchmarks/simulate_targets.py [--workloads 1 2 3 4] [--policy controller ...] [--json]

Not a test: it reports whatever it measures.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from slurm_elastic.sim import SimConfig, Simulation, make_policy, parse_cluster, summarize
from slurm_elastic.sim.workload import load_any

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "pollux"
REFERENCE_COLUMNS = {"tiresias": "tiresias_jct_s", "optimus": "optimus_oracle_jct_s", "pollux": "pollux_jct_s"}


def reference(path: Path) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            out[row["workload"]][row["job"]] = {k: float(row[c]) for k, c in REFERENCE_COLUMNS.items()}
    return out


def run(workload: str, policy: str, ref: dict[str, dict[str, float]]) -> dict[str, object]:
    jobs = load_any(TRACES / "workloads" / f"{workload}.csv")
    t0 = time.perf_counter()
    result = Simulation(jobs, make_policy(policy), SimConfig(parse_cluster("16x4"), immediate=False)).run()
    wall = time.perf_counter() - t0
    s = summarize(result)
    mine = {j.key: j.jct_s for j in result.jobs if j.jct_s is not None}
    avg = {k: statistics.mean(v[k] for v in ref.values()) for k in REFERENCE_COLUMNS}
    by_app: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for j in result.jobs:
        if j.jct_s is not None:
            by_app[j.application].append((j.jct_s, ref[j.key]["tiresias"]))
    worst_app, worst = max(((app, statistics.mean(a for a, _ in v) / statistics.mean(b for _, b in v))
                            for app, v in by_app.items()), key=lambda x: x[1])
    row: dict[str, object] = {
        "workload": workload, "policy": policy, "jobs": len(jobs), "finished": s["finished"],
        "avg_jct_s": round(float(s["avg_jct_s"]), 1),
        "ref_tiresias_avg_jct_s": round(avg["tiresias"], 1), "ref_optimus_avg_jct_s": round(avg["optimus"], 1),
        "ref_pollux_avg_jct_s": round(avg["pollux"], 1),
        "vs_ref_tiresias_ratio": round(float(s["avg_jct_s"]) / avg["tiresias"], 4),
        "vs_ref_optimus_ratio": round(float(s["avg_jct_s"]) / avg["optimus"], 4),
        "vs_ref_pollux_ratio": round(float(s["avg_jct_s"]) / avg["pollux"], 4),
        "worst_app_vs_ref_tiresias": worst_app, "worst_app_vs_ref_tiresias_ratio": round(worst, 4),
        "restarts": s["restarts"], "restart_loss_share": round(float(s["restart_loss_share"]), 4),
        "simulate_s": round(wall, 1),
    }
    if policy in ("tiresias", "optimus"):
        # calibration: the same policy in the original simulator, job by job
        ratios = [mine[k] / ref[k][policy] for k in mine if ref[k][policy] > 0]
        row["calibration_avg_ratio"] = round(float(s["avg_jct_s"]) / avg[policy], 4)
        row["calibration_median_job_ratio"] = round(statistics.median(ratios), 4)
        row["calibration_jobs_within_5pct_share"] = round(sum(abs(r - 1) <= 0.05 for r in ratios) / len(ratios), 3)
        row["calibration_jobs_within_10pct_share"] = round(sum(abs(r - 1) <= 0.10 for r in ratios) / len(ratios), 3)
        row["calibration_p90_job_deviation_ratio"] = round(sorted(abs(r - 1) for r in ratios)[int(0.9 * len(ratios))], 4)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="*", default=["1", "2", "3", "4"])
    parser.add_argument("--policy", action="append", help="repeatable; default tiresias, optimus, controller")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    args = parser.parse_args()
    ref_path = TRACES / "reference" / "jct.csv"
    if not ref_path.exists():
        print(f"reference JCTs not found at {ref_path} (the shared/ folder beside the repository)", file=sys.stderr)
        return 2
    refs = reference(ref_path)
    rows = []
    for w in args.workloads:
        name = f"workload-{w}"
        for policy in args.policy or ["tiresias", "optimus", "controller"]:
            rows.append(run(name, policy, refs[name]))
            if not args.json:
                print(_line(rows[-1]), flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


def _line(r: dict[str, object]) -> str:
    cal = (f"  calibration avg {r['calibration_avg_ratio']:.3f}x, median job {r['calibration_median_job_ratio']:.3f}x,"
           f" {r['calibration_jobs_within_10pct_share']:.0%} of jobs within 10 %" if "calibration_avg_ratio" in r else "")
    return (f"{r['workload']:<11} {r['policy']:<10} avg JCT {r['avg_jct_s']:>7.0f} s | ref Tiresias "
            f"{r['ref_tiresias_avg_jct_s']:.0f} ({r['vs_ref_tiresias_ratio']:.3f}x) Optimus "
            f"{r['ref_optimus_avg_jct_s']:.0f} ({r['vs_ref_optimus_ratio']:.3f}x) Pollux {r['ref_pollux_avg_jct_s']:.0f} "
            f"({r['vs_ref_pollux_ratio']:.3f}x) | worst app {r['worst_app_vs_ref_tiresias']} "
            f"{r['worst_app_vs_ref_tiresias_ratio']:.2f}x | restarts {r['restarts']} | {r['simulate_s']:.0f} s{cal}")


if __name__ == "__main__":
    raise SystemExit(main())
