"""The shipped controller against the original Pollux simulator's reference JCTs, and the calibration beside it.

For each of the shared workloads 1-4 (16 nodes x 4 GPUs, 60 s ticks only, 30 s
per (re)start, statistical progress as the original counts it) this runs:

- the project's Tiresias and Optimus+Oracle (calibration: how near the
  original's per-job JCTs they land);
- the shipped controller (sim/controller.py: the daemon's Reconciler over the
  in-memory Slurm) in three modes: `fixed` (every job at its trace batch; the
  one-controller issue's targets), `adaptive` (every job adaptive, as in the
  original's Pollux runs) and `mixed` (every other job adaptive);

then prints one row per run and the targets of issues 15 and 18 side by side
(measured, target, met), all in one run:

    .venv/bin/python benchmarks/simulate_targets.py [--workloads 1 2 3 4] [--policy controller ...]
        [--modes fixed adaptive mixed] [--objective legacy|progress] [--perturb K] [--json | --jcts]

`--jcts` prints every job's JCT (full precision) and restarts per run and
nothing measured in wall time, so the outputs of two branches can be diffed.

Elastic ranges: fixed-batch jobs declare 1 .. 2x their requested GPUs (the
simulator's default `--max-scale 2`); in the adaptive and mixed modes every
job declares its whole range (1 .. the trace's bound), as Pollux's jobs do;
`--max-scale` sets one value for all. Not a test: it reports what it measures.
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

from slurm_elastic.sim import SimConfig, Simulation, make_policy, parse_cluster, parse_failures, summarize
from slurm_elastic.sim.engine import RestartModel
from slurm_elastic.sim.jobs import packed_placement
from slurm_elastic.sim.pollux import load_workload
from table import machine  # benchmarks/table.py: the machine a run's figures belong to

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "pollux"
REFERENCE_COLUMNS = {"tiresias": "tiresias_jct_s", "optimus": "optimus_oracle_jct_s", "pollux": "pollux_jct_s"}
MODES = {"fixed": "none", "adaptive": "all", "mixed": "half"}
GPUS_PER_NODE = 4


def reference(path: Path) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            out[row["workload"]][row["job"]] = {k: float(row[c]) for k, c in REFERENCE_COLUMNS.items()}
    return out


def _makespan(submit: dict[str, float], jct: dict[str, float]) -> float:
    return max(submit[k] + jct[k] for k in jct) - min(submit.values())


def run(workload: str, policy: str, ref: dict[str, dict[str, float]], *, mode: str = "fixed",
        max_scale: float | None = None, failures: str | None = None, objective: str = "legacy",
        overhead_s: float = RestartModel().overhead_s) -> dict[str, object]:
    jobs = load_workload(TRACES / "workloads" / f"{workload}.csv", adaptive=MODES[mode])
    if max_scale is None:
        max_scale = 2.0 if mode == "fixed" else 0.0
    t0 = time.perf_counter()
    sim_policy = make_policy(policy, max_scale=max_scale, objective=objective)
    config = SimConfig(parse_cluster(f"16x{GPUS_PER_NODE}"), failures=parse_failures(failures), immediate=False,
                       restart=RestartModel(overhead_s=overhead_s))
    result = Simulation(jobs, sim_policy, config).run()
    wall = time.perf_counter() - t0
    close = getattr(sim_policy, "close", None)
    if close:
        close()
    s = summarize(result)
    mine = {j.key: j.jct_s for j in result.jobs if j.jct_s is not None}
    submit = {j.key: j.submit_s for j in jobs}
    avg = {k: statistics.mean(v[k] for v in ref.values()) for k in REFERENCE_COLUMNS}
    by_app: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for j in result.jobs:
        if j.jct_s is not None:
            by_app[j.application].append((j.jct_s, ref[j.key]["tiresias"]))
    apps = {app: statistics.mean(a for a, _ in v) / statistics.mean(b for _, b in v) for app, v in by_app.items()}
    worst_app = max(apps, key=lambda a: apps[a])
    row: dict[str, object] = {
        "workload": workload, "policy": policy, "mode": mode if policy == "controller" else "fixed",
        "max_scale": max_scale or None, "failures": failures,
        "objective": objective if policy == "controller" else None, "jobs": len(jobs), "finished": s["finished"],
        "avg_jct_s": round(float(s["avg_jct_s"]), 1), "makespan_s": round(float(s["makespan_s"]), 1),
        "ref_tiresias_avg_jct_s": round(avg["tiresias"], 1), "ref_optimus_avg_jct_s": round(avg["optimus"], 1),
        "ref_pollux_avg_jct_s": round(avg["pollux"], 1),
        "ref_pollux_makespan_s": round(_makespan(submit, {k: v["pollux"] for k, v in ref.items()}), 1),
        "vs_ref_tiresias_ratio": round(float(s["avg_jct_s"]) / avg["tiresias"], 4),
        "vs_ref_optimus_ratio": round(float(s["avg_jct_s"]) / avg["optimus"], 4),
        "vs_ref_pollux_ratio": round(float(s["avg_jct_s"]) / avg["pollux"], 4),
        "worst_app_vs_ref_tiresias": worst_app, "worst_app_vs_ref_tiresias_ratio": round(apps[worst_app], 4),
        "app_vs_ref_tiresias_ratio": {a: round(v, 3) for a, v in sorted(apps.items())},
        "app_detail": _app_detail(result, {j.key: j for j in jobs}),
        "restarts": s["restarts"], "restart_loss_share": round(float(s["restart_loss_share"]), 4),
        "node_failures": s["node_failures"], "simulate_s": round(wall, 1), "restart_overhead_s": overhead_s,
    }
    # per job, for --jcts: what two branches are diffed on (no wall-clock figure among them)
    row["job_jct_s"] = {k: mine[k] for k in sorted(mine)}
    row["job_restarts"] = {j.key: j.restarts for j in sorted(result.jobs, key=lambda j: j.key)}
    row["vs_ref_pollux_makespan_ratio"] = round(float(s["makespan_s"]) / float(row["ref_pollux_makespan_s"]), 4)
    if policy in ("tiresias", "optimus"):
        # calibration: the same policy in the original simulator, job by job
        ratios = [mine[k] / ref[k][policy] for k in mine if ref[k][policy] > 0]
        row["calibration_avg_ratio"] = round(float(s["avg_jct_s"]) / avg[policy], 4)
        row["calibration_median_job_ratio"] = round(statistics.median(ratios), 4)
        row["calibration_jobs_within_5pct_share"] = round(sum(abs(r - 1) <= 0.05 for r in ratios) / len(ratios), 3)
        row["calibration_jobs_within_10pct_share"] = round(sum(abs(r - 1) <= 0.10 for r in ratios) / len(ratios), 3)
        row["calibration_p90_job_deviation_ratio"] = round(sorted(abs(r - 1) for r in ratios)[int(0.9 * len(ratios))], 4)
    return row


def _app_detail(result, jobs: dict[str, object]) -> dict[str, dict[str, float]]:
    """Per application: mean JCT, wait before the first start, share of its life at 0 GPUs after it started,
    GPUs held while it held any, restarts and GPU-hours per job (where starvation would show); the shares of
    its running time below and above the GPUs it asked for; and the GPU-hours its work takes at the size it
    asked for, packed on the fewest nodes, with no restart (the speed model's own figure: GPU-hours beyond it
    are restart stalls or sizes and spreads that run slower per GPU; an adaptive job: at its first epoch's rate)."""
    held: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for t, key, g in result.timeline:
        held[key].append((t, g))
    out: dict[str, list[dict[str, float]]] = defaultdict(list)
    for j in result.jobs:
        if j.finish_s is None or j.start_s is None:
            continue
        on = zero = weighted = below = above = 0.0
        changes = held.get(j.key, []) + [(j.finish_s, 0)]
        for (t0, g), (t1, _) in zip(changes, changes[1:]):
            if t0 >= j.start_s:
                if g > 0:
                    on += t1 - t0
                    weighted += g * (t1 - t0)
                    below += (t1 - t0) * (g < j.requested_gpus)
                    above += (t1 - t0) * (g > j.requested_gpus)
                else:
                    zero += t1 - t0
        sim_job = jobs[j.key]
        asked = packed_placement(j.requested_gpus, GPUS_PER_NODE)
        out[j.application].append({"jct_s": j.jct_s, "wait_s": j.start_s - j.submit_s,
                                   "preempted_share": zero / max(j.finish_s - j.start_s, 1e-9),
                                   "gpus_while_running": weighted / on if on else 0.0,
                                   "running_below_asked_share": below / on if on else 0.0,
                                   "running_above_asked_share": above / on if on else 0.0,
                                   "restarts": j.restarts, "gpu_h": j.gpu_s / 3600,
                                   "gpu_h_at_asked_size": sim_job.runtime_at(asked) * j.requested_gpus / 3600})
    return {app: {k: round(statistics.mean(v[k] for v in vs), 3) for k in vs[0]} | {"jobs": len(vs)}
            for app, vs in sorted(out.items())}


# (issue, mode, what, row key, bound): measured <= bound is met
PER_WORKLOAD = (
    ("15", "fixed", "avg JCT / Tiresias", "vs_ref_tiresias_ratio", 0.85),
    ("15", "fixed", "avg JCT / Optimus+Oracle", "vs_ref_optimus_ratio", 0.60),
    ("15", "fixed", "worst application's mean JCT / its Tiresias mean", "worst_app_vs_ref_tiresias_ratio", 1.10),
    ("18", "adaptive", "avg JCT / Pollux", "vs_ref_pollux_ratio", 0.90),
    ("18", "adaptive", "makespan / Pollux makespan", "vs_ref_pollux_makespan_ratio", 1.00),
    ("18", "mixed", "avg JCT / Tiresias (ahead: < 1)", "vs_ref_tiresias_ratio", 1.00),
    ("18", "mixed", "avg JCT / Optimus+Oracle (ahead: < 1)", "vs_ref_optimus_ratio", 1.00),
)


PERTURB_STEP_S = 0.1
MAX_PERTURB = 10


def overheads(perturb: int) -> list[float]:
    """The restart overheads a run is drawn at: 30 s, and 30 +- 0.1 s x 1..perturb (docs/simulator.md,
    "One run is one draw")."""
    base = RestartModel().overhead_s
    return [base] + [round(base + sign * PERTURB_STEP_S * k, 3) for k in range(1, perturb + 1) for sign in (-1, 1)]


MEANS = ("avg_jct_s", "makespan_s", "vs_ref_tiresias_ratio", "vs_ref_optimus_ratio", "vs_ref_pollux_ratio",
         "vs_ref_pollux_makespan_ratio", "restarts", "restart_loss_share")


def mean_row(draws: list[dict[str, object]]) -> dict[str, object]:
    """One configuration's draws as one row: the means of the figures, the range of the JCT, and the worst
    application by its mean ratio over the draws (simulate_s: the slowest draw)."""
    if len(draws) == 1:
        return draws[0]
    # the per-job and per-application detail is one draw's: a mean row carries none of it
    row = {k: v for k, v in draws[0].items() if k not in ("job_jct_s", "job_restarts", "app_detail", "finished")}
    for key in MEANS:
        row[key] = round(statistics.mean(float(d[key]) for d in draws), 4)  # type: ignore[arg-type]
    row["avg_jct_s_min"] = min(float(d["avg_jct_s"]) for d in draws)  # type: ignore[arg-type]
    row["avg_jct_s_max"] = max(float(d["avg_jct_s"]) for d in draws)  # type: ignore[arg-type]
    names = {a for d in draws for a in d["app_vs_ref_tiresias_ratio"]}  # type: ignore[attr-defined]
    apps = {a: statistics.mean(d["app_vs_ref_tiresias_ratio"][a] for d in draws  # type: ignore[index]
                               if a in d["app_vs_ref_tiresias_ratio"]) for a in names}  # type: ignore[operator]
    worst = max(apps, key=lambda a: apps[a])
    row.update(worst_app_vs_ref_tiresias=worst, worst_app_vs_ref_tiresias_ratio=round(apps[worst], 4),
               app_vs_ref_tiresias_ratio={a: round(v, 3) for a, v in sorted(apps.items())},
               simulate_s=max(float(d["simulate_s"]) for d in draws),  # type: ignore[arg-type]
               draws=len(draws), restart_overhead_s=None, draw_overheads_s=[d["restart_overhead_s"] for d in draws])
    return row


def targets(rows: list[dict[str, object]], workloads: list[str]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    ctl = {(r["workload"], r["mode"]): r for r in rows if r["policy"] == "controller"}
    for issue, mode, what, key, bound in PER_WORKLOAD:
        values = {w: ctl[(w, mode)][key] for w in workloads if (w, mode) in ctl}
        if values:
            strict = "ahead" in what
            met = all((v < bound) if strict else (v <= bound) for v in values.values())
            out.append({"target": f"{issue}: {mode}: {what}", "bound_ratio": bound, "per_workload_ratio": values,
                        "met": met and len(values) == len(workloads)})
    fixed = [ctl[(w, "fixed")] for w in workloads if (w, "fixed") in ctl]
    if len(fixed) == len(workloads) == 4:
        mean = statistics.mean(float(r["avg_jct_s"]) for r in fixed)
        pollux = statistics.mean(float(r["ref_pollux_avg_jct_s"]) for r in fixed)
        out.append({"target": "15: fixed: mean over workloads 1-4 / Pollux's", "bound_ratio": 1.0,
                    "per_workload_ratio": {"mean": round(mean / pollux, 4)}, "met": mean <= pollux})
    timed = [r for r in rows if r["policy"] == "controller" and r["jobs"] >= 160]
    if timed:
        worst = max(float(r["simulate_s"]) for r in timed)
        out.append({"target": "15: a 160-job workload simulated in < 60 s (slowest controller run, s)",
                    "bound_s": 60.0, "per_workload_s": {f"{r['workload']}/{r['mode']}": r["simulate_s"] for r in timed},
                    "met": worst < 60.0})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="*", default=["1", "2", "3", "4"])
    parser.add_argument("--policy", action="append", help="repeatable; default tiresias, optimus, controller")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES),
                        help="controller modes (default all three)")
    parser.add_argument("--max-scale", type=float, default=None,
                        help="elastic range as a multiple of the request (0: the trace's); default 2 fixed, 0 else")
    parser.add_argument("--failures", default=None, help="node failures for every run, as simulate's --failures "
                        "(e.g. every:7200:600); the reference has none, so only 'still ahead' is comparable")
    parser.add_argument("--objective", default="legacy", choices=["legacy", "progress"],
                        help="what the controller's allocator maximises (settings.OBJECTIVE; docs/allocator.md)")
    parser.add_argument("--perturb", type=int, default=0, metavar="K",
                        help="draw each controller run also at a restart overhead of 30 +- 0.1 s x 1..K: its row is "
                             "the mean of the 2K+1 draws (docs/simulator.md, 'One run is one draw')")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows (runs, then targets)")
    parser.add_argument("--jcts", action="store_true",
                        help="print only every job's JCT and restarts, one tab-separated line per job and run "
                             "(workload, policy, mode, job, JCT s, restarts): two branches' outputs diff cleanly")
    args = parser.parse_args()
    if not 0 <= args.perturb <= MAX_PERTURB:
        parser.error(f"--perturb must lie in [0, {MAX_PERTURB}]")
    if args.perturb and args.jcts:
        parser.error("--jcts prints one draw's JCTs: leave --perturb out")
    ref_path = TRACES / "reference" / "jct.csv"
    if not ref_path.exists():
        print(f"reference JCTs not found at {ref_path} (the shared/ folder beside the repository)", file=sys.stderr)
        return 2
    refs = reference(ref_path)
    print(machine(), file=sys.stderr)
    rows = []
    for w in args.workloads:
        name = f"workload-{w}"
        for policy in args.policy or ["tiresias", "optimus", "controller"]:
            for mode in (args.modes if policy == "controller" else ["fixed"]):
                draws = [run(name, policy, refs[name], mode=mode, max_scale=args.max_scale, failures=args.failures,
                             objective=args.objective, overhead_s=overhead)
                         for overhead in overheads(args.perturb if policy == "controller" else 0)]
                rows.append(mean_row(draws))
                print(_line(rows[-1]), file=sys.stderr if args.json or args.jcts else sys.stdout, flush=True)
                if args.jcts:
                    r = rows[-1]
                    for key, jct in r["job_jct_s"].items():  # type: ignore[union-attr]
                        print(f"{r['workload']}\t{r['policy']}\t{r['mode']}\t{key}\t{jct!r}\t"
                              f"{r['job_restarts'][key]}", flush=True)  # type: ignore[index]
    goals = targets(rows, [f"workload-{w}" for w in args.workloads])
    if args.jcts:
        return 0
    if args.json:
        print(json.dumps(rows + goals, indent=1))
    else:
        print()
        print(_targets_table(goals, [f"workload-{w}" for w in args.workloads]))
    return 0


def _line(r: dict[str, object]) -> str:
    cal = (f"  calibration avg {r['calibration_avg_ratio']:.3f}x, median job {r['calibration_median_job_ratio']:.3f}x,"
           f" {r['calibration_jobs_within_10pct_share']:.0%} of jobs within 10 %" if "calibration_avg_ratio" in r else "")
    objective = f" {r['objective']}" if r.get("objective") else ""
    spread = (f" ({r['draws']} draws: {r['avg_jct_s_min']:.0f}-{r['avg_jct_s_max']:.0f})" if "draws" in r else "")
    return (f"{r['workload']:<11} {r['policy']:<10} {r['mode']:<8}{objective} avg JCT {r['avg_jct_s']:>7.0f} s{spread} | ref Tiresias "
            f"{r['ref_tiresias_avg_jct_s']:.0f} ({r['vs_ref_tiresias_ratio']:.3f}x) Optimus "
            f"{r['ref_optimus_avg_jct_s']:.0f} ({r['vs_ref_optimus_ratio']:.3f}x) Pollux {r['ref_pollux_avg_jct_s']:.0f} "
            f"({r['vs_ref_pollux_ratio']:.3f}x) | makespan {r['makespan_s']:.0f} s ({r['vs_ref_pollux_makespan_ratio']:.3f}x"
            f" Pollux's) | worst app {r['worst_app_vs_ref_tiresias']} "
            f"{r['worst_app_vs_ref_tiresias_ratio']:.2f}x | restarts {r['restarts']:.0f}, loss {r['restart_loss_share']:.1%}"
            f"{', failures ' + str(r['node_failures']) if r['failures'] else ''} | {r['simulate_s']:.0f} s{cal}")


def _targets_table(goals: list[dict[str, object]], workloads: list[str]) -> str:
    cols = [w.replace("workload-", "w") for w in workloads]
    lines = ["| target | bound | " + " | ".join(cols) + " | met |", "|---|---|" + "---|" * len(cols) + "---|"]
    for g in goals:
        values = g.get("per_workload_ratio") or g.get("per_workload_s")
        bound = g.get("bound_ratio", g.get("bound_s"))
        if "per_workload_s" in g:
            cells = [" ".join(f"{v:.0f}" for k, v in values.items() if k.startswith(w + "/")) for w in workloads]
        elif "mean" in values:
            cells = [f"{values['mean']:.3f} (mean)"] + [""] * (len(cols) - 1)
        else:
            cells = [f"{values[w]:.3f}" if w in values else "" for w in workloads]
        lines.append(f"| {g['target']} | {bound} | " + " | ".join(cells) + f" | {'yes' if g['met'] else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
