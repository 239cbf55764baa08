"""Node loss -> the affected job running again: with the slurm-elastic daemon, and with plain `--requeue`.

Runs its own 4-node x 4-GPU Slurm (private state dir, free ports), so nothing
else is touched; needs root and Slurm. The node is lost the hard way (slurmd
and its jobs SIGKILLed); Slurm marks it DOWN after its SlurmdTimeout. Times
are measured from the moment `scontrol` shows the node DOWN.

    python3 benchmarks/controller_recovery.py           # table
    python3 benchmarks/controller_recovery.py --json    # JSON list, one row per case

Cases:
- controller: three elastic jobs (4-8/4, 4-8/4, 2-4/2 GPUs) fill 16 GPUs, daemon
  cycle 2 s; the jobs that ran on n2 are resized to what is left and run again.
- plain-requeue: a plain `sbatch --requeue -N1 --gres=gpu:4` job on n2, free
  nodes elsewhere (the best case for plain Slurm); it waits for BeginTime.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slurm_elastic.cluster.cli_backend import CliBackend
from slurm_elastic.cluster.model import JobState, NodeState
from slurm_elastic.control.plugin import lua_source
from slurm_elastic.devcluster import LocalCluster
from table import print_rows  # benchmarks/table.py: how every benchmark prints

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "tests" / "control"
CLI = "import sys; from slurm_elastic.cli import main; sys.exit(main())"


def free_port_base(nodes: int) -> int:
    for base in range(19017, 30000, 17):
        ok = True
        for port in [base, base + 1, *range(base + 4, base + 4 + nodes)]:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise SystemExit("no free ports")


def wait(predicate, timeout: float, what: str, interval: float = 0.1):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise SystemExit(f"timed out after {timeout:.0f} s: {what}")


def time_recovery(local: LocalCluster, backend: CliBackend, job_ids: list[int], node: str,
                  timeout: float) -> dict[str, float]:
    on_node = [j.job_id for j in backend.snapshot().jobs if j.job_id in job_ids and node in j.nodes]
    restarts = {j.job_id: j.restarts for j in backend.snapshot().jobs if j.job_id in on_node}
    t_kill = time.monotonic()
    local.node_down(node)
    wait(lambda: backend.snapshot().node(node).state is NodeState.DOWN, 120, f"{node} DOWN")
    t_down = time.monotonic()

    def back() -> bool:
        jobs = {j.job_id: j for j in backend.snapshot().jobs}
        return all(jobs[j].state is JobState.RUNNING and jobs[j].restarts > restarts[j] for j in on_node)

    wait(back, timeout, "the lost node's jobs running again", interval=0.2)
    t_run = time.monotonic()
    state = backend.snapshot()
    return {"kill_to_down_s": round(t_down - t_kill, 2), "down_to_running_s": round(t_run - t_down, 2),
            "jobs_on_node": len(on_node),
            "gpus_after": sum(j.gpus for j in state.jobs if j.job_id in job_ids and j.state is JobState.RUNNING)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    parser.add_argument("--skip-plain", action="store_true", help="skip the ~2.5 min plain --requeue case")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (the local cluster runs slurmd)")
    root = Path(tempfile.mkdtemp(prefix="se-bench-", dir="/tmp"))
    os.chmod(root, 0o755)
    for name in ("fake_trainer.py", "fake_trainer.sbatch"):
        shutil.copy(TRAINER / name, root / name)
    (root / "job_submit.lua").write_text(lua_source())
    local = LocalCluster(root / "cluster")
    local.up(nodes=4, spares=0, port_base=free_port_base(4), job_submit_lua=root / "job_submit.lua")
    env = {**os.environ, **local.env(), "FAKE_TRAINER": str(root / "fake_trainer.py"),
           "SLURM_ELASTIC_DAEMON_DIR": str(root / "daemon")}
    backend = CliBackend(env=env)
    rows = []
    daemon = None
    try:
        daemon = subprocess.Popen([sys.executable, "-c", CLI, "-v", "admin", "daemon", "--interval", "2",
                                   "--hysteresis", "0", "--ack-timeout", "15"], env=env,
                                  stdout=open(root / "daemon.log", "w"), stderr=subprocess.STDOUT)
        ids = []
        for gpus, step in (("4-8", "4"), ("4-8", "4"), ("2-4", "2")):
            out = subprocess.run([sys.executable, "-c", CLI, "sbatch", "--parsable", f"--gpus={gpus}",
                                  f"--gpu-step={step}", f"--ckpt-dir={root / 'ckpt'}", f"--output={root}/%j.out",
                                  str(root / "fake_trainer.sbatch")], env=env, capture_output=True, text=True,
                                 check=True)
            ids.append(int(out.stdout.strip()))
        wait(lambda: sum(j.gpus for j in backend.snapshot().jobs
                         if j.job_id in ids and j.state is JobState.RUNNING) == 16, 120, "16 GPUs in use", 0.5)
        time.sleep(5)  # let the daemon settle its first plans
        row = {"case": "controller", **time_recovery(local, backend, ids, "n2", 120)}
        rows.append(row)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        daemon = None
        subprocess.run(["scancel", *map(str, ids)], env=env, check=False)
        local.node_up("n2")
        if not args.skip_plain:
            wait(lambda: not [j for j in backend.snapshot().jobs if not j.state.finished], 60, "jobs gone")
            sb = ["sbatch", "--parsable", "--requeue", "-N1", "--gres=gpu:4", "--mem=1G", f"--output={root}/%j.out"]
            filler = int(subprocess.run([*sb, "-w", "n1", str(root / "fake_trainer.sbatch")], env=env,
                                        capture_output=True, text=True, check=True).stdout.strip())
            job = int(subprocess.run([*sb, "-x", "n1", str(root / "fake_trainer.sbatch")], env=env,
                                     capture_output=True, text=True, check=True).stdout.strip())
            node = wait(lambda: (j := backend.snapshot().job(job)).state is JobState.RUNNING and j.nodes[0], 60,
                        "plain job running")
            rows.append({"case": "plain-requeue", **time_recovery(local, backend, [job, filler], node, 400)})
    except SystemExit:
        log = root / "daemon.log"
        if log.exists():
            print(log.read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        if daemon is not None:
            daemon.kill()
        local.down()
        shutil.rmtree(root, ignore_errors=True)
    print_rows(rows, args.json, columns=("case", "kill_to_down_s", "down_to_running_s", "jobs_on_node",
                                         "gpus_after"))


if __name__ == "__main__":
    main()
