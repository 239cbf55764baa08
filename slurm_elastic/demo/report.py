"""The demo's report: the summary table's rows, the timeline plot (PNG) and an HTML page embedding both."""

from __future__ import annotations

import base64
import html
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from slurm_elastic.demo.summary import DemoSummary, JobSummary, NodeEvent
from slurm_elastic.demo.timeline import NODE_LOST, NodeSeen, Timeline

log = logging.getLogger(__name__)

PNG_NAME = "timeline.png"
HTML_NAME = "index.html"
SUMMARY_NAME = "summary.json"
TIMELINE_NAME = "timeline.jsonl"

COLUMNS = ("job", "GPU range", "GPUs over time", "restarts", "steps lost per restart",
           "node loss -> training again", "node gain -> training again", "final step")

# One colour per job, and the node-event colours, shared by the plot and the HTML.
_JOB_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")
_LOST_COLOUR = "#d62728"
_GAINED_COLOUR = "#17becf"


@dataclass(frozen=True, slots=True)
class ReportFiles:
    directory: Path
    png: Path
    html: Path
    summary: Path
    timeline: Path


def table_rows(summary: DemoSummary) -> list[dict[str, str]]:
    """One row per job, keyed by COLUMNS, as text (the CLI table and the HTML page show the same)."""
    rows = []
    for job in summary.jobs:
        lost = []
        for r in job.restarts:
            how = "signalled" if r.signalled else "not signalled"
            lost.append(f"{'?' if r.steps_lost is None else r.steps_lost} ({how}, {r.cause})")
        rows.append({
            "job": f"{job.name} ({job.job})",
            "GPU range": f"{job.min_gpus}-{job.max_gpus}",
            "GPUs over time": " -> ".join(str(g) for g in job.gpu_sequence) or "-",
            "restarts": str(len(job.restarts)),
            "steps lost per restart": "; ".join(lost) or "-",
            "node loss -> training again": _recovery(job, summary.events, NODE_LOST),
            "node gain -> training again": _recovery(job, summary.events, "node_gained"),
            "final step": str(job.final_step),
        })
    return rows


def _recovery(job: JobSummary, events: tuple[NodeEvent, ...], action: str) -> str:
    parts = []
    for event, after in zip(events, job.after_events):
        if event.action != action:
            continue
        if not after.restarted:
            parts.append("kept training" if after.trained_after else "stopped")
        elif after.recovery_s is None:
            parts.append("did not resume")
        else:
            parts.append(f"{after.recovery_s:.1f} s")
    return "; ".join(parts) or "-"


def plot_timeline(timeline: Timeline, summary: DemoSummary, path: Path) -> None:
    """GPUs per job over time (a fixed band each), their total against available GPUs, training steps, node events."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(summary.wall_s, 1.0)
    fig, (top, total, bottom) = plt.subplots(3, 1, figsize=(13, 9), sharex=True,
                                             gridspec_kw={"height_ratios": [3, 1.2, 2]})
    times, held = _gpus_on_grid(summary, end)
    colours = [_JOB_COLOURS[i % len(_JOB_COLOURS)] for i in range(len(summary.jobs))]
    # Each job keeps its own band (as tall as its largest size), so a job that waits at 0 GPUs does not
    # move the others: a stacked plot would restack them and untouched jobs would look as if they shrank.
    ticks = []
    for i, (job, (base, height, values)) in enumerate(zip(summary.jobs, job_bands(summary.jobs, held))):
        top.fill_between(times, base, [base + v for v in values], step="post", color=colours[i], alpha=0.85,
                         label=f"{job.name} ({job.min_gpus}-{job.max_gpus} GPUs)")
        top.axhline(base + height, color="grey", linewidth=0.5)
        ticks.append((base + height / 2, job.name))
    base = sum(height for _, height, _ in job_bands(summary.jobs, held))
    top.set_yticks([t for t, _ in ticks], [name for _, name in ticks])
    top.set_ylim(0, max(base, 1))
    top.set_ylabel("GPUs held (one band per job)")
    if held:
        top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    cap_t, cap = _capacity(timeline, end)
    if held:
        total.step(times, [sum(col) for col in zip(*held)], where="post", color="black", label="GPUs held by the jobs")
    if cap_t:
        total.step(cap_t, cap, where="post", color="black", linewidth=1.5, linestyle="--",
                   label="GPUs on available nodes")
        total.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    total.set_ylim(0, max([*cap, *(sum(col) for col in zip(*held))], default=1) + 2)
    total.set_ylabel("GPUs")
    total.grid(axis="y", alpha=0.3)
    top.set_title("slurm-elastic demo: GPUs per job over time, node events marked")
    top.grid(axis="y", alpha=0.3)
    _training_lanes(bottom, summary, colours)
    for event in summary.events:
        colour = _LOST_COLOUR if event.action == NODE_LOST else _GAINED_COLOUR
        for ax in (top, total, bottom):
            ax.axvline(event.t, color=colour, linewidth=2)
            if event.slurm_t is not None and event.slurm_t - event.t > 0.5:
                ax.axvline(event.slurm_t, color=colour, linewidth=1, linestyle=":")
        seen = "" if event.slurm_t is None else f" (Slurm: +{event.slurm_t - event.t:.0f} s)"
        top.annotate(f"{event.label}{seen}", xy=(event.t, 1.0), xycoords=("data", "axes fraction"),
                     xytext=(3, -12), textcoords="offset points", color=colour, fontsize=9, fontweight="bold")
    bottom.set_xlim(0, end)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _training_lanes(ax: object, summary: DemoSummary, colours: list[str]) -> None:
    """One lane per job: a bar for each run while it trained (its GPUs and steps), gaps while it restarted."""
    n = len(summary.jobs)
    late = 0.7 * max(summary.wall_s, 1.0)   # labels of bars that start this late end at the bar instead
    for i, job in enumerate(summary.jobs):
        y = n - 1 - i
        for run in job.runs:
            if not run.rows:
                continue
            start, end = run.rows[0].t, run.rows[-1].t
            ax.broken_barh([(start, max(end - start, 0.5))], (y - 0.3, 0.6), color=colours[i], alpha=0.85)
            ax.annotate(f"{run.gpus} GPUs, steps {run.rows[0].step}-{run.rows[-1].step}",
                        xy=(end if start > late else start, y + 0.32), fontsize=7, va="bottom",
                        ha="right" if start > late else "left", color="black")
        for r in job.restarts:
            if r.resumed_at is None or r.resumed_from is None:
                continue
            lost = "?" if r.steps_lost is None else str(r.steps_lost)
            marker, fill = ("o", "white") if r.signalled else ("X", colours[i])
            ax.plot([r.resumed_at], [y], marker=marker, markersize=9, color="black", markerfacecolor=fill)
            ax.annotate(f"from {r.resumed_from}, lost {lost}", xy=(r.resumed_at, y - 0.32), fontsize=7,
                        va="top", ha="right")
    ax.set_yticks(range(n), [j.name for j in reversed(summary.jobs)])
    ax.set_ylim(-0.8, max(n, 1) - 0.2)
    ax.set_ylabel("training")
    ax.set_xlabel("seconds since the demo started")
    ax.grid(axis="x", alpha=0.3)
    ax.plot([], [], marker="o", linestyle="none", color="black", markerfacecolor="white",
            label="resumed after a signalled checkpoint")
    ax.plot([], [], marker="X", linestyle="none", color="black", markerfacecolor="grey",
            label="resumed from a periodic checkpoint")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def job_bands(jobs: tuple[JobSummary, ...] | list[JobSummary],
              held: list[list[int]]) -> list[tuple[int, int, list[int]]]:
    """(base, height, GPUs held over time) of each job's fixed band: bases depend on sizes, never on time.

    The first job's band is on top, as its lane is in the training panel below.
    """
    bands = []
    base = 0
    for job, values in reversed(list(zip(jobs, held))):
        height = max(job.max_gpus, max(values, default=0), 1)
        bands.append((base, height, values))
        base += height
    return bands[::-1]


def _gpus_on_grid(summary: DemoSummary, end: float) -> tuple[list[float], list[list[int]]]:
    """A common time grid of every job's GPU changes, and each job's GPUs on it (for step plots)."""
    changes = sorted({t for job in summary.jobs for t, _ in job.gpus_over_time} | {0.0, end})
    grid = []
    for job in summary.jobs:
        values = []
        for t in changes:
            held = [g for when, g in job.gpus_over_time if when <= t]
            values.append(held[-1] if held else 0)
        grid.append(values)
    return changes, grid


def _capacity(timeline: Timeline, end: float) -> tuple[list[float], list[int]]:
    """GPUs of the nodes Slurm shows available, over time (the dashed line)."""
    nodes: dict[str, int] = {}
    times: list[float] = []
    totals: list[int] = []
    for seen in timeline.of(NodeSeen):
        nodes[seen.node] = seen.gpus if seen.available else 0
        total = sum(nodes.values())
        if times and times[-1] == seen.t:
            totals[-1] = total
        elif not totals or totals[-1] != total:
            times.append(seen.t)
            totals.append(total)
    if times:
        times.append(end)
        totals.append(totals[-1])
    return times, totals


def render_html(summary: DemoSummary, png: Path | None) -> str:
    rows = table_rows(summary)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(r[c])}</td>" for c in COLUMNS) + "</tr>" for r in rows)
    events = "".join(
        f"<li>{e.t:.1f} s: {html.escape(e.label)}"
        + ("" if e.slurm_t is None else f" (Slurm showed it at {e.slurm_t:.1f} s)") + "</li>"
        for e in summary.events)
    phases = "".join(f"<li>{html.escape(k)}: {v:.1f} s</li>" for k, v in summary.phases.items())
    restarts = "".join(f"<li>{html.escape(str(r['job']))}: {html.escape(str(r['line']))}</li>"
                       for r in summary.restart_phases) or "<li>none</li>"
    problems = summary.problems()
    verdict = ("<p class='ok'>All checks passed: each job restarted at most twice, no step lost on signalled "
               "restarts, every job trained after each node event.</p>" if not problems else
               "<p class='bad'>Checks failed:</p><ul>" + "".join(f"<li>{html.escape(p)}</li>" for p in problems)
               + "</ul>")
    image = ""
    if png is not None and png.is_file():
        data = base64.b64encode(png.read_bytes()).decode()
        image = f"<img alt='GPUs per job over time' src='data:image/png;base64,{data}'>"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>slurm-elastic demo report</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1200px; }}
table {{ border-collapse: collapse; }} th, td {{ border: 1px solid #bbb; padding: 4px 8px; text-align: left; }}
th {{ background: #eee; }} img {{ max-width: 100%; }} .ok {{ color: #2a7a2a; }} .bad {{ color: #b00; }}
</style></head><body>
<h1>slurm-elastic demo</h1>
<p>Three elastic training jobs on a local Slurm cluster; one node is lost, then a spare node is gained.
The controller re-solves the L1 allocation after each event and requeues the jobs whose size changes;
the training shim resumes each from its last forward-layer checkpoint. Wall time {summary.wall_s:.1f} s.</p>
{image}
<h2>Summary</h2>
<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
{verdict}
<h2>Node events</h2><ul>{events}</ul>
<h2>The controller's restarts, phase by phase</h2><ul>{restarts}</ul>
<h2>Phases of the demo</h2><ul>{phases}</ul>
<p>Steps lost per restart = the last step the job had reached before the restart minus the checkpoint step
it resumed from (from the shim's metrics rows and acknowledgements). The machine-readable numbers are in
<code>{SUMMARY_NAME}</code>, every observation in <code>{TIMELINE_NAME}</code>.</p>
</body></html>
"""


def write_report(directory: Path, timeline: Timeline, summary: DemoSummary) -> ReportFiles:
    """Write timeline.jsonl, summary.json, timeline.png and index.html into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    files = ReportFiles(directory=directory, png=directory / PNG_NAME, html=directory / HTML_NAME,
                        summary=directory / SUMMARY_NAME, timeline=directory / TIMELINE_NAME)
    timeline.write(files.timeline)
    files.summary.write_text(json.dumps(summary.to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    plot_timeline(timeline, summary, files.png)
    files.html.write_text(render_html(summary, files.png), encoding="utf-8")
    log.info("report written to %s", directory)
    return files
