"""Keep the surviving ranks' processes through a lost peer: run the training command in this process and,
when the survivors re-form their group, run it again there at the new size.

    python -m slurm_elastic.train.regroup -m my_project.train --my-args
    python -m slurm_elastic.train.regroup train.py --my-args

The job templates start every rank this way (unless SLURM_ELASTIC_KEEP_RANKS=0).
After a peer loss the survivors agree on the last step all of them completed and
commit it (session.py); where every survivor's training thread can go on, they
raise `Regroup` instead of exiting. It unwinds the user's loop (a BaseException:
frameworks that catch Exception let it through); the session has left the broken
process group (this runner makes sure it is gone), and the runner rewrites the Slurm variables to the survivors' coordinates and runs
the command again in the same interpreter: torch and the user's modules stay
imported, srun is not asked for a new step, and the new ElasticSession meets the
other survivors in a run directory of the next generation and restores the step
just committed (from the page cache it was written through).
"""

from __future__ import annotations

import atexit
import logging
import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from slurm_elastic import settings

log = logging.getLogger(__name__)

_running = False        # set by main(): only then may a session raise Regroup instead of exiting
# A stop signal that came while the survivors moved from one session to the next (its name, "" if none),
# and the handlers the stop signals had before the first session: between sessions the signals are held.
_carried = ""
_originals: dict[int, Any] = {}
# The newest session's run directory and rank: where this process says its command ended, once it re-formed
# its group (the step's srun still waits for the lost node's tasks then, and never ends by itself).
_last_run: tuple[str, int] | None = None
_regrouped = False      # this process re-formed its group: its step ends only on the ranks' word (exited-<rank>)


class Regroup(BaseException):
    """The survivors re-form their group in this process; `env` is what changes in os.environ (None: unset)."""

    def __init__(self, env: Mapping[str, str | None], *, rank: int, new_rank: int, world_size: int,
                 step: int) -> None:
        super().__init__(f"rank {rank} goes on as rank {new_rank} of {world_size} from step {step}")
        self.env = dict(env)
        self.rank, self.new_rank, self.world_size, self.step = rank, new_rank, world_size, step


def session_started(run_dir: str, rank: int) -> None:
    """A session of this process meets its group in `run_dir` as `rank` (called by ElasticSession)."""
    global _last_run
    _last_run = (run_dir, rank)


def _say_ended(code: int) -> None:
    """Write exited-<rank> (the code) in the newest session's run directory, for the batch script. Run at
    exit (atexit, registered first so it runs last: after non-daemon threads are joined and the other
    handlers ran, since the batch script ends the step once every rank has said so)."""
    if _last_run is None:
        return
    from slurm_elastic import jobfiles

    run_dir, rank = _last_run
    try:
        os.makedirs(run_dir, mode=0o700, exist_ok=True)     # a group of one has no run directory of its own
        tmp = os.path.join(run_dir, f".exited.{os.getpid()}")
        with open(tmp, "w", encoding="ascii") as f:
            f.write(f"{code}\n")
        os.replace(tmp, os.path.join(run_dir, jobfiles.exited_file_name(rank)))
    except OSError as exc:
        print(f"slurm-elastic: rank {rank}: cannot say it ended in {run_dir} ({exc}); the batch script waits for "
              f"its step", file=sys.stderr, flush=True)


def exit_now(code: int) -> NoReturn:
    """Leave the process at once with `code` (os._exit: a broken group can hang in atexit handlers), first
    writing exited-<rank> where this process re-formed its group: atexit does not run on os._exit, and the
    step's srun, which still waits for the lost node's tasks, is ended by the batch script on that word
    only (without it a later requeue waited KillWait for that srun)."""
    if _regrouped:
        _say_ended(code)
    os._exit(code)


def _exit_code(code: object) -> int:
    """The process's exit status for SystemExit(code), as the interpreter makes it."""
    if code is None:
        return 0
    return code & 0xFF if isinstance(code, int) else 1


def running() -> bool:
    """True inside `main`: the command can be run again, so a session may raise Regroup."""
    return _running


def survivor_env(environ: Mapping[str, str], decision: Mapping[str, Any], rank: int) -> dict[str, str | None]:
    """The Slurm variables of `rank` in the group of `decision["survivors"]` (ranks renumbered in order).

    The local rank (the GPU a rank uses) stays; nodes keep their order; MASTER_PORT is dropped so the new
    rank 0 takes a fresh port from the kernel (train/rendezvous.py), and MASTER_ADDR too unless rank 0
    is still the first rank.
    """
    survivors = sorted(int(r) for r in decision["survivors"])
    node_of = {int(r): str(n) for r, n in decision["survivor_nodes"].items()}
    nodes: list[str] = []
    for r in survivors:
        if node_of[r] not in nodes:
            nodes.append(node_of[r])
    per_node = [sum(1 for r in survivors if node_of[r] == n) for n in nodes]
    new_rank = survivors.index(rank)
    nodelist = ",".join(nodes)
    tasks = ",".join(str(k) for k in per_node)
    generation = settings.GENERATION.read(environ) + 1
    env: dict[str, str | None] = {
        "SLURM_PROCID": str(new_rank), "SLURM_NTASKS": str(len(survivors)), "SLURM_NPROCS": str(len(survivors)),
        "SLURM_STEP_NUM_TASKS": str(len(survivors)), "SLURM_NODEID": str(nodes.index(node_of[rank])),
        "SLURM_STEP_NUM_NODES": str(len(nodes)), "SLURM_NNODES": str(len(nodes)),
        "SLURM_STEP_NODELIST": nodelist, "SLURM_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": tasks, "SLURM_TASKS_PER_NODE": tasks,
        "MASTER_PORT": None, settings.GENERATION.env or "": str(generation),
    }
    if survivors[0] != 0:
        env["MASTER_ADDR"] = None
    return env


def hold_signals(originals: Mapping[int, Any]) -> None:
    """Between two sessions of this process: a stop signal (Slurm's SIGTERM, the job's checkpoint signal)
    is held for the next session instead of being lost with the last one's flag, or acted on by the
    default action of the handler before it. `originals`: the signals and the handlers the last session
    found."""
    def hold(signum: int, _frame: Any) -> None:
        carry(signal.Signals(signum).name.removeprefix("SIG"))

    for signum, original in originals.items():
        _originals.setdefault(signum, original)
        signal.signal(signum, hold)


def carry(name: str) -> None:
    """Hold the stop signal `name` (seen by a session that is ending) for the next session."""
    global _carried
    _carried = _carried or name


def take_signal(signum: int, handler: Any) -> tuple[Any, str]:
    """Install a session's `handler` for `signum`: the handler to restore at its end (the one from before
    the first session, not the holder), and the stop signal held since the last session ("" if none)."""
    global _carried
    previous = signal.signal(signum, handler)
    carried, _carried = _carried, ""
    return _originals.get(signum, previous), carried


def leave_group(timeout_s: float = 10.0) -> bool:
    """Destroy the broken default process group; False when that did not return within `timeout_s`.

    With gloo the survivors' sockets to the lost rank are already closed and destroy returns at once
    (measured: under 10 ms); a thread bounds it all the same, since a hang here would cost the job
    more than the relaunch it avoids.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as exc:   # a broken group may refuse; what matters is that it is gone
            log.debug("destroying the old process group: %s", exc)
        done.set()

    threading.Thread(target=destroy, name="leave-group", daemon=True).start()
    return done.wait(timeout_s) and not dist.is_initialized()


def main(argv: Sequence[str] | None = None) -> int:
    global _running
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: python -m slurm_elastic.train.regroup (-m MODULE | SCRIPT) [ARGS...]", file=sys.stderr)
        return 2
    module = args[1] if args[0] == "-m" else None
    target = module or args[0]
    rest = args[2:] if module else args[1:]
    if module is None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))   # as `python script.py` does
    global _last_run, _regrouped
    _running = True
    regrouped = False
    ended: list[int] = []
    atexit.register(lambda: _say_ended(ended[0]) if ended else None)
    while True:
        sys.argv = [target, *rest]
        try:
            regroup = _run_once(module, target)
        except SystemExit as exc:
            if regrouped:
                ended.append(_exit_code(exc.code))
            raise
        if not isinstance(regroup, Regroup):
            if regrouped:
                ended.append(_exit_code(regroup))
            return regroup
        regrouped = _regrouped = True
        _last_run = None        # the next session names its run directory; none yet
        t0 = time.monotonic()
        if not leave_group():
            print(f"slurm-elastic: rank {regroup.rank}: the old process group did not close; exiting to be "
                  f"relaunched", file=sys.stderr, flush=True)
            from slurm_elastic import jobfiles

            os._exit(jobfiles.PEER_LOST_EXIT_CODE)
        for name, value in regroup.env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        print(f"slurm-elastic: {regroup} in the same process (group left in {time.monotonic() - t0:.2f} s)",
              file=sys.stderr, flush=True)


def _run_once(module: str | None, target: str) -> int | Regroup:
    """Run the command as `python` would; its Regroup, or the exit code of an uncaught error.

    An error the script does not catch goes to sys.excepthook, as at the top of an interpreter:
    ElasticLoop's hook hands a lost peer to the session there, which may answer with Regroup.
    SystemExit passes on (the process exits with its code)."""
    try:
        if module is not None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
        return 0
    except Regroup as regroup:
        return regroup
    except SystemExit:
        raise
    except BaseException as exc:     # KeyboardInterrupt too: the interpreter would report it the same way
        try:
            sys.excepthook(type(exc), exc, exc.__traceback__)
        except Regroup as regroup:
            return regroup
        return 1


if __name__ == "__main__":
    # Run as -m this file is __main__; the sessions import slurm_elastic.train.regroup, whose flag and
    # Regroup class are the ones that count.
    from slurm_elastic.train import regroup as _module

    sys.exit(_module.main())
