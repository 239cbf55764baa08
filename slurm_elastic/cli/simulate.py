"""`slurm-elastic simulate`: replay a workload under the shipped controller and baselines."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from slurm_elastic.cli._common import echo_json, elastic_errors
from slurm_elastic.errors import TraceError
from slurm_elastic.settings import OBJECTIVE

RESTARTS = ("forward-layer", "traditional", "both")


@click.command()
@click.argument("workloads", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--policy", "policy_name", default="all", show_default=True,
              type=click.Choice(["controller", "static", "tiresias", "optimus", "all"]),
              help="Policy to replay under (controller: the shipped Reconciler, what a site runs).")
@click.option("--cluster", "cluster_spec", default="16x4", show_default=True,
              help="NODESxGPUS[:CPUS[:MEM_GB]], groups joined by commas (e.g. 8x4,4x8:64:512).")
@click.option("--interval", default=60.0, show_default=True, help="Scheduling interval in seconds.")
@click.option("--immediate/--ticks-only", default=True, show_default=True,
              help="Re-solve at once on arrivals, completions and node events, or only every interval "
                   "(as the Pollux simulator does).")
@click.option("--failures", default=None,
              help="Node failures: every:PERIOD_S:DOWN_S[:SEED], mtbf:MTBF_S:DOWN_S[:SEED], "
                   "or a CSV file time_s,node,down_s.")
@click.option("--restart", "restart_method", default="forward-layer", show_default=True,
              type=click.Choice(RESTARTS), help="Restart method (both: run each policy with each).")
@click.option("--restart-overhead", default=30.0, show_default=True, help="Seconds of no progress per (re)start.")
@click.option("--app-overhead", "app_overheads", multiple=True, metavar="APP=SECONDS",
              help="Restart overhead of one application (repeatable), e.g. --app-overhead imagenet=90.")
@click.option("--checkpoint-interval", default=1800.0, show_default=True,
              help="Seconds of running between periodic checkpoints.")
@click.option("--sync-checkpoint", default=30.0, show_default=True,
              help="Traditional method: seconds a full synchronous checkpoint stalls the job.")
@click.option("--wall-time", "wall_time", type=float, default=None,
              help="Seconds each incarnation of an elastic job may run: at this time limit it commits, "
                   "requeues itself and restarts at the policy's choice (default: no limit).")
@click.option("--format", "fmt", default="auto", show_default=True,
              type=click.Choice(["auto", "pollux", "generic", "sacct"]), help="Workload file format.")
@click.option("--applications", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Pollux application profiles (default: ../applications beside the workload).")
@click.option("--sacct-elastic", default="comment", show_default=True,
              type=click.Choice(["comment", "all", "none"]),
              help="sacct import: which jobs are elastic (elastic spec in Comment, every GPU job, none).")
@click.option("--adaptive", default="none", show_default=True, type=click.Choice(["none", "all", "half"]),
              help="Pollux workloads: which jobs adapt their batch by goodput (all: as in Pollux's runs; "
                   "half: every other job).")
@click.option("--max-scale", default=2.0, show_default=True,
              help="Elastic jobs declare at most this many times their requested GPUs (0: the trace's max).")
@click.option("--objective", default=OBJECTIVE.default, show_default=True, type=click.Choice(OBJECTIVE.choices),
              help="What the controller's allocator maximises (docs/allocator.md).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of result rows.")
@click.option("--markdown", is_flag=True, help="Print the table as Markdown.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write PNG plots (GPUs per job, JCT CDF, utilisation) under this folder.")
@click.option("--decisions", "decisions_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write every policy decision as JSON lines to this file.")
@click.option("--progress/--no-progress", default=True, help="Progress bar on stderr.")
@elastic_errors
def simulate(workloads: tuple[Path, ...], policy_name: str, cluster_spec: str, interval: float, immediate: bool,
             failures: str | None, restart_method: str, restart_overhead: float, app_overheads: tuple[str, ...],
             checkpoint_interval: float,
             sync_checkpoint: float, wall_time: float | None, fmt: str, applications: Path | None, sacct_elastic: str, adaptive: str, max_scale: float,
             objective: str,
             as_json: bool, markdown: bool, plot_dir: Path | None, decisions_path: Path | None, progress: bool) -> None:
    """Replay workload traces under the shipped controller and the baselines.

    WORKLOADS are Pollux workload CSVs, generic CSVs or sacct --parsable2
    exports (see docs/simulator.md). Every policy sees the same jobs,
    cluster and failures.

    \b
    Example:
      slurm-elastic simulate workload-1.csv --policy all --cluster 16x4
      slurm-elastic simulate w.csv --failures every:7200:600 --restart both
    """
    from slurm_elastic.sim import (POLICIES, RestartModel, SimConfig, Simulation, make_policy, parse_cluster,
                                   parse_failures, summarize)
    from slurm_elastic.sim.workload import load_any

    try:
        nodes = parse_cluster(cluster_spec)
        schedule = parse_failures(failures)
        methods = ("forward-layer", "traditional") if restart_method == "both" else (restart_method,)
        restarts = [RestartModel(m, restart_overhead, checkpoint_interval, sync_checkpoint) for m in methods]
        configs = [SimConfig(nodes, interval, r, schedule, immediate=immediate, wall_time_s=wall_time)
                   for r in restarts]
        gpn = max(n.gpus for n in nodes)
        per_app = _app_overheads(app_overheads)
        loaded = [(w, _with_overheads(load_any(w, fmt=fmt, applications=applications, gpus_per_node=gpn,
                                               sacct_elastic=sacct_elastic, adaptive=adaptive), per_app))
                  for w in workloads]
    except TraceError as exc:
        raise click.UsageError(str(exc)) from None
    names = POLICIES if policy_name == "all" else (policy_name,)
    rows = []
    results_by_workload = []
    decision_lines = []
    with _progress(progress) as bar:
        for path, jobs in loaded:
            results = []
            for config in configs:
                for name in names:
                    label = f"{path.name} {name}" + ("" if config.restart.method == "forward-layer"
                                                      else f" ({config.restart.method})")
                    task = bar.add_task(label, total=len(jobs)) if bar else None

                    def report(done: int, total: int, now: float, _task=task) -> None:
                        if bar is not None:
                            bar.update(_task, completed=done)

                    result = Simulation(jobs, make_policy(name, max_scale=max_scale, objective=objective), config, report).run()
                    if bar is not None:
                        bar.update(task, completed=len(jobs))
                    results.append(result)
                    row = {"workload": path.name, **summarize(result)}
                    rows.append(row)
                    for d in result.decisions:
                        decision_lines.append({"workload": path.name, "policy": name,
                                               "restart_method": config.restart.method, "time_s": d.time_s,
                                               "reasons": d.reasons, "changes": d.changes, "notes": d.notes,
                                               "solve_s": d.solve_s})
            results_by_workload.append((path, results))
    if decisions_path is not None:
        with decisions_path.open("w", encoding="utf-8") as handle:
            for line in decision_lines:
                handle.write(json.dumps(line) + "\n")
    if plot_dir is not None:
        from slurm_elastic.sim.plots import write_plots

        for path, results in results_by_workload:
            folder = plot_dir / path.stem if len(results_by_workload) > 1 else plot_dir
            write_plots(results, folder, title=path.stem)
    if as_json:
        echo_json(rows)
    elif markdown:
        click.echo(_markdown(rows))
    else:
        _table(rows)
    unfinished = [r for r in rows if r["finished"] < r["jobs"]]
    if unfinished:
        raise click.ClickException(f"{len(unfinished)} run(s) stopped at the time limit with jobs unfinished")


def _app_overheads(items: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for item in items:
        app, sep, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if not sep or not app or not math.isfinite(value) or value < 0:
            raise TraceError(f"bad --app-overhead {item!r} (expected APP=SECONDS, e.g. imagenet=90)")
        out[app] = value
    return out


def _with_overheads(jobs: list, per_app: dict[str, float]) -> list:
    """Jobs of the named applications get their own restart overhead."""
    if not per_app:
        return jobs
    from dataclasses import replace

    known = {j.application for j in jobs}
    unknown = sorted(set(per_app) - known)
    if unknown:
        raise TraceError(f"--app-overhead names application(s) not in the workload: {', '.join(unknown)} "
                         f"(it has {', '.join(sorted(a for a in known if a)) or 'no application names'})")
    return [replace(j, restart_overhead_s=per_app[j.application]) if j.application in per_app else j for j in jobs]


COLUMNS = (("workload", "workload", "{}"), ("policy", "policy", "{}"), ("restart", "restart_method", "{}"),
           ("avg JCT (s)", "avg_jct_s", "{:.0f}"), ("p99 JCT (s)", "p99_jct_s", "{:.0f}"),
           ("makespan (s)", "makespan_s", "{:.0f}"), ("GPU util", "gpu_util", "{:.1%}"),
           ("jobs/h", "jobs_per_hour", "{:.1f}"), ("restarts", "restarts", "{}"),
           ("restart loss", "restart_loss_share", "{:.2%}"), ("failures", "node_failures", "{}"),
           ("rigid wait (s)", "rigid_avg_wait_s", "{:.0f}"), ("rigid p95 wait (s)", "rigid_p95_wait_s", "{:.0f}"),
           ("rigid JCT (s)", "rigid_avg_jct_s", "{:.0f}"), ("elastic JCT (s)", "elastic_avg_jct_s", "{:.0f}"),
           ("sim s", "wall_s", "{:.1f}"))


def _cells(row: dict[str, object]) -> list[str]:
    out = []
    for _, key, fmt in COLUMNS:
        v = row[key]
        out.append("-" if isinstance(v, float) and math.isnan(v) else fmt.format(v))
    return out


def _markdown(rows: list[dict[str, object]]) -> str:
    lines = ["| " + " | ".join(c for c, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def _table(rows: list[dict[str, object]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for title, _, _ in COLUMNS:
        table.add_column(title, justify="left" if title in ("workload", "policy", "restart") else "right")
    for r in rows:
        table.add_row(*_cells(r))
    Console().print(table)


class _progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None

    def __enter__(self):  # type: ignore[no-untyped-def]
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("jobs"), TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        self.bar.__enter__()
        return self.bar

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
