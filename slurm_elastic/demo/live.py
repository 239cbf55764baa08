"""The demo's live view: nodes, jobs, GPUs, steps and what just happened (rich on a terminal, log lines otherwise)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from slurm_elastic.demo.timeline import (Acked, ControllerNote, DemoAction, Event, JobInfo, JobSeen, NodeSeen,
                                         Progress)


@dataclass(frozen=True, slots=True)
class JobLine:
    """What the view shows for one job."""

    name: str
    job: str
    state: str
    gpus: int
    nodes: tuple[str, ...]
    restarts: int
    step: int | None
    steps_per_s: float | None


class DemoState:
    """The latest of everything, folded from timeline events (the view's model)."""

    def __init__(self, jobs: Iterable[JobInfo] = ()) -> None:
        self.jobs: dict[str, JobInfo] = {j.job: j for j in jobs}
        self.nodes: dict[str, NodeSeen] = {}
        self.job_seen: dict[str, JobSeen] = {}
        self.progress: dict[str, Progress] = {}
        self.phase = "starting"
        self.elapsed = 0.0
        self.happened: deque[str] = deque(maxlen=10)
        self._run_start: dict[str, float | None] = {}
        self._announced_run: dict[str, float | None] = {}

    def add_job(self, info: JobInfo) -> None:
        self.jobs[info.job] = info

    def name(self, job: str) -> str:
        info = self.jobs.get(job)
        return f"{info.name} ({job})" if info else f"job {job}"

    def apply(self, events: Iterable[Event]) -> list[str]:
        """Fold events in; return the sentences worth telling a person, in order."""
        told = []
        for e in events:
            line = self._apply_one(e)
            if line:
                told.append(f"{e.t:6.1f}s  {line}")
                self.happened.append(told[-1])
        return told

    def _apply_one(self, e: Event) -> str | None:
        if isinstance(e, DemoAction):
            return e.text or f"{e.action} {e.subject}".strip()
        if isinstance(e, NodeSeen):
            before = self.nodes.get(e.node)
            self.nodes[e.node] = e
            if before is None:
                return None
            word = "available" if e.available else "unavailable"
            return f"Slurm: node {e.node} is {e.state.upper()} ({word})"
        if isinstance(e, JobSeen):
            self.job_seen[e.job] = e
            if e.state == "RUNNING":
                self._run_start[e.job] = e.start
                restart = f", restart {e.restarts}" if e.restarts else ""
                return f"Slurm: {self.name(e.job)} running on {','.join(e.nodes) or '?'} with {e.gpus} GPUs{restart}"
            why = f" ({e.reason})" if e.reason and e.reason != "None" else ""
            held = ", held" if e.held else ""
            return f"Slurm: {self.name(e.job)} {e.state}{held}{why}"
        if isinstance(e, Progress):
            self.progress[e.job] = e
            start = self._run_start.get(e.job)
            if self._announced_run.get(e.job, "none") != start and (start is None or e.t + 1.0 >= start):
                self._announced_run[e.job] = start
                return f"{self.name(e.job)} training at step {e.step} on {e.gpus} GPUs"
            return None
        if isinstance(e, Acked):
            return f"{self.name(e.job)} committed its checkpoint at step {e.step} on the signal (ACK)"
        if isinstance(e, ControllerNote):
            return f"controller: {e.text}"
        return None

    def job_lines(self) -> list[JobLine]:
        out = []
        for jid, info in self.jobs.items():
            seen = self.job_seen.get(jid)
            prog = self.progress.get(jid)
            out.append(JobLine(name=info.name, job=jid, state=seen.state if seen else "SUBMITTED",
                               gpus=seen.gpus if seen else 0, nodes=seen.nodes if seen else (),
                               restarts=seen.restarts if seen else 0, step=prog.step if prog else None,
                               steps_per_s=prog.steps_per_s if prog else None))
        return out


class LiveView(Protocol):
    def update(self, state: DemoState, told: list[str]) -> None: ...

    def close(self) -> None: ...


class PlainView:
    """Not a terminal: one log line per thing that happened, and each job's progress every `every_s` seconds."""

    def __init__(self, emit: Callable[[str], None], *, every_s: float = 15.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.emit = emit
        self.every_s = every_s
        self._clock = clock
        self._last = clock()
        self._phase = ""

    def update(self, state: DemoState, told: list[str]) -> None:
        if state.phase != self._phase:
            self._phase = state.phase
            self.emit(f"{state.elapsed:6.1f}s  == {state.phase}")
        for line in told:
            self.emit(line)
        if self._clock() - self._last >= self.every_s:
            self._last = self._clock()
            parts = [f"{j.name} {j.state.lower()} {j.gpus} GPUs step {j.step if j.step is not None else '-'}"
                     for j in state.job_lines()]
            self.emit(f"{state.elapsed:6.1f}s  " + "; ".join(parts))

    def close(self) -> None:
        pass


class RichView:
    """A terminal: a live panel of nodes, jobs and the last things that happened."""

    def __init__(self, console: Any) -> None:
        from rich.live import Live

        self.console = console
        self._live = Live(console=console, refresh_per_second=4, transient=False)
        self._live.start()

    def update(self, state: DemoState, told: list[str]) -> None:
        self._live.update(render(state))

    def close(self) -> None:
        self._live.stop()


def render(state: DemoState) -> Any:
    """The rich renderable of the whole view."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    nodes = Table(title="nodes", expand=False)
    for col in ("node", "Slurm state", "GPUs"):
        nodes.add_column(col)
    used: dict[str, int] = {}
    for line in state.job_lines():
        if line.state == "RUNNING" and line.nodes:
            per = line.gpus // max(len(line.nodes), 1)
            for n in line.nodes:
                used[n] = used.get(n, 0) + per
    for name, seen in sorted(state.nodes.items()):
        style = "green" if seen.available else "red"
        nodes.add_row(name, Text(seen.state.upper(), style=style), f"{used.get(name, 0)}/{seen.gpus}")
    jobs = Table(title="elastic jobs", expand=False)
    for col in ("job", "state", "GPUs", "nodes", "step", "steps/s", "restarts"):
        jobs.add_column(col)
    for line in state.job_lines():
        style = "green" if line.state == "RUNNING" else "yellow"
        jobs.add_row(f"{line.name} ({line.job})", Text(line.state, style=style), str(line.gpus),
                     ",".join(line.nodes) or "-", "-" if line.step is None else str(line.step),
                     "-" if line.steps_per_s is None else f"{line.steps_per_s:.1f}", str(line.restarts))
    from rich.columns import Columns

    happened = Text("\n".join(state.happened) or "...")
    return Group(
        Text(f"slurm-elastic demo  {state.elapsed:6.1f} s  |  {state.phase}", style="bold"),
        Columns([nodes, jobs]),
        Panel(happened, title="what just happened"),
    )
