"""`slurm-elastic demo`: the whole method on the embedded local cluster."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from slurm_elastic.cli._common import echo_json
from slurm_elastic.demo.live import LiveView, PlainView, RichView
from slurm_elastic.demo.report import COLUMNS, table_rows
from slurm_elastic.demo.scenario import Demo, DemoError, DemoOptions, DemoResult, prepare_report_dir
from slurm_elastic.devcluster.layout import CLUSTER_DIR_ENV


@click.command()
@click.option("--report-dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("slurm-elastic-demo-report"), show_default=True,
              help="Where the report (index.html, timeline.png, summary.json) and the run's logs go.")
@click.option("--keep", is_flag=True, help="Leave the local cluster up afterwards if the demo started it.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (the live view goes to stderr).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help=f"The local cluster's state directory [default: ${CLUSTER_DIR_ENV}, else "
                   "$XDG_STATE_HOME/slurm-elastic/cluster].")
@click.option("--port-base", type=click.IntRange(1024, 65000), default=None,
              help="slurmctld's port when the demo starts the cluster (nodes use the ports after it).")
@click.option("--interval", type=click.FloatRange(0.5, 60), default=2.0, show_default=True,
              help="The controller's cycle, seconds.")
@click.option("--timeout", type=click.FloatRange(10, 3600), default=150.0, show_default=True,
              help="Seconds each waiting step may take before the demo gives up (with the reason and the logs).")
@click.option("--settle", type=click.FloatRange(0, 120), default=6.0, show_default=True,
              help="Seconds without job changes after which the controller counts as done acting.")
@click.option("--min-steps", type=click.IntRange(1, 10000), default=5, show_default=True,
              help="Training steps each job must make after every event.")
@click.option("--mark-down", is_flag=True,
              help="Also mark the lost node DOWN at once, as an admin would (skips Slurm's ~30 s timeout).")
@click.option("--node", default=None, help="The node to lose [default: the last node of the largest job].")
@click.option("--spare", default=None, help="The spare node to start [default: the first stopped spare].")
@click.option("--plain", is_flag=True, help="Log lines instead of the live view, even on a terminal.")
def demo(report_dir: Path, keep: bool, as_json: bool, state_dir: Path | None, port_base: int | None,
         interval: float, timeout: float, settle: float, min_steps: int, mark_down: bool, node: str | None,
         spare: str | None, plain: bool) -> None:
    """Run three elastic jobs on the local cluster, lose and gain a node, and report.

    Starts the local Slurm cluster if none is up (and stops it afterwards
    unless --keep), runs the controller daemon, submits three elastic
    training jobs with `slurm-elastic sbatch` and the DDP job template, waits
    until they train, kills a node, waits for the re-solve and the resumed
    training, starts a spare node, waits for the jobs to grow, then stops
    everything it started and writes the report. Needs root (the local
    cluster runs slurmd as root); takes 3-5 minutes on a small machine.

    \b
    Examples:
      sudo slurm-elastic demo
      slurm-elastic demo --keep --report-dir /tmp/demo
      slurm-elastic demo --json --mark-down > summary.json
    """
    report_dir = report_dir.expanduser().resolve()
    try:
        prepare_report_dir(report_dir)
    except DemoError as exc:
        raise click.UsageError(str(exc)) from None
    options = DemoOptions(report_dir=report_dir, state_dir=state_dir, keep=keep, port_base=port_base,
                          interval_s=interval, settle_s=settle, min_steps=min_steps, mark_down=mark_down,
                          node=node, spare=spare, start_timeout_s=timeout, recover_timeout_s=timeout,
                          grow_timeout_s=timeout)
    out = sys.stderr if as_json else sys.stdout
    view = _view(out, plain=plain)
    try:
        result = Demo(options, on_update=view.update).run()
    except DemoError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        view.close()
    _finish(result, as_json)


def _view(out: object, *, plain: bool) -> LiveView:
    if not plain and getattr(out, "isatty", lambda: False)():
        from rich.console import Console

        return RichView(Console(file=out))  # type: ignore[arg-type]
    return PlainView(lambda line: click.echo(line, file=out))  # type: ignore[arg-type]


def _finish(result: DemoResult, as_json: bool) -> None:
    summary = result.summary
    problems = summary.problems()
    if as_json:
        body = summary.to_json()
        body["report"] = {"directory": str(result.files.directory), "html": str(result.files.html),
                          "png": str(result.files.png), "summary": str(result.files.summary),
                          "timeline": str(result.files.timeline)}
        body["error"] = result.error
        echo_json(body)
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"slurm-elastic demo: {summary.wall_s:.0f} s")
        for col in COLUMNS:
            table.add_column(col)
        for row in table_rows(summary):
            table.add_row(*(row[c] for c in COLUMNS))
        # Not a terminal (a log, a pipe): wide enough that the table's cells do not wrap into columns of words.
        console = Console() if sys.stdout.isatty() else Console(width=200)
        console.print(table)
        for event in summary.events:
            seen = "" if event.slurm_t is None else f"; Slurm showed it at {event.slurm_t:.1f} s"
            click.echo(f"  {event.label} at {event.t:.1f} s{seen}")
        for restart in summary.restart_phases:
            click.echo(f"  {restart['job']}: {restart['line']}")
        click.echo(f"report: {result.files.html} (plot {result.files.png})")
        if not problems and result.error is None:
            click.echo("checks: each job restarted at most twice, no step lost on signalled restarts, "
                       "every job trained after each node event")
    if result.error is not None:
        raise click.ClickException(f"the demo stopped early: {result.error}")
    if problems:
        raise click.ClickException("checks failed: " + "; ".join(problems))

