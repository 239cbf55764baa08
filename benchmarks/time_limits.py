"""A training run longer than its job's wall time: it rides through its time limits on a real Slurm, and ends
with the weights of a run that never stopped.

Brings up a private 1-node local cluster (needs root and Slurm), the admin daemon beside it (as a site
runs it: it starts a job that requeued itself at once instead of after Slurm's BeginTime), and submits
the digits example (job_templates/ddp.sbatch, one rank, float64, bit-for-bit resumable) through
`slurm-elastic sbatch --time=<wall> --signal-before=<s>` with as many steps as `--train-min` minutes of
training at the step time measured first. At each warning the job commits, requeues itself and the
next incarnation resumes at the committed step. When the job has COMPLETED, the same steps run
uninterrupted in one process and the final parameters are compared.

    python3 benchmarks/time_limits.py                        # 5-minute wall time, 30 minutes of training
    python3 benchmarks/time_limits.py --wall-min 2 --train-min 6 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from table import print_rows  # benchmarks/table.py: how every benchmark prints  # noqa: E402

from slurm_elastic.cluster.cli_backend import CliBackend  # noqa: E402
from slurm_elastic.cluster.model import JobState  # noqa: E402
from slurm_elastic.control.plugin import lua_source  # noqa: E402
from slurm_elastic.devcluster import LocalCluster, processes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "job_templates" / "ddp.sbatch"
CLI = "import sys; from slurm_elastic.cli import main; sys.exit(main())"
DIGITS = [sys.executable, "-m", "slurm_elastic.train.examples.digits"]


def alone_env(ckpt: Path, job: str) -> dict[str, str]:
    """One rank as srun would start it, outside Slurm (the reference run and the step-time probe)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update({"SLURM_JOB_ID": job, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
                "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "1", "SLURM_NODELIST": "localhost",
                "SLURM_RESTART_COUNT": "0", "SLURM_ELASTIC_CKPT_DIR": str(ckpt), "OMP_NUM_THREADS": "1"})
    return env


def rows_of_run(where: Path, digits_args: list[str]) -> list[dict]:
    """Run the digits example alone with `digits_args`; its loss log's rows."""
    where.mkdir()
    subprocess.run([*DIGITS, *digits_args, "--loss-log", str(where / "loss.jsonl")], env=alone_env(where / "ck", "1"),
                   check=True, capture_output=True)
    return rows_of(where / "loss.jsonl")


def rows_of(path: Path) -> list[dict]:
    try:
        return [json.loads(t) for t in path.read_text().splitlines() if t.strip()]
    except (OSError, ValueError):
        return []


def final_params(ckpt: Path) -> dict[str, list]:
    (path,) = ckpt.glob("*/final-params.json")      # the one job's directory
    return json.loads(path.read_text())["params"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wall-min", type=int, default=5, help="the job's --time, minutes")
    p.add_argument("--train-min", type=float, default=30.0, help="minutes of training the run needs")
    p.add_argument("--signal-before", type=int, default=60, help="the warning, seconds before the limit")
    p.add_argument("--step-sleep", type=float, default=0.2, help="seconds each step sleeps (the GPU's work)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (the local cluster runs slurmd)")
    root = Path(tempfile.mkdtemp(prefix="se-limits-", dir="/tmp"))
    os.chmod(root, 0o755)

    # The step time on this machine now, so that the run needs --train-min minutes of training.
    probe = rows_of_run(root / "probe", ["--steps", "50", "--step-sleep", str(args.step_sleep)])
    step_s = (probe[-1]["time"] - probe[0]["time"]) / (len(probe) - 1)
    steps = int(args.train_min * 60 / step_s)

    (root / "job_submit.lua").write_text(lua_source())
    local = LocalCluster(root / "cluster")
    local.up(nodes=1, spares=0, port_base=processes.free_port_base(6), job_submit_lua=root / "job_submit.lua", timeout=90)
    env = {**os.environ, **local.env(), "SLURM_ELASTIC_DAEMON_DIR": str(root / "daemon")}
    backend = CliBackend(env=env)
    daemon = subprocess.Popen([sys.executable, "-c", CLI, "-v", "admin", "daemon", "--interval", "2"], env=env,
                              stdout=open(root / "daemon.log", "w"), stderr=subprocess.STDOUT)
    ckpt, loss_log = root / "ckpt", root / "loss.jsonl"
    ckpt.mkdir()
    os.chmod(ckpt, 0o1777)
    try:
        out = subprocess.run([sys.executable, "-c", CLI, "sbatch", "--parsable", "--gpus=1",
                              f"--time={args.wall_min}", f"--signal-before={args.signal_before}",
                              f"--ckpt-dir={ckpt}", f"--output={root}/%j.out", "--open-mode=append", str(TEMPLATE),
                              *DIGITS, "--steps", str(steps), "--step-sleep", str(args.step_sleep),
                              "--loss-log", str(loss_log)], env=env, capture_output=True, text=True, check=True)
        job = int(out.stdout.strip())
        start = time.time()
        budget = args.train_min * 60 * 4 + 1800
        while True:
            state = backend.snapshot().job(job)
            if state is None or state.state.finished:
                break
            if time.time() - start > budget:
                raise SystemExit(f"job {job} not finished after {budget:.0f} s: {state}")
            time.sleep(5)
        wall_s = time.time() - start
        show = subprocess.run(["scontrol", "-o", "show", "job", str(job)], env=env, capture_output=True,
                              text=True).stdout
        restarts = int(show.split("Restarts=")[1].split()[0]) if "Restarts=" in show else None
        text = (root / f"{job}.out").read_text()
    finally:
        daemon.terminate()
        daemon.wait(60)
        local.down()

    rows = rows_of(loss_log)
    logged = [r["step"] for r in rows]
    # Training time: the time between consecutive logged steps of one incarnation (a gap across a
    # requeue is not training).
    gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    train_s = sum(g for g in gaps if g < 10 * step_s + 5)
    requeues = text.count("requeues itself before its end")

    ref = root / "ref"
    rows_of_run(ref, ["--steps", str(steps)])
    a, b = final_params(ckpt), final_params(ref / "ck")
    diff = max(abs(x - y) for name in a for xs, ys in [(_flat(a[name]), _flat(b[name]))] for x, y in zip(xs, ys))
    row = {"wall_time_min": args.wall_min, "steps": steps, "training_min": round(train_s / 60, 1),
           "job_wall_min": round(wall_s / 60, 1), "time_limits_ridden": requeues, "slurm_restarts": restarts,
           "final_state": show.split("JobState=")[1].split()[0] if "JobState=" in show else None,
           "every_step_once": logged == list(range(1, steps + 1)),
           "weights_max_abs_diff": diff}
    print_rows([row], args.json, title=None if args.json else
               f"digits (1 rank) at {step_s:.3f} s/step, --time={args.wall_min} --signal-before={args.signal_before},"
               f" the daemon running; the reference ran the same {steps} steps uninterrupted")
    if args.keep:
        print(f"kept {root}", file=sys.stderr)
    return 0 if row["every_step_once"] and diff == 0.0 else 1


def _flat(value: object) -> list[float]:
    if isinstance(value, list):
        return [x for v in value for x in _flat(v)]
    return [float(value)]  # type: ignore[arg-type]


if __name__ == "__main__":
    raise SystemExit(main())
