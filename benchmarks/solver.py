"""Allocator benchmark: solve time, MIP gap and objective vs an Optimus-style greedy on synthetic clusters.

    python3 benchmarks/solver.py                 # table
    python3 benchmarks/solver.py --json          # one JSON object per case
    python3 benchmarks/solver.py --cases small --runs 1

Each case is a cluster after a node event: the previous allocation (a greedy
solve of the cluster before it) is the current one, then 2 % of the nodes go
down and 10 % new jobs arrive, so the solver has warm starts and restart
costs to weigh, as in a real reconcile cycle. "steady" is the cycle after
"medium" with nothing changed. Nodes: 64 CPUs and 512 GB per 8 GPUs (mixed:
a third 4-GPU/32-CPU/256 GB, a third 8-GPU/128-CPU/1 TB); a quarter of the
nodes carry some non-elastic work. Jobs: 1-64 GPUs, some with a step or
power-of-two-like counts, 2-8 CPUs and 16-48 GB per GPU, linear or table
throughput models.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time
from dataclasses import replace

from slurm_elastic.allocate import (AllocationProblem, JobRequest, LinearThroughput, NodeCapacity, Policy,
                                    greedy_baseline, repair, solve, table_throughput)
from slurm_elastic.allocate.instance import Instance
from slurm_elastic.allocate.repair import with_current

CASES = {
    "small": dict(jobs=100, nodes=64, gpn=8, mixed=False),
    "medium": dict(jobs=1_000, nodes=512, gpn=8, mixed=False),
    "large": dict(jobs=5_000, nodes=2_048, gpn=8, mixed=False),
    "mixed": dict(jobs=1_000, nodes=512, gpn=8, mixed=True),
    # the next cycle after "medium" with nothing changed: the warm start is the answer
    "steady": dict(jobs=1_000, nodes=512, gpn=8, mixed=False, steady=True),
    # "medium" on a site of 4 partitions of 128 nodes, each job in one: solved pool by pool (allocate/pools.py)
    "partitioned": dict(jobs=1_000, nodes=512, gpn=8, mixed=False, partitions=4),
    # the largest sites (issue 30's sizes); only when named: generating the cycle before takes minutes
    "xlarge": dict(jobs=10_000, nodes=4_096, gpn=8, mixed=False),
    "huge": dict(jobs=10_000, nodes=16_384, gpn=8, mixed=False),
    "giant": dict(jobs=10_000, nodes=100_000, gpn=8, mixed=False),
}
DEFAULT_CASES = ("small", "medium", "large", "mixed", "steady", "partitioned")


def make_problem(jobs: int, nodes: int, gpn: int, mixed: bool, seed: int = 0,
                 policy: Policy | None = None, memory_bound: bool = False, partitions: int = 1) -> AllocationProblem:
    """`memory_bound`: 256 GB per 8 GPUs and 48-96 GB per GPU asked, so memory runs out before GPUs.
    `partitions` > 1: the nodes in that many equal blocks, each job allowed one block (its partition)."""
    rng = random.Random(seed)
    caps = []
    for n in range(nodes):
        if mixed and n % 3 == 0:
            g, c, m = 4, 32, 256_000          # older 4-GPU nodes
        elif mixed and n % 3 == 1:
            g, c, m = 8, 128, 1_024_000
        else:
            g, c, m = gpn, 64, 256_000 if memory_bound else 512_000
        if rng.random() < 0.25:               # non-elastic work on a quarter of the nodes
            used = rng.randint(1, g)
            g, c, m = g - used, max(c - used * rng.choice((4, 8)), 0), max(m - used * 48_000, 0)
        caps.append(NodeCapacity(f"node{n:05d}", g, c, m))
    reqs = []
    for j in range(jobs):
        lo = rng.choice((1, 1, 2, 4, 8))
        hi = min(lo * rng.choice((1, 2, 4, 8)), 64)
        step = 1 if lo < 4 or rng.random() < 0.5 else lo
        hi -= hi % step
        model = (LinearThroughput(per_gpu=rng.uniform(50, 200), node_penalty=rng.uniform(0.0, 0.15))
                 if rng.random() < 0.7 else
                 table_throughput({g: 100 * g ** rng.uniform(0.6, 0.95) for g in (1, 2, 4, 8, 16, 32, 64)}))
        reqs.append(JobRequest(
            key=f"job{j:05d}", min_gpus=lo, max_gpus=hi, gpu_step=step,
            cpus_per_gpu=rng.choice((2, 4, 6, 8)),
            mem_per_gpu_mb=rng.choice((48_000, 64_000, 96_000) if memory_bound else (16_000, 32_000, 48_000)),
            weight=round(rng.uniform(0.5, 2.0), 2), restart_cost_s=rng.uniform(10, 120), throughput=model,
            allowed_gpus=(1, 2, 4, 8, 16, 24, 32, 48, 64) if rng.random() < 0.3 else None))
    blocks = [frozenset(c.name for c in caps[b * nodes // partitions:(b + 1) * nodes // partitions])
              for b in range(partitions)] if partitions > 1 else [None]
    if partitions > 1:
        reqs = [replace(r, allowed_nodes=rng.choice(blocks)) for r in reqs]
    base = AllocationProblem(tuple(reqs), tuple(caps), policy or Policy())
    # the previous cycle: 90 % of the jobs existed and got a greedy allocation (in their partitions)
    current: dict[str, dict[str, int]] = {}
    for block in blocks:
        pool = tuple(c for c in caps if block is None or c.name in block)
        mine = tuple(replace(r, allowed_nodes=None) for r in reqs[: int(jobs * 0.9)] if r.allowed_nodes == block)
        rows, _ = greedy_baseline(AllocationProblem(mine, pool, base.policy))
        names = [c.name for c in pool]
        current.update({r.key: {names[n]: g for n, g in rows[i].items()} for i, r in enumerate(mine)})
    down = set(rng.sample(range(nodes), max(1, nodes // 50)))
    caps = [NodeCapacity(c.name, 0, 0, 0) if n in down else c for n, c in enumerate(caps)]
    reqs = [replace(r, current=current.get(r.key, {})) for r in reqs]
    return AllocationProblem(tuple(reqs), tuple(caps), base.policy)


def _greedy_objective(problem: AllocationProblem) -> float:
    """The greedy baseline's objective; with partitions, one greedy per partition on its nodes (summed)."""
    groups: dict[frozenset[str] | None, list[JobRequest]] = {}
    for job in problem.jobs:
        groups.setdefault(job.allowed_nodes, []).append(replace(job, allowed_nodes=None))
    total = 0.0
    for nodes, jobs in groups.items():
        pool = tuple(n for n in problem.nodes if nodes is None or n.name in nodes)
        total += greedy_baseline(AllocationProblem(tuple(jobs), pool, problem.policy))[1]
    return total


def run_case(name: str, runs: int, policy: Policy) -> dict[str, object]:
    spec = dict(CASES[name])
    steady = spec.pop("steady", False)
    problem = make_problem(**spec, seed=1, policy=policy)
    if steady:
        previous = solve(problem)
        problem = AllocationProblem(tuple(replace(j, current=dict(previous.placement[j.key])) for j in problem.jobs),
                                    problem.nodes, problem.policy)
    t0 = time.perf_counter()
    greedy_obj = _greedy_objective(problem)
    greedy_s = time.perf_counter() - t0
    times, cpu, last = [], [], None
    for _ in range(runs):
        c0 = time.process_time()
        last = solve(problem)
        cpu.append(time.process_time() - c0)
        times.append(last.solve_s)
    assert last is not None
    inst = Instance(problem)
    bad = inst.violations([{inst.node_index[n]: g for n, g in last.placement[j.key].items()} for j in problem.jobs])
    return {
        "case": name,
        "jobs": spec["jobs"],
        "nodes": spec["nodes"],
        "gpus_per_node": spec["gpn"] if not spec["mixed"] else "4/8 mixed",
        "steady": steady,
        "partitions": spec.get("partitions", 1),
        "gpus_free": int(sum(n.gpus for n in problem.nodes)),
        "gpus_demanded": int(sum(j.max_gpus for j in problem.jobs)),
        "method": last.method,
        "status": last.status,
        "solve_s": round(statistics.median(times), 3),
        "solve_s_runs": [round(t, 3) for t in times],
        "solve_cpu_s": round(statistics.median(cpu), 3),   # CPU time of this process (all its threads)
        "load_avg_1m": round(os.getloadavg()[0], 1),       # other engineers share these 2 cores
        "mip_gap": round(last.mip_gap, 5),
        "objective": round(last.objective, 4),
        "bound": round(last.bound, 4),
        "greedy_objective": round(greedy_obj, 4),
        "greedy_s": round(greedy_s, 3),
        "objective_ge_greedy": last.objective >= greedy_obj - 1e-9,
        "placement_violations": len(bad),
        "jobs_changed": sum(1 for d in last.decisions if d.gpus_before != d.gpus_after),
        # this process's peak so far (the generator's greedy cycle included): what the solve needs is below it
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }


SMALL_SIZES = ((10, 8, False), (20, 16, False), (40, 24, False), (60, 40, False), (100, 64, False),
               (20, 8, True), (20, 16, True), (30, 16, True), (40, 24, True), (60, 40, True), (90, 64, True))
SMALL_MODES = ("exact", "neighbourhood", "two-stage", "auto")


def exact_vs_two_stage(policy: Policy, seeds: list[int]) -> list[dict[str, object]]:
    """Every solve mode, and what auto picks, on small clusters (under 100 jobs), one row per cluster and seed."""
    rows = []
    for jobs, nodes, memory_bound in SMALL_SIZES:
        for seed in seeds:
            problem = make_problem(jobs, nodes, 8, False, seed=seed, policy=policy, memory_bound=memory_bound)
            row: dict[str, object] = {"jobs": jobs, "nodes": nodes, "memory_bound": memory_bound, "seed": seed,
                                      "pairs": jobs * nodes}
            for mode in SMALL_MODES:
                c0 = time.process_time()
                a = solve(problem, mode=mode)
                row[f"{mode}_cpu_s"] = round(time.process_time() - c0, 3)
                row[f"{mode}_solve_s"] = round(a.solve_s, 3)
                row[f"{mode}_objective"] = round(a.objective, 4)
                row[f"{mode}_gap"] = round(a.mip_gap, 4)
                row[f"{mode}_status"] = a.status
                row[f"{mode}_bound"] = round(a.bound, 4)
            if row["exact_status"] in ("optimal", "within-gap"):
                # the exact model finished: its bound is the optimum within its gap, so auto's true gap is at most this
                row["auto_true_gap_at_most"] = round(max(row["exact_bound"] - row["auto_objective"], 0.0)
                                                     / max(abs(row["auto_objective"]), 1e-9), 4)
            rows.append(row)
    return rows


def small_summary(rows: list[dict[str, object]]) -> list[str]:
    """Auto's worst CPU time, and its objective against the exact model's, over every row."""
    worst = max(rows, key=lambda r: r["auto_cpu_s"])
    lines = [f"auto: slowest {worst['auto_cpu_s']:.2f} s CPU ({worst['jobs']} x {worst['nodes']}"
             f"{' mem' if worst['memory_bound'] else ''}, seed {worst['seed']}) over {len(rows)} clusters"]
    known = [r["auto_true_gap_at_most"] for r in rows if "auto_true_gap_at_most" in r]
    if known:
        lines.append(f"auto's true gap (to the bound of an exact model that finished, {len(known)} of {len(rows)}): "
                     f"at most {statistics.mean(known):.2%} on average, {max(known):.2%} at worst")
    for mode in ("neighbourhood", "two-stage", "auto"):
        rel = [(r[f"{mode}_objective"] - r["exact_objective"]) / max(abs(r["exact_objective"]), 1e-9) for r in rows]
        lines.append(f"{mode} against exact: objective {statistics.mean(rel):+.2%} on average, worst {min(rel):+.2%}, "
                     f"best {max(rel):+.2%}; below it on {sum(1 for v in rel if v < -1e-6)} of {len(rel)}")
    return lines


# The warm path's sizes: jobs x nodes x 8 GPUs
WARM_SIZES = {"medium": (1_000, 512), "large": (5_000, 2_048), "huge": (10_000, 16_384)}


def warm_rows(sizes: list[str], policy: Policy) -> list[dict[str, object]]:
    """After one node event, the full solve and `repair` side by side on the same problem.

    The cycle before: the benchmark's cluster, solved in full, its answer carried out. Then "lost": the
    node holding the most jobs goes; "gained": one of the down nodes comes back (8 GPUs, 64 CPUs, 512 GB).
    Both answers are scored with the same Instance.objective, outside the timed part.
    """
    rows = []
    for size in sizes:
        jobs, nodes = WARM_SIZES[size]
        problem = make_problem(jobs, nodes, 8, False, seed=1, policy=policy)
        before = with_current(problem, solve(problem))
        busiest = max(_holders(before).items(), key=lambda kv: (kv[1], kv[0]))[0]
        down = next(n.name for n in before.nodes if n.gpus == 0)
        events = {
            "lost": replace(before, nodes=tuple(n for n in before.nodes if n.name != busiest)),
            "gained": replace(before, nodes=tuple(NodeCapacity(n.name, 8, 64, 512_000) if n.name == down else n
                                                  for n in before.nodes)),
        }
        for event, after in events.items():
            row: dict[str, object] = {"size": size, "jobs": jobs, "nodes": nodes, "event": event}
            inst = Instance(after)
            for path, run in (("full", solve), ("repair", repair)):
                c0 = time.process_time()
                answer = run(after)
                row[f"{path}_cpu_s"] = round(time.process_time() - c0, 3)
                placed = [{inst.node_index[n]: g for n, g in answer.placement[j.key].items()} for j in after.jobs]
                row[f"{path}_objective"] = round(inst.objective(placed), 4)
                row[f"{path}_jobs_changed"] = sum(1 for j in after.jobs if answer.placement[j.key] != dict(j.current))
                row[f"{path}_placement_violations"] = len(inst.violations(placed))
                row[f"{path}_status"] = answer.status
                if path == "full":
                    row["full_bound"] = round(answer.bound, 4)
            bound = float(row["full_bound"])
            for path in ("full", "repair"):
                row[f"{path}_gap_to_bound"] = round(max(bound - float(row[f"{path}_objective"]), 0.0) / bound, 5)
            row["load_avg_1m"] = round(os.getloadavg()[0], 1)
            rows.append(row)
    return rows


def _holders(problem: AllocationProblem) -> dict[str, int]:
    count: dict[str, int] = {}
    for job in problem.jobs:
        for name in job.current:
            count[name] = count.get(name, 0) + 1
    return count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES),
                    help="comma-separated: " + ", ".join(CASES) + " (default: all but xlarge, huge and giant)")
    ap.add_argument("--runs", type=int, default=3, help="solves per case (median reported)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="wall-clock cap, s (0: none)")
    ap.add_argument("--max-nodes", type=int, default=Policy().max_nodes,
                    help="branch-and-bound node limit (the repeatable stop)")
    ap.add_argument("--gap", type=float, default=0.01)
    ap.add_argument("--no-lp-certificate", action="store_true",
                    help="always run branch-and-bound on the counts MILP (Policy.lp_certificate=False)")
    ap.add_argument("--exact-vs-two-stage", action="store_true",
                    help="every solve mode (exact, neighbourhood, two-stage, auto) on small clusters")
    ap.add_argument("--seeds", type=int, default=0,
                    help="with --exact-vs-two-stage: generator seeds 0..N-1 per cluster (default: seed 2 only)")
    ap.add_argument("--warm", metavar="SIZES", nargs="?", const="medium,large,huge",
                    help="after one node lost and one gained: the full solve and the warm path (repair) side by "
                         "side; sizes from " + ", ".join(WARM_SIZES) + " (default all)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    policy = Policy(time_limit_s=args.time_limit or None, max_nodes=args.max_nodes, mip_rel_gap=args.gap,
                    lp_certificate=not args.no_lp_certificate)
    if args.warm:
        sizes = args.warm.split(",")
        unknown = [s for s in sizes if s not in WARM_SIZES]
        if unknown:
            print(f"unknown --warm size {unknown[0]!r}; known: {', '.join(WARM_SIZES)}", file=sys.stderr)
            return 2
        rows = warm_rows(sizes, policy)
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        print(f"{'jobs x nodes x 8':<20} {'event':<7} {'path':<7} {'cpu_s':>7} {'objective':>11} {'gap to bound':>12} "
              f"{'changed':>7} {'violations':>10} {'status':<18} {'load':>5}")
        for r in rows:
            for path in ("full", "repair"):
                print(f"{r['jobs']:,} x {r['nodes']:,}".ljust(20) + f" {r['event']:<7} {path:<7} "
                      f"{r[path + '_cpu_s']:>7.3f} {r[path + '_objective']:>11.2f} {r[path + '_gap_to_bound']:>12.3%} "
                      f"{r[path + '_jobs_changed']:>7} {r[path + '_placement_violations']:>10} "
                      f"{r[path + '_status']:<18} {r['load_avg_1m']:>5}")
        return 0
    if args.exact_vs_two_stage:
        rows = exact_vs_two_stage(policy, list(range(args.seeds)) if args.seeds else [2])
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        print(f"{'jobs x nodes':<13} {'seed':>4} {'pairs':>6}  " + " ".join(f"{m:<38}" for m in SMALL_MODES)
              + " auto true gap <=")
        for r in rows:
            cells = [f"{r[m + '_cpu_s']:.2f}s {r[m + '_objective']:.3f} {r[m + '_gap']:.2%} {r[m + '_status']}"
                     for m in SMALL_MODES]
            size = f"{r['jobs']} x {r['nodes']}" + (" mem" if r["memory_bound"] else "")
            true_gap = f"{r['auto_true_gap_at_most']:.2%}" if "auto_true_gap_at_most" in r else "-"
            print(f"{size:<13} {r['seed']:>4} {r['pairs']:>6}  " + " ".join(f"{c:<38}" for c in cells)
                  + f" {true_gap:>8}", flush=True)
        print("\n".join(small_summary(rows)))
        return 0
    rows = []
    header = (f"{'case':<7} {'jobs x nodes x GPUs':<22} {'free':>6} {'status':<22} {'solve_s':>8} {'cpu_s':>7} "
              f"{'gap':>7} {'objective':>10} {'greedy':>10} {'greedy_s':>8} {'>=greedy':>8} {'changed':>7} "
              f"{'load':>5} {'rss_MiB':>7}")
    if not args.json:
        print(header)
    for name in args.cases.split(","):
        if name not in CASES:
            print(f"unknown case {name!r}; known: {', '.join(CASES)}", file=sys.stderr)
            return 2
        rows.append(run_case(name, args.runs, policy))
        if not args.json:
            r = rows[-1]
            size = f"{r['jobs']} x {r['nodes']} x {r['gpus_per_node']}"
            print(f"{r['case']:<7} {size:<22} {r['gpus_free']:>6} {r['status']:<22} {r['solve_s']:>8.3f} "
                  f"{r['solve_cpu_s']:>7.3f} {r['mip_gap']:>7.2%} {r['objective']:>10.2f} "
                  f"{r['greedy_objective']:>10.2f} {r['greedy_s']:>8.2f} {str(r['objective_ge_greedy']):>8} "
                  f"{r['jobs_changed']:>7} {r['load_avg_1m']:>5} {r['peak_rss_mib']:>7}", flush=True)
            if r["placement_violations"]:
                print(f"  !! {r['placement_violations']} placement rule(s) broken", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
