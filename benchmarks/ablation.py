"""The controller's rules, each taken out in turn: does it pay on every workload, and with failures?

Issue 31 keeps a rule of the request chain (control/requests/rules.py) or of
the controller (hysteresis, restart budget) only where taking it out makes
the shipped controller slower on every shared workload and in the failure
scenario. This runs the shipped controller as it is (`shipped`) and once
per variant with one rule out, on the Pollux workloads 1-4 (16 nodes x 4
GPUs, 60 s ticks, as benchmarks/simulate_targets.py), fixed and adaptive
batches, and fixed batches with one node down every 2 hours for 10 minutes
(`fixed+failures`). Every run is deterministic, so one run each is the
figure; runs go `--jobs` at a time.

    .venv/bin/python benchmarks/ablation.py [--workloads 1 2 3 4] [--variants shipped no-hysteresis ...]
        [--jobs 2] [--json]

It prints one row per variant and run (average JCT, its ratio to the
shipped controller's in the same scenario, restarts), then one row per
variant: the ratios' mean and range, and `pays` (the controller without the
rule is slower on every run: the rule earns its place). Rules the ablation
took out are put back as variants of their own (`adds`), to show that they
still do not pay. Not a test: it reports what it
measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from slurm_elastic.control.requests import rules as R
from slurm_elastic.control.requests.source import MeasuredRequests
from slurm_elastic.sim import SimConfig, Simulation, parse_cluster, parse_failures, summarize
from slurm_elastic.sim.controller import SIM_CONFIG, ControllerPolicy
from slurm_elastic.sim.pollux import load_workload
from simulate_targets import MODES, TRACES   # the same workloads and batch modes as the targets
from table import print_rows  # benchmarks/table.py: how every benchmark prints

SCENARIOS = ("fixed", "adaptive", "fixed+failures")
FAILURES = "every:7200:600"


@dataclass(frozen=True)
class Variant:
    """The shipped controller with one rule out: rules dropped, request settings and controller settings."""

    name: str
    removes: str                       # the shipped rule it takes out ("" where it adds one back)
    drop: tuple[type, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    controller: dict[str, Any] = field(default_factory=dict)
    adds: str = ""                     # a rule ablated out of the shipped controller, put back to check

    @property
    def change(self) -> str:
        return f"adds {self.adds}" if self.adds else f"removes {self.removes}"


VARIANTS = (
    Variant("shipped", "nothing"),
    Variant("no-speed-frontier", "a size must gain 5 % per GPU to be allowed", drop=(R.SpeedFrontier,)),
    Variant("no-measure-first", "a new size kept until measured", drop=(R.MeasureFirst,)),
    Variant("no-share-floor", "min(asked, fair share, holds) while running", drop=(R.ShareFloor, R.FloorHolds)),
    Variant("no-remaining-work", "remaining-time weights (every job weight 1)", drop=(R.RemainingWork,)),
    Variant("no-starvation", "must run after 30 min without GPUs", drop=(R.Starvation,)),
    Variant("no-restart-charge", "the restart priced in the objective", drop=(R.RestartCharge,)),
    Variant("no-hysteresis", "a new size kept 300 s", controller={"min_resize_interval_s": 0.0}),
    Variant("no-restart-budget", "6 controller restarts per job per hour",
            controller={"restart_budget_per_hour": 1_000_000}),
    Variant("capped-extrapolation", "unmeasured sizes from the fitted step-time model",
            settings={"predict_unmeasured": False}),
    # ablated out (docs/simulator.md, "The rules, each taken out"): put back, they should not pay either
    Variant("quantised-weights", "", settings={"weight_quantum": 0.25}, adds="weights in 19 % steps"),
    Variant("explore-discount", "", settings={"explore_discount": 0.25},
            adds="a predicted gain past the sizes measured counts 75 %"),
    Variant("no-asked-size", "the asked size credited linear until measured", drop=(R.AskedSize,)),
    Variant("charge-horizon-600", "the restart charge spread over the hold (300 s; here 600 s)",
            settings={"charge_horizon_s": 600.0}),
    Variant("charge-horizon-1200", "the restart charge spread over the hold (300 s; here 1200 s)",
            settings={"charge_horizon_s": 1200.0}),
    Variant("weights-sqrt", "the weights' full span (H / remaining square-rooted: 20x, not 400x)",
            settings={"weight_exponent": 0.5}),
    Variant("weights-narrow", "the weights' full span (clamped to 0.25-4, not 0.05-20)",
            settings={"weight_range": (0.25, 4.0)}),
)
BY_NAME = {v.name: v for v in VARIANTS}


def policy_for(variant: Variant) -> ControllerPolicy:
    """The simulator's controller with the variant's rule out."""
    config = dataclasses.replace(SIM_CONFIG, **variant.controller)
    policy = ControllerPolicy(config, max_scale=None)
    settings = config.request_settings(**variant.settings)
    rules = tuple(r for r in R.RULES if not isinstance(r, variant.drop))
    # the one seam the Reconciler offers for its request source, with the journal as the sizes Slurm ran
    policy.reconciler.requests = MeasuredRequests(settings, rules, sizes=policy.journal)
    return policy


def run(args: tuple[str, str, int]) -> dict[str, Any]:
    name, scenario, workload = args
    mode = scenario.split("+")[0]
    jobs = load_workload(TRACES / "workloads" / f"workload-{workload}.csv", adaptive=MODES[mode])
    policy = policy_for(BY_NAME[name])
    policy.max_scale = 2.0 if mode == "fixed" else None   # as simulate_targets: fixed 1 .. 2x, else the trace's
    failures = parse_failures(FAILURES if scenario.endswith("+failures") else None)
    t0 = time.perf_counter()
    try:
        result = Simulation(jobs, policy, SimConfig(parse_cluster("16x4"), failures=failures, immediate=False)).run()
    finally:
        policy.close()
    s = summarize(result)
    return {"variant": name, "scenario": scenario, "workload": workload, "avg_jct_s": round(float(s["avg_jct_s"]), 1),
            "restarts": int(s["restarts"]), "unfinished_jobs": len(result.unfinished),  # type: ignore[arg-type]
            # what the starvation rule and the share floor are for: no job waits long for its first GPUs
            "max_wait_s": round(max((j.wait_s for j in result.jobs if j.wait_s is not None), default=0.0), 1),
            "simulate_s": round(time.perf_counter() - t0, 1)}


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant: its JCT against the shipped controller's in each run, and whether the rule pays."""
    base = {(r["scenario"], r["workload"]): r for r in rows if r["variant"] == "shipped"}
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        if variant == "shipped":
            continue
        mine = [r for r in rows if r["variant"] == variant and (r["scenario"], r["workload"]) in base]
        for r in mine:
            r["vs_shipped_ratio"] = round(r["avg_jct_s"] / base[(r["scenario"], r["workload"])]["avg_jct_s"], 4)
        ratios = [r["vs_shipped_ratio"] for r in mine]
        if not ratios:
            continue
        by = {s: [r["vs_shipped_ratio"] for r in mine if r["scenario"] == s] for s in SCENARIOS}
        added = bool(BY_NAME[variant].adds)
        out.append({"variant": variant, "change": BY_NAME[variant].change,
                    **{f"{s}_mean_ratio": round(statistics.mean(v), 3) if v else None for s, v in by.items()},
                    "min_ratio": min(ratios), "max_ratio": max(ratios),
                    "max_wait_s": max(r["max_wait_s"] for r in mine),
                    "shipped_max_wait_s": max(base[(r["scenario"], r["workload"])]["max_wait_s"] for r in mine),
                    "restarts_vs_shipped_ratio": round(
                        sum(r["restarts"] for r in mine)
                        / max(1, sum(base[(r["scenario"], r["workload"])]["restarts"] for r in mine)), 3),
                    # a rule pays where the controller without it is slower on every run
                    "pays": all(x < 1.0 for x in ratios) if added else all(x > 1.0 for x in ratios)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="*", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--variants", nargs="*", default=[v.name for v in VARIANTS], choices=list(BY_NAME))
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--jobs", type=int, default=2, help="simulations at once (processes)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    variants = ["shipped", *(v for v in args.variants if v != "shipped")]
    work = [(v, s, w) for v in variants for s in args.scenarios for w in args.workloads]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = []
        for row in pool.map(run, work):
            rows.append(row)
            print(f"{row['variant']:22s} {row['scenario']:15s} w{row['workload']} {row['avg_jct_s']:8.0f} s "
                  f"{row['restarts']:4d} restarts ({row['simulate_s']:.0f} s)", file=sys.stderr, flush=True)
    verdicts = summarise(rows)
    if args.json:
        print_rows(rows + verdicts, True)
        return
    print_rows(rows, False, title="runs")
    print()
    print_rows(verdicts, False, title="variants against the shipped controller (ratio: variant / shipped)")


if __name__ == "__main__":
    main()
