"""A tiny stand-in for a training job that speaks the shim's protocol (stdlib only, runs as any user).

Each step sleeps a little and appends to metrics.jsonl; every few steps it
commits a checkpoint (step dir + manifest, then LATEST). On the checkpoint
signal (USR2) it commits a checkpoint, writes ACK-<jobid>-<restart> and exits
85 (requeue expected). It logs the size it ran with to sizes.log, so tests
can see what Slurm gave it after each restart.

With FAKE_SPEED set, a step takes as long as that speed model says and the
metrics rows are the shim's (train/session.py `_write_metrics`, appended as
train/store.py does: sorted keys, O_APPEND | O_NOFOLLOW, mode 0600, in a job
directory of mode 0700), one every FAKE_METRICS_EVERY_S, with steps/s
measured over the window since the previous row:
  linear: a step takes FAKE_STEP_S / gpus (the job scales with its GPUs);
  flat:   a step takes FAKE_STEP_S at any size (it does not scale).
Without FAKE_SPEED each step appends {"step", "gpus", "t"}, which the
controller does not take for the shim's rows (it keeps its default model).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

STEP_S = float(os.environ.get("FAKE_STEP_S", "0.2"))
CKPT_EVERY = int(os.environ.get("FAKE_CKPT_EVERY", "10"))
SPEED = os.environ.get("FAKE_SPEED", "")
METRICS_EVERY_S = float(os.environ.get("FAKE_METRICS_EVERY_S", "1.0"))
GLOBAL_BATCH = int(os.environ.get("FAKE_BATCH", "64"))
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
    if SPEED not in ("", "linear", "flat"):
        print(f"fake_trainer: FAKE_SPEED must be linear or flat, not {SPEED!r}", file=sys.stderr)
        return 2
    if SPEED and (os.path.islink(job_dir) or os.stat(job_dir).st_uid != os.getuid()):
        print(f"fake_trainer: {job_dir} is not this user's own directory", file=sys.stderr)
        return 2
    if SPEED:
        os.chmod(job_dir, 0o700)    # the shim's job directory is 0700 (train/jobdir.py)
    gpus = gpus_on_node * nodes
    step = _latest(job_dir)
    mark = (time.monotonic(), step)
    stop = {"flag": False}
    signal.signal(signal.SIGUSR2, lambda s, f: stop.update(flag=True))  # a flag only, as the shim does
    while True:
        if stop["flag"]:
            _commit(job_dir, step)
            open(os.path.join(job_dir, f"ACK-{job_id}-{restart}"), "w").close()
            return REQUEUE_EXIT_CODE
        time.sleep(STEP_S / max(gpus, 1) if SPEED == "linear" else STEP_S)
        step += 1
        if SPEED:
            mark = _write_metrics(job_dir, mark, step, gpus, nodes)
        else:
            with open(os.path.join(job_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "gpus": gpus, "t": time.time()}) + "\n")
        if step % CKPT_EVERY == 0:
            _commit(job_dir, step)


def _write_metrics(job_dir: str, mark: tuple[float, int], step: int, gpus: int, nodes: int) -> tuple[float, int]:
    """One row of the shim's schema when METRICS_EVERY_S has passed (the same rule as the shim's)."""
    t0, s0 = mark
    now = time.monotonic()
    if now - t0 < METRICS_EVERY_S or step == s0:
        return mark
    steps_per_s = (step - s0) / max(now - t0, 1e-9)
    row = {"step": step, "time": time.time(), "gpus": gpus, "nodes": nodes, "steps_per_s": steps_per_s,
           "samples_per_s": steps_per_s * GLOBAL_BATCH}
    fd = os.open(os.path.join(job_dir, "metrics.jsonl"),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (json.dumps(row, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)
    return now, step


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
