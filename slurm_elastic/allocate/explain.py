"""Why each job got what it got: a JobDecision per job, and the text `admin rebalance --dry-run --explain` prints.

The cause is found by probing the final layout: the job's next allowed count
either does not fit (capacity of resource r on node n), or fits but the
objective says no (restart cost, node cost), or it is at its max. Every reason
ends with the job's speed before and after as a share of its best, from the
speed model the solver used (measured or default: the request source's basis,
printed beside it, says which), so a reader sees what the speeds decided.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from slurm_elastic.allocate.instance import RESOURCES, Instance
from slurm_elastic.allocate.packing import Layout, Row
from slurm_elastic.allocate.shapes import spanning_widths
from slurm_elastic.allocate.throughput import evaluate_curve
from slurm_elastic.allocate.problem import Allocation, JobDecision

_UNIT = {"gpu": " GPUs", "cpu": " CPUs", "mem": " MB"}


def decide(inst: Instance, rows: Sequence[Row]) -> tuple[JobDecision, ...]:
    lay = Layout(inst)
    for i, row in enumerate(rows):
        lay.put(i, row)
    unplaceable = {u.key: u.reason for u in inst.unplaceable}
    out = []
    for i, job in enumerate(inst.jobs):
        before, after = job.current_gpus, sum(rows[i].values())
        cause, reason = _why(inst, lay, i, unplaceable.get(job.key))
        out.append(JobDecision(job.key, before, after, reason + _speeds(inst, i, before, after), cause))
    return tuple(out)


def _why(inst: Instance, lay: Layout, i: int, unplaceable: str | None) -> tuple[str, str]:
    job = inst.jobs[i]
    g = sum(lay.rows[i].values())
    lost = [inst.node_names[n] for n in inst.current[i] if inst.cap[n, 0] <= 0]
    lost_note = f" (node {', '.join(lost)} gives nothing now)" if lost else ""
    if unplaceable is not None:
        return "min-not-placeable", unplaceable + lost_note
    cause, reason = _probe(inst, lay, i)
    if g < job.current_gpus and not inst.displaced(i) and cause != "max":
        # it could have kept what it had: the GPUs went to others, and the probe says what blocks it now
        return "traded", (f"gave up {job.current_gpus - g} GPUs to jobs that gain more from them; now: {reason}")
    return cause, reason + lost_note


def _speeds(inst: Instance, i: int, before: int, after: int) -> str:
    """'; speed 12 -> 4 GPUs: 100% -> 100% of its best': what the solver's speed model says of both sizes."""
    t = inst.terms[i]
    # the progress objective's curve is the job's value, not normalised: its best is the curve's last point
    best = t.norm if inst.policy.objective != "progress" else max((v for _, v in t.hull), default=0.0) or 1.0

    def share(g: int) -> str:
        return f"{evaluate_curve(t.hull, g) / best:.0%}" if g > 0 else "0%"

    if before == after:
        return f"; speed at {after} GPUs: {share(after)} of its best"
    return f"; speed {before} -> {after} GPUs: {share(before)} -> {share(after)} of its best"


def _probe(inst: Instance, lay: Layout, i: int) -> tuple[str, str]:
    """What stops job i from taking its next allowed count in the final layout."""
    job = inst.jobs[i]
    row = lay.rows[i]
    g = sum(row.values())
    ups = [c for c in inst.terms[i].allowed if c > g]
    if not ups:
        note = "" if g == job.max_gpus else f" (largest allowed count; max is {job.max_gpus})"
        return "max", f"max reached ({g} GPUs){note}"
    shaped = [next((c for c in ups if c <= inst.total[0] and _gpu_shape_exists(inst, c)), 0)]
    if not shaped[0]:
        return "capacity", (f"no larger count has a Slurm shape on these nodes' GPUs "
                            f"(next allowed {ups[0]} GPUs; spanning needs equal"
                            f"{' whole' if inst.whole else ''} nodes)")
    nxt = shaped[0]
    new = lay.find(i, nxt, row or inst.current[i])
    if new is None:
        return "capacity", _capacity_reason(inst, lay, i, nxt)
    base = inst.job_objective(i, row)
    gain_s = inst.throughput_value(i, nxt) - (inst.throughput_value(i, g) if g else 0.0)
    t = inst.terms[i]
    gain_d = t.objective.per_gpu * (nxt - g)
    cur = inst.current[i]
    moved_new = sum(abs(new.get(n, 0) - cur.get(n, 0)) for n in set(new) | set(cur))
    moved_old = sum(abs(row.get(n, 0) - cur.get(n, 0)) for n in set(row) | set(cur))
    restart = t.objective.per_moved_gpu * (moved_new - moved_old)
    nodes = t.objective.per_node * (len(new) - len(row))
    total = inst.job_objective(i, new) - base
    stays = t.objective.stay > 0 and inst.stays(i, row)
    if total <= 0 and stays:
        return "restart-cost", (f"restart cost outweighed the gain: {nxt} GPUs would be worth {gain_s:.4g} more "
                                f"after a restart, but the restart loses {t.objective.stay:.4g} (the share of its "
                                f"value now that a restart costs)")
    if total <= 0 and t.objective.in_place > 0 and inst.in_place(i, row) and not inst.in_place(i, new):
        return "restart-cost", (f"restart cost outweighed the gain: {nxt} GPUs would be worth {gain_s:.4g} more "
                                f"after a relaunch, but a relaunch loses {t.objective.in_place:.4g} more than "
                                f"this shrink, which keeps its processes")
    if total <= 0 and restart > 0 and restart >= gain_s + gain_d - nodes:
        return "restart-cost", (f"restart cost outweighed the gain: {nxt} GPUs would add {gain_s + gain_d:.4g} "
                                f"but cost {restart:.4g} in restarts")
    if total <= 0 and nodes > 0:
        return "node-cost", (f"spanning {len(new)} nodes for {nxt} GPUs costs {nodes:.4g}, more than "
                             f"the gain {gain_s + gain_d - restart:.4g}")
    if total <= 0:
        return "no-gain", f"{nxt} GPUs would not raise the objective ({total:.4g})"
    return "traded", (f"{nxt} GPUs would fit but the solver gave the capacity to jobs gaining more "
                      f"(this job would gain {total:.4g}; within the MIP gap or needed by a shape)")


def _gpu_shape_exists(inst: Instance, gpus: int) -> bool:
    """Some shape holds `gpus` GPUs on the GPUs of the (empty) cluster, CPUs and memory aside."""
    g = inst.cap[:, 0]
    if len(g) and gpus <= g.max():
        return True
    for w in spanning_widths(gpus, inst.node_sizes, inst.whole):
        if int(((g == w) if inst.whole else (g >= w)).sum()) >= gpus // w:
            return True
    return False


def _capacity_reason(inst: Instance, lay: Layout, i: int, gpus: int) -> str:
    """Name the resource and node that stop job i from taking `gpus` GPUs."""
    free = lay.free.copy()
    for n, v in lay.rows[i].items():
        free[n] += v * inst.rho[i]
    need = gpus * inst.rho[i]
    up = inst.cap[:, 0] > 0
    if not up.any():
        return f"no node has GPUs for elastic work ({gpus} GPUs wanted)"
    if not lay.rows[i] and gpus <= inst.max_per_node(i).max():
        # nodes exist that could hold it if they were empty: say how full they are
        fits = (free[:, 0] >= need[0] - 1e-9)
        if not fits.any():
            return (f"capacity of gpu: no node has {gpus} free GPUs now ({free[:, 0].sum():.0f} free cluster-wide, "
                    f"at most {free[:, 0].max():.0f} on one node); they went to jobs that gain more")
    # the node the job is on (or the one with most free GPUs) is the one a user will ask about
    if lay.rows[i]:
        n = max(lay.rows[i], key=lambda k: lay.rows[i][k])
    else:
        n = int(np.argmax(np.where(up, free[:, 0] + free[:, 1] / max(need[1], 1), -np.inf)))
    short = [r for r in range(3) if free[n, r] < need[r] - 1e-9]
    if need[0] > inst.cap[:, 0].max():
        # only a spanning shape could hold it
        widths = spanning_widths(gpus, inst.node_sizes, inst.whole)
        if not widths:
            return f"no Slurm shape holds {gpus} GPUs on these nodes (spanning needs equal whole nodes)"
        w = widths[0]
        per = w * inst.rho[i]
        ready = np.all(free >= per - 1e-9, axis=1) & (inst.cap[:, 0] == w if inst.whole else True)
        return (f"capacity: {gpus} GPUs need {gpus // w} nodes with {w} free GPUs each"
                f"{' (whole nodes)' if inst.whole else ''} and their CPUs and memory; {int(ready.sum())} "
                f"such node(s) free now")
    if not short:
        return (f"no shape fits {gpus} GPUs: spanning needs equal whole nodes and none are free enough")
    r = short[0]
    name = RESOURCES[r]
    return (f"capacity of {name} on node {inst.node_names[n]}: {gpus} GPUs need {need[r]:.0f}{_UNIT[name]}, "
            f"{free[n, r]:.0f}{_UNIT[name]} free there (and no other node fits)")


def render(allocation: Allocation, *, only_changes: bool = False) -> str:
    """The table `slurm-elastic admin rebalance --dry-run --explain` prints."""
    lines = [f"method {allocation.method}  status {allocation.status}  objective {allocation.objective:.6g}  "
             f"bound {allocation.bound:.6g}  gap {allocation.mip_gap:.3%}  solve {allocation.solve_s:.3f}s"]
    decisions = [d for d in allocation.decisions if not only_changes or d.gpus_before != d.gpus_after]
    width = max((len(d.key) for d in decisions), default=3)
    width = max(width, 3)
    lines.append(f"{'job':<{width}}  {'before':>6} -> {'after':<6}  why")
    for d in decisions:
        where = allocation.placement.get(d.key, {})
        nodes = ",".join(f"{n}:{g}" for n, g in sorted(where.items()))
        lines.append(f"{d.key:<{width}}  {d.gpus_before:>6} -> {d.gpus_after:<6}  {d.reason}"
                     + (f"  [{nodes}]" if nodes else ""))
        if d.key in allocation.basis:
            lines.append(f"{'':<{width}}  decided from: {allocation.basis[d.key]}")
    for note in allocation.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
