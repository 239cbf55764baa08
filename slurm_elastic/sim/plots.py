"""Matplotlib PNGs of simulation results: GPUs per job over time, JCT CDF per policy, utilisation over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from slurm_elastic.sim.engine import SimResult


def _label(r: SimResult) -> str:
    return r.policy if r.restart_method == "forward-layer" else f"{r.policy} ({r.restart_method})"


def _step_grid(times: list[float], values: list[float], grid: np.ndarray) -> np.ndarray:
    """Values of a right-continuous step function (changes at `times`) on `grid`."""
    if not times:
        return np.zeros_like(grid)
    idx = np.searchsorted(np.asarray(times), grid, side="right") - 1
    out = np.asarray(values, dtype=float)[np.clip(idx, 0, None)]
    out[idx < 0] = 0.0
    return out


def write_plots(results: list[SimResult], folder: Path, title: str = "") -> list[Path]:
    """Write the three kinds of plot for one workload's results; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    end = max(r.end_s for r in results)
    grid = np.linspace(0.0, end, 2000)
    hours = grid / 3600.0

    for r in results:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        per_job: dict[str, tuple[list[float], list[float]]] = {}
        for t, key, g in r.timeline:
            ts, gs = per_job.setdefault(key, ([], []))
            ts.append(t)
            gs.append(g)
        stacks = [_step_grid(ts, gs, grid) for ts, gs in per_job.values()]
        if stacks:
            ax.stackplot(hours, np.vstack(stacks), linewidth=0)
        cap_t = [t for t, _, _ in r.utilisation]
        cap = [c for _, _, c in r.utilisation]
        ax.plot(hours, _step_grid(cap_t, cap, grid), color="black", linewidth=1, label="GPUs up")
        ax.set_xlabel("hours")
        ax.set_ylabel("GPUs (one colour per job)")
        ax.set_title(f"{title} GPUs per job over time, {_label(r)}".strip())
        ax.legend(loc="upper right")
        name = _label(r).replace(" ", "-").replace("(", "").replace(")", "")
        written.append(_save(fig, folder / f"gpus-per-job-{name}.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        jcts = np.sort([j.jct_s for j in r.jobs if j.jct_s is not None]) / 3600.0
        if len(jcts):
            ax.step(jcts, np.arange(1, len(jcts) + 1) / len(jcts), where="post", label=_label(r))
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours, log)")
    ax.set_ylabel("share of jobs")
    ax.set_title(f"{title} JCT CDF".strip())
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(_save(fig, folder / "jct-cdf.png"))

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for r in results:
        ts = [t for t, _, _ in r.utilisation]
        used = [a / c if c else 0.0 for _, a, c in r.utilisation]
        ax.plot(hours, _step_grid(ts, used, grid), label=_label(r), linewidth=1)
    ax.set_xlabel("hours")
    ax.set_ylabel("GPUs allocated / GPUs up")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{title} GPU utilisation over time".strip())
    ax.legend()
    written.append(_save(fig, folder / "utilisation.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    """Write one figure and close it (matplotlib keeps every open figure alive)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
