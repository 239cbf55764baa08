"""A tiny stand-in for a training job that speaks the shim's protocol (stdlib only, runs as any user).

Each step sleeps a little and appends to metrics.jsonl; every few steps it
commits a checkpoint (step dir + manifest, then LATEST). On the checkpoint
signal (USR2) it commits a checkpoint, writes ACK-<jobid>-<restart> and exits
85 (requeue expected). It logs the size it ran with to sizes.log, so tests
can see what Slurm gave it after each restart.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

STEP_S = float(os.environ.get("FAKE_STEP_S", "0.2"))
CKPT_EVERY = int(os.environ.get("FAKE_CKPT_EVERY", "10"))
REQUEUE_EXIT_CODE = 85


def main() -> int:
    job_id = os.environ["SLURM_JOB_ID"]
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    root = os.environ.get("SLURM_ELASTIC_CKPT_DIR") or os.path.join(os.getcwd(), "ckpt")
    job_dir = os.path.join(root, job_id)
    os.makedirs(job_dir, exist_ok=True)
    gpus_on_node = int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0)
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1") or 1)
    with open(os.path.join(job_dir, "sizes.log"), "a") as f:
        f.write(json.dumps({"restart": restart, "gpus": gpus_on_node * nodes, "nodes": nodes,
                            "at": time.time()}) + "\n")
    step = _latest(job_dir)
    stop = {"flag": False}
    signal.signal(signal.SIGUSR2, lambda s, f: stop.update(flag=True))  # a flag only, as the shim does
    while True:
        if stop["flag"]:
            _commit(job_dir, step)
            open(os.path.join(job_dir, f"ACK-{job_id}-{restart}"), "w").close()
            return REQUEUE_EXIT_CODE
        time.sleep(STEP_S)
        step += 1
        with open(os.path.join(job_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "gpus": gpus_on_node * nodes, "t": time.time()}) + "\n")
        if step % CKPT_EVERY == 0:
            _commit(job_dir, step)


def _latest(job_dir: str) -> int:
    try:
        with open(os.path.join(job_dir, "LATEST")) as f:
            return int(f.read().strip().removeprefix("step-"))
    except (OSError, ValueError):
        return 0


def _commit(job_dir: str, step: int) -> None:
    d = os.path.join(job_dir, f"step-{step:010d}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "manifest.json.tmp"), "w") as f:
        json.dump({"step": step}, f)
    os.replace(os.path.join(d, "manifest.json.tmp"), os.path.join(d, "manifest.json"))
    with open(os.path.join(job_dir, "LATEST.tmp"), "w") as f:
        f.write(f"step-{step:010d}\n")
    os.replace(os.path.join(job_dir, "LATEST.tmp"), os.path.join(job_dir, "LATEST"))


if __name__ == "__main__":
    sys.exit(main())
