"""The last minute of a job: time-limit warnings and preemptions injected into a running elastic job, as Slurm
delivers them, one after another; how many commit and resume losing no completed step.

Each event stops one incarnation of one job (benchmarks/last_minute_job.py: real torch ranks, gloo, an
evaluation pass with an all-reduce every few steps) and the next incarnation resumes it:

  time limit   the job's checkpoint signal (USR2) to every rank at once: what the job template's handler of
               Slurm's `--signal=B:...@N` warning sends (`scancel --signal` to every step)
  preemption   SIGTERM to every rank, each within a second of the others (Slurm's GraceTime signal to the
               tasks of every node)

then SIGKILL to any rank still alive when the grace time (10-120 s) ends, as Slurm's KillWait/GraceTime
does. Some events come during an evaluation pass, when no step boundary is near. The machine is loaded
with `--load` busy processes (default: one per core) for the whole run.

For each event: did the ranks commit (ACK written, committed, all ranks exited with the requeue code
before the deadline); the steps lost (the last step every rank completed minus the step the next
incarnation resumed at); signal to the last rank's exit. Beside it, from the same run, what a job
without the commit loses: the steps since its last periodic checkpoint (`--every-steps`).

The Slurm side (the warning's delivery, the requeue, Slurm starting the job again) is the live tests'
(tests/control/test_time_limit_live.py, tests/control/test_preemption_live.py); here the ranks are
started by this script with the variables srun sets, so 100 events take minutes, not hours.

    python3 benchmarks/last_minute.py                  # 100 events, table
    python3 benchmarks/last_minute.py --events 20 --ranks 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from table import print_rows  # benchmarks/table.py: how every benchmark prints  # noqa: E402

from slurm_elastic import jobfiles as protocol  # noqa: E402

JOB = "7001"
JOB_SCRIPT = Path(__file__).resolve().parent / "last_minute_job.py"
GRACES_S = (10, 20, 30, 60, 90, 120)


@dataclass
class Event:
    index: int
    kind: str            # "time limit" | "preemption"
    phase: str           # "train" | "eval": what rank 0 was doing when the signal came
    grace_s: int
    committed: bool = False
    killed: int = 0      # ranks still alive at the deadline
    completed: int = -1  # the last step every rank completed
    resumed: int = -1    # the step the next incarnation resumed at
    periodic: int = -1   # the last periodic checkpoint at or before `completed`
    exit_s: float = 0.0  # signal to the last rank's exit
    codes: tuple[int, ...] = ()

    @property
    def lost(self) -> int:
        return self.completed - self.resumed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(world: int, restart: int, ckpt: Path, logs: Path, args: argparse.Namespace) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM", "TORCHELASTIC", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_RANK"))}
        env.update({"SLURM_JOB_ID": JOB, "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world),
                    "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NNODES": "1",
                    "SLURM_TASKS_PER_NODE": str(world), "SLURM_NODELIST": "localhost",
                    "SLURM_RESTART_COUNT": str(restart), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": "1", "SLURM_ELASTIC_CKPT_DIR": str(ckpt)})
        out = open(logs / f"out-{restart}-{rank}.txt", "w", encoding="utf-8")
        procs.append(subprocess.Popen(
            [sys.executable, str(JOB_SCRIPT), "--log-dir", str(logs), "--every-steps", str(args.every_steps),
             "--eval-every", str(args.eval_every), "--eval-s", str(args.eval_s)],
            env=env, stdout=out, stderr=subprocess.STDOUT))
        out.close()
    return procs


def _since_start(logs: Path, rank: int) -> list[dict[str, Any]]:
    """This rank's lines since its last `start` (the current incarnation's)."""
    try:
        lines = [json.loads(t) for t in (logs / f"rank{rank}.log").read_text().splitlines() if t.strip()]
    except (OSError, ValueError):
        return []
    starts = [i for i, line in enumerate(lines) if line["event"] == "start"]
    return lines[starts[-1]:] if starts else []


def _wait(predicate: Any, timeout_s: float, what: str, procs: list[subprocess.Popen]) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a rank exited while waiting for {what}: codes {[p.poll() for p in procs]}")
        time.sleep(0.05)
    raise SystemExit(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _started(logs: Path, world: int, restart: int) -> int | None:
    """The step the incarnation `restart` resumed at, once every rank has said so."""
    heads = [_since_start(logs, r)[:1] for r in range(world)]
    if all(h and h[0].get("restart") == restart for h in heads):
        return int(heads[0][0]["step"])
    return None


def _await_start(logs: Path, world: int, restart: int, timeout_s: float, procs: list[subprocess.Popen]) -> int:
    found: list[int] = []

    def started() -> bool:
        step = _started(logs, world, restart)
        if step is not None:
            found.append(step)
        return step is not None

    _wait(started, timeout_s, f"start {restart}", procs)
    return found[-1]


def run(args: argparse.Namespace) -> list[Event]:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="last-minute-"))
    ckpt, logs = root / "ck", root / "logs"
    ckpt.mkdir()
    logs.mkdir()
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    events: list[Event] = []
    try:
        procs = _start(args.ranks, 0, ckpt, logs, args)
        resumed = _await_start(logs, args.ranks, 0, args.start_timeout_s, procs)
        for index in range(args.events + 1):
            if events:
                events[-1].resumed = resumed
                print(f"event {index}: {events[-1]}", file=sys.stderr)
            if index == args.events:
                for p in procs:
                    p.kill()
                    p.wait()
                break
            event = Event(index, rng.choice(("time limit", "preemption")),
                          "eval" if rng.random() < args.eval_share else "train", GRACES_S[index % len(GRACES_S)])
            head = _since_start(logs, 0)
            if event.phase == "eval":
                seen = sum(1 for line in head if line["event"] == "eval")
                _wait(lambda: sum(1 for line in _since_start(logs, 0) if line["event"] == "eval") > seen,
                      args.start_timeout_s, "an evaluation pass", procs)
                time.sleep(rng.uniform(0.0, 0.8 * args.eval_s))
            else:
                steps = sum(1 for line in head if line["event"] == "step")
                want = steps + rng.randint(1, args.eval_every)
                _wait(lambda: sum(1 for line in _since_start(logs, 0) if line["event"] == "step") >= want,
                      args.start_timeout_s, "training steps", procs)
            lines = _since_start(logs, 0)
            event.phase = "eval" if lines and lines[-1]["event"] == "eval" else "train"
            t0 = time.monotonic()
            if event.kind == "time limit":
                for p in procs:
                    p.send_signal(signal.SIGUSR2)
            else:
                for p in sorted(procs, key=lambda _: rng.random()):
                    p.send_signal(signal.SIGTERM)
                    time.sleep(rng.uniform(0.0, 1.0 / len(procs)))
            deadline = t0 + event.grace_s
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.02)
            event.exit_s = time.monotonic() - t0
            for p in procs:
                if p.poll() is None:
                    event.killed += 1
                    p.kill()
                p.wait()
            event.codes = tuple(p.returncode for p in procs)
            steps = [[line["step"] for line in _since_start(logs, r) if line["event"] == "step"]
                     for r in range(args.ranks)]
            event.completed = min(max(s, default=resumed) for s in steps)
            event.periodic = max(resumed, event.completed // args.every_steps * args.every_steps)
            try:
                ack = json.loads(Path(protocol.ack_path(str(ckpt), JOB, JOB, index)).read_text())
            except (OSError, ValueError):
                ack = {}
            event.committed = (bool(ack.get("committed")) and event.killed == 0
                               and all(c == protocol.REQUEUE_EXIT_CODE for c in event.codes))
            events.append(event)
            procs = _start(args.ranks, index + 1, ckpt, logs, args)
            resumed = _await_start(logs, args.ranks, index + 1, args.start_timeout_s, procs)
    finally:
        for p in load:
            p.kill()
            p.wait()
    if not args.keep:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"kept {root}", file=sys.stderr)
    return events


def rows(events: list[Event]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[Event]] = defaultdict(list)
    for e in events:
        groups[(e.kind, e.phase)].append(e)
        groups[(e.kind, "all")].append(e)
        groups[("all", "all")].append(e)
    out = []
    for (kind, phase), group in sorted(groups.items(), key=lambda kv: (kv[0][0] == "all", kv[0])):
        committed = [e for e in group if e.committed and e.lost == 0]
        out.append({
            "events": kind if phase == "all" else f"{kind}, {phase}",
            "count": len(group),
            "grace_s": f"{min(e.grace_s for e in group)}-{max(e.grace_s for e in group)}",
            "committed_0_lost_pct": round(100.0 * len(committed) / len(group), 1),
            "killed_at_deadline": sum(1 for e in group if e.killed),
            "steps_lost_max": max(e.lost for e in group),
            "steps_lost_total": sum(e.lost for e in group),
            "periodic_only_steps_lost_total": sum(e.completed - e.periodic for e in group),
            "signal_to_exit_s_median": round(statistics.median(e.exit_s for e in group), 2),
            "signal_to_exit_s_max": round(max(e.exit_s for e in group), 2),
        })
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=100)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy processes beside the job")
    p.add_argument("--eval-share", type=float, default=0.3, help="share of events aimed at an evaluation pass")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-s", type=float, default=3.0)
    p.add_argument("--every-steps", type=int, default=20)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the run's directory (logs, checkpoints)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.events < 1 or args.ranks < 1:
        p.error("--events and --ranks must be at least 1")
    t0 = time.monotonic()
    events = run(args)
    print_rows(rows(events), args.json,
               title=None if args.json else
               f"{len(events)} events, {args.ranks} ranks, load {args.load} busy processes, "
               f"eval pass {args.eval_s:g} s every {args.eval_every} steps, periodic checkpoint every "
               f"{args.every_steps} steps; {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
