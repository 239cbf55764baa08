"""Fork real rank processes from one interpreter that imported torch once: tests launch many short jobs.

    python -m tests.train.forkserver MODULE      # then one JSON line per job on stdin:
    {"args": [...], "envs": [{...}, ...], "logs": ["rank0.log", ...]}

For each job it prints {"pids": [...]} as soon as the ranks run, then
{"codes": [...]} when all ended (negative: killed by that signal). Each rank
is a separate process with its own gloo connections, exactly as under srun;
only the import of torch is shared (a copy-on-write page of the parent).
"""

from __future__ import annotations

import importlib
import json
import os
import sys


def _child(module: object, args: list[str], env: dict[str, str], log: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdin.close()
    code = 1
    try:
        code = module.main(args)  # type: ignore[attr-defined]
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def main() -> int:
    import torch

    torch.set_num_threads(1)   # no thread pool alive across fork
    module = importlib.import_module(sys.argv[1])
    if hasattr(module, "warm"):
        module.warm()
    for line in sys.stdin:
        job = json.loads(line)
        pids = []
        for env, log in zip(job["envs"], job["logs"]):
            pid = os.fork()
            if pid == 0:
                _child(module, job["args"], env, log)
            pids.append(pid)
        print(json.dumps({"pids": pids}), flush=True)
        codes = []
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            codes.append(os.waitstatus_to_exitcode(status))
        print(json.dumps({"codes": codes}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
