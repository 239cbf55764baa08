"""Node loss -> training again, phase by phase: shrink in place, the controller's requeue, and plain `--requeue`.

Runs its own 5-node x 4-GPU Slurm (private state dir, free ports) with
`SlurmdTimeout` as given (300 s by default, as at many sites); needs root and
Slurm. Both cases lose the same node at the same moment, the hard way (its
slurmd and every process of its jobs SIGKILLed; Slurm is told nothing):

- controller: a real DDP job (job_templates/ddp.sbatch, the digits example, one
  rank on each of two nodes), the daemon (no hysteresis, linear speeds); the
  survivor commits and writes its peer-lost report, the daemon gives the node
  up for that job, requeues it and excludes the node (docs/controller.md,
  "Node loss reported by the job");
- plain-requeue: a plain `sbatch --requeue` job (tests/control/fake_trainer.py,
  3 GPUs) on the same node, a free node elsewhere (the best case for plain
  Slurm); it waits for Slurm to mark the node DOWN, then for BeginTime.

- grow and rebalance-shrink (run first, the cluster as before afterwards): a DDP
  job of 1-2 GPUs starts at 1, grows to 2 when a node is freed, and is resized off
  that node when a rigid job asks for it; seconds from the plan's opening (signal,
  checkpoint, ACK, requeue at the new size, start, first step).
- shrink-kept and shrink-requeue (next): a DDP job of 1-2 GPUs on two nodes, nothing
  free elsewhere, gives a plain 1-GPU job the GPU it borrowed. shrink-kept (the
  default): the daemon gives its second node up in place, the survivor keeps its
  process (control/protocol.py, Plan.keep); shrink-requeue (SLURM_ELASTIC_KEEP_RANKS=0):
  signal, ACK, requeue at 1 GPU. Seconds from the plan's opening.

- kept and in-place (run next, on the same cluster, its node back after each): a DDP
  job of 1-2 GPUs on two nodes with nothing free anywhere else; the daemon gives the
  lost node up and does not requeue. kept (the default): the survivor keeps its
  process and re-forms the group alone (train/regroup.py); in-place
  (SLURM_ELASTIC_KEEP_RANKS=0): the template relaunches the ranks on the survivor.

Every other node is filled (3 GPUs each) by plain jobs, so the DDP job spans two
nodes; the spare node is freed just before the loss. Each row is a mark of the
restart, each column a case: seconds after the kill (control/phases.py says
where each mark comes from; for plain Slurm: the node DOWN, the job seen
requeued, its start time, its first step after).

    python3 benchmarks/controller_recovery.py                    # table
    python3 benchmarks/controller_recovery.py --json             # JSON list of rows
    python3 benchmarks/controller_recovery.py --slurmd-timeout 30 --skip-plain
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
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
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.phases import MARKS, last_restart
from slurm_elastic.control.plugin import lua_source
from slurm_elastic.devcluster import LocalCluster
from table import print_rows  # benchmarks/table.py: how every benchmark prints

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "tests" / "control"
TEMPLATE = ROOT / "job_templates" / "ddp.sbatch"
CLI = "import sys; from slurm_elastic.cli import main; sys.exit(main())"
NODES = ("n1", "n2", "n3", "n4", "n5")
LABELS = {"failed": "node lost (kill)", "detected": "detected (resize: plan opened)", "stopped": "ranks stopped",
          "committed": "checkpoint committed", "regrouped": "group re-formed (kept)",
          "requeued": "requeued (in place: shrunk)", "relaunched": "relaunched",
          "running": "running (Slurm start)", "attached": "ranks attached", "first_step": "first step"}


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


def wait(predicate, timeout: float, what: str, interval: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise SystemExit(f"timed out after {timeout:.0f} s: {what}")


def sbatch(env: dict[str, str], *args: str) -> int:
    out = subprocess.run(["sbatch", "--parsable", *args], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().split(";")[0])


def filler(env: dict[str, str], node: str, gpus: int = 3) -> int:
    return sbatch(env, f"--nodelist={node}", f"--gres=gpu:{gpus}", "--cpus-per-gpu=1", "--mem=1000", "--no-requeue",
                  "--job-name=filler", "--output=/dev/null", "--wrap", "sleep 3000")


def submit_ddp(env: dict[str, str], root: Path, gpus: str, loss_log: Path, *, keep_ranks: bool = True) -> int:
    out = subprocess.run([sys.executable, "-c", CLI, "sbatch", "--parsable", f"--gpus={gpus}",
                          f"--ckpt-dir={root / 'ckpt'}", f"--output={root}/%j.out", "--open-mode=append",
                          str(TEMPLATE), sys.executable, "-m", "slurm_elastic.train.examples.digits", "--steps",
                          "100000", "--step-sleep", "0.05", "--loss-log", str(loss_log), "--timeout-s", "600"],
                         env={**env, "SLURM_ELASTIC_KEEP_RANKS": "1" if keep_ranks else "0"}, capture_output=True,
                         text=True, check=True)
    return int(out.stdout.strip())


def batch_host(env: dict[str, str], job_id: int) -> str:
    show = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], env=env, capture_output=True, text=True).stdout
    return show.split("BatchHost=")[1].split()[0]


def in_place_case(env: dict[str, str], backend: CliBackend, local: LocalCluster, root: Path,
                  fillers: dict[str, int], *, keep_ranks: bool) -> dict[str, float]:
    """A DDP job of 1-2 GPUs on two nodes with nothing free anywhere else loses one: shrunk in place, the
    survivor's process kept (keep_ranks) or the ranks relaunched.

    Every node holds a 3-GPU filler; the fourth GPU of all but two nodes is taken too, so the job
    spans those two, and its survivor holds all it can get once one is lost. Afterwards the cluster
    is as before (the job and the extra fillers gone, the node back, its filler submitted again:
    the kill ended it)."""
    snap = backend.snapshot()
    free = [n.name for n in snap.nodes if n.gpus - n.gpus_alloc >= 1]
    extra = [filler(env, n, 1) for n in free[2:]]
    loss_log = root / f"inplace-{keep_ranks}.jsonl"
    job_id = submit_ddp(env, root, "1-2", loss_log, keep_ranks=keep_ranks)
    job = wait(lambda: (j := backend.snapshot().job(job_id)).state is JobState.RUNNING and len(j.nodes) == 2 and j,
               240, "the in-place job running on two nodes", 0.5)
    wait(lambda: len(rows_of(loss_log)) >= 5, 300, "the in-place job training", 0.5)
    victim = next(n for n in job.nodes if n != batch_host(env, job_id))
    failed = time.time()
    local.node_down(victim)
    kind = "peer loss, ranks kept" if keep_ranks else "peer loss, in place"

    def shrunk_and_training():    # kept ranks train again before the daemon's shrink is journaled
        if not [r for r in rows_of(loss_log) if r["world_size"] == 1][2:]:
            return None
        found = last_restart(backend.snapshot().job(job_id), Journal(root / "daemon" / "journal.sqlite"),
                             owner_uid=pwd.getpwnam("root").pw_uid)
        return found if found is not None and found.first_step is not None else None

    phases = wait(shrunk_and_training, 240, "the in-place job shrunk and training again", 0.5)
    if phases.kind != kind or backend.snapshot().job(job_id).restarts != 0:
        raise SystemExit(f"the daemon did not shrink the job in place ({kind}): {phases}")
    marks = {"failed": failed, **{m: getattr(phases, m) for m in MARKS[1:] if getattr(phases, m) is not None}}
    subprocess.run(["scancel", str(job_id), *map(str, extra)], env=env, check=True)
    local.node_up(victim, timeout=120)
    wait(lambda: not [j for j in backend.snapshot().jobs if j.job_id in (job_id, *extra) and not j.state.finished],
         120, "the in-place case's jobs gone")
    # The victim's filler died with its slurmd; Slurm, told by nobody (SlurmdTimeout), may still call it
    # running after the node's slurmd is back, so it is cancelled, and the node gets a new one.
    subprocess.run(["scancel", str(fillers[victim])], env=env, check=True)
    wait(lambda: backend.snapshot().job(fillers[victim]).state.finished, 120, "the lost node's filler ended")
    fillers[victim] = filler(env, victim)
    wait(lambda: all(backend.snapshot().job(j).state is JobState.RUNNING for j in fillers.values()), 60,
         "the fillers running again")
    return marks


def healthy_shrink_case(env: dict[str, str], backend: CliBackend, root: Path, *, keep_ranks: bool) -> dict[str, float]:
    """A rebalance shrink on healthy nodes, marks from the plan's opening: a DDP job of 1-2 GPUs on two nodes
    (nothing free anywhere else) gives a plain 1-GPU job the GPU it borrowed. keep_ranks: its batch script
    says its ranks go on, so the daemon gives the second node up in place (its rank there SIGKILLed by Slurm,
    the survivor commits and goes on); otherwise signal, ACK, requeue at 1 GPU. Afterwards the cluster is as
    before."""
    snap = backend.snapshot()
    free = [n.name for n in snap.nodes if n.gpus - n.gpus_alloc >= 1]
    extra = [filler(env, n, 1) for n in free[2:]]
    loss_log = root / f"shrink-{keep_ranks}.jsonl"
    job_id = submit_ddp(env, root, "1-2", loss_log, keep_ranks=keep_ranks)
    wait(lambda: (j := backend.snapshot().job(job_id)).state is JobState.RUNNING and len(j.nodes) == 2, 240,
         "the shrink job running on two nodes", 0.5)
    marker = root / "ckpt" / str(job_id) / f"keeps-ranks-{job_id}-0"
    wait(lambda: len(rows_of(loss_log)) >= 5 and marker.exists() == keep_ranks, 300, "the shrink job training", 0.5)
    rigid = sbatch(env, "--gres=gpu:1", "--cpus-per-gpu=1", "--mem=100", "--no-requeue", "--job-name=rigid",
                   "--output=/dev/null", "--wrap", "sleep 3000")
    kind = "resize, ranks kept" if keep_ranks else "resize"

    def shrunk_and_training():
        if not [r for r in rows_of(loss_log) if r["world_size"] == 1][2:]:
            return None
        found = last_restart(backend.snapshot().job(job_id), Journal(root / "daemon" / "journal.sqlite"),
                             owner_uid=pwd.getpwnam("root").pw_uid)
        return found if found is not None and found.first_step is not None else None

    phases = wait(shrunk_and_training, 300, f"the job shrunk ({kind}) and training again", 0.5)
    if phases.kind != kind:
        raise SystemExit(f"not the shrink expected ({kind}): {phases}")
    wait(lambda: backend.snapshot().job(rigid).state is JobState.RUNNING, 120, "the rigid job running")
    subprocess.run(["scancel", str(job_id), str(rigid), *map(str, extra)], env=env, check=True)
    wait(lambda: not [j for j in backend.snapshot().jobs if j.job_id in (job_id, rigid, *extra)
                      and not j.state.finished], 120, "the shrink case's jobs gone")
    return {m: getattr(phases, m) for m in MARKS[1:] if getattr(phases, m) is not None}


def resize_case(env: dict[str, str], backend: CliBackend, root: Path,
                fillers: dict[str, int]) -> tuple[dict[str, float], dict[str, float]]:
    """Resizes on healthy nodes, marks from the plan's opening: a DDP job of 1-2 GPUs starts at 1 (one GPU
    free in the cluster), grows to 2 when a node is freed, and gives 3 GPUs of that node to a rigid job
    (shrunk to 1, or moved to 1 + 1 on two nodes: the solve's choice). Afterwards the cluster is as before."""
    journal = root / "daemon" / "journal.sqlite"
    extra = {n: filler(env, n, 1) for n in NODES[1:]}
    wait(lambda: all(backend.snapshot().job(j).state is JobState.RUNNING for j in extra.values()), 60,
         "the extra fillers running")
    log = root / "resize.jsonl"
    job_id = submit_ddp(env, root, "1-2", log)
    wait(lambda: backend.snapshot().job(job_id).state is JobState.RUNNING, 240, "the resize job running", 0.5)
    wait(lambda: len(rows_of(log)) >= 5, 300, "the resize job training", 0.5)

    def resized(restarts: int, gpus: int | None, what: str) -> dict[str, float]:
        def trained_since_start() -> bool:   # rows of the new incarnation: the old one trains until the signal
            j = backend.snapshot().job(job_id)
            if j.restarts < restarts or j.state is not JobState.RUNNING or gpus not in (None, j.gpus) \
                    or j.start_time is None:
                return False
            return len([r for r in rows_of(log) if r.get("time", 0) >= j.start_time]) > 2
        wait(trained_since_start, 600, what, 0.5)
        phases = last_restart(backend.snapshot().job(job_id), Journal(journal), owner_uid=pwd.getpwnam("root").pw_uid)
        if phases is None or phases.kind != "resize":
            raise SystemExit(f"not a controller resize ({what}): {phases}")
        marks = {m: getattr(phases, m) for m in MARKS[1:] if getattr(phases, m) is not None}
        return marks

    freed = NODES[1]
    subprocess.run(["scancel", str(fillers[freed]), str(extra.pop(freed))], env=env, check=True)
    grow = resized(1, 2, "the job grown to 2 GPUs")
    rigid = filler(env, freed, 3)
    shrink = resized(2, None, "the job resized off the GPUs a rigid job needs")   # 1 GPU, or 1 + 1 beside it
    wait(lambda: backend.snapshot().job(rigid).state is JobState.RUNNING, 120, "the rigid job running")
    subprocess.run(["scancel", str(job_id), str(rigid), *map(str, extra.values())], env=env, check=True)
    wait(lambda: not [j for j in backend.snapshot().jobs if j.job_id in (job_id, rigid, *extra.values())
                      and not j.state.finished], 120, "the resize case's jobs gone")
    fillers[freed] = filler(env, freed)
    wait(lambda: all(backend.snapshot().job(j).state is JobState.RUNNING for j in fillers.values()), 60,
         "the fillers running again")
    return grow, shrink


def rows_of(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    parser.add_argument("--slurmd-timeout", type=int, default=300, help="SlurmdTimeout of the cluster (s)")
    parser.add_argument("--skip-plain", action="store_true", help="do not wait for plain Slurm (SlurmdTimeout + 120 s)")
    parser.add_argument("--skip-in-place", action="store_true", help="do not run the shrink-in-place case first")
    parser.add_argument("--skip-resize", action="store_true", help="do not run the grow and rebalance-shrink cases")
    parser.add_argument("--keep", action="store_true", help="keep the scratch dir (logs, job outputs) and say where")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (the local cluster runs slurmd)")
    root = Path(tempfile.mkdtemp(prefix="se-bench-", dir="/tmp"))
    os.chmod(root, 0o755)
    for name in ("fake_trainer.py", "fake_trainer.sbatch"):
        shutil.copy(TRAINER / name, root / name)
    (root / "job_submit.lua").write_text(lua_source())
    local = LocalCluster(root / "cluster")
    local.up(nodes=len(NODES), spares=0, port_base=free_port_base(len(NODES)), job_submit_lua=root / "job_submit.lua",
             timeout=90, slurmd_timeout=args.slurmd_timeout)
    env = {**os.environ, **local.env(), "FAKE_TRAINER": str(root / "fake_trainer.py"), "FAKE_PYTHON": sys.executable,
           "SLURM_ELASTIC_DAEMON_DIR": str(root / "daemon")}
    backend = CliBackend(env=env)
    daemon = None
    marks: dict[str, dict[str, float]] = {"grow": {}, "rebalance-shrink": {}, "shrink-kept": {},
                                          "shrink-requeue": {}, "kept": {}, "in-place": {}, "controller": {},
                                          "plain-requeue": {}}
    try:
        # No hysteresis and the linear speed model: the resize case's grow comes at once and is a grow (the
        # digits job measures no faster at 2 CPU ranks); a lost node overrides hysteresis anyway.
        daemon = subprocess.Popen([sys.executable, "-c", CLI, "-v", "admin", "daemon", "--interval", "2",
                                   "--ack-timeout", "20", "--hysteresis", "0", "--speed", "linear"], env=env,
                                  stdout=open(root / "daemon.log", "w"), stderr=subprocess.STDOUT)
        fillers = {n: filler(env, n) for n in NODES}
        wait(lambda: all(backend.snapshot().job(j).state is JobState.RUNNING for j in fillers.values()), 60,
             "the fillers running")
        if not args.skip_resize:
            marks["grow"], marks["rebalance-shrink"] = resize_case(env, backend, root, fillers)
            marks["shrink-kept"] = healthy_shrink_case(env, backend, root, keep_ranks=True)
            marks["shrink-requeue"] = healthy_shrink_case(env, backend, root, keep_ranks=False)
        if not args.skip_in_place:
            marks["kept"] = in_place_case(env, backend, local, root, fillers, keep_ranks=True)
            marks["in-place"] = in_place_case(env, backend, local, root, fillers, keep_ranks=False)
        loss_log = root / "loss.jsonl"
        ddp = submit_ddp(env, root, "2-2", loss_log)
        job = wait(lambda: (j := backend.snapshot().job(ddp)).state is JobState.RUNNING and len(j.nodes) == 2 and j,
                   240, "the DDP job running on two nodes", 0.5)
        wait(lambda: len(rows_of(loss_log)) >= 5, 300, "the DDP job training", 0.5)
        victim = next(n for n in job.nodes if n != batch_host(env, ddp))
        spare = next(n for n in NODES if n not in job.nodes)
        plain = None
        if not args.skip_plain:
            # The victim's filler becomes the plain --requeue job (the only node with room for it; not
            # pinned there, so that it may restart elsewhere); the spare node is freed for both cases.
            subprocess.run(["scancel", str(fillers[victim])], env=env, check=True)
            wait(lambda: backend.snapshot().node(victim).gpus_alloc == 1, 60, "the victim's filler gone")
            plain_ckpt = root / "plain-ckpt"
            plain = sbatch(env, "--gres=gpu:3", "--cpus-per-gpu=1", "--mem=1000", "--requeue",
                           "--job-name=plain", f"--output={root}/%j.out",
                           f"--export=ALL,SLURM_ELASTIC_CKPT_DIR={plain_ckpt}", str(root / "fake_trainer.sbatch"))
            wait(lambda: (j := backend.snapshot().job(plain)).state is JobState.RUNNING and j.nodes == (victim,), 60,
                 "the plain job running on the node to be lost")
            wait(lambda: rows_of(plain_ckpt / str(plain) / "metrics.jsonl"), 60, "the plain job stepping")
        subprocess.run(["scancel", str(fillers[spare])], env=env, check=True)
        wait(lambda: backend.snapshot().node(spare).gpus_alloc == 0, 60, "the spare node free")

        failed = time.time()
        local.node_down(victim)
        for case in ("controller", "plain-requeue"):
            marks[case]["failed"] = failed
        plain_restarts = None if plain is None else backend.snapshot().job(plain).restarts

        def controller_done() -> bool:
            return backend.snapshot().job(ddp).restarts >= 1 and len(rows_of(loss_log)) > rows_before + 2

        rows_before = len(rows_of(loss_log))
        phases = None
        deadline = time.monotonic() + 300 + args.slurmd_timeout + 240
        pending = {"controller"} | ({"plain-requeue"} if plain is not None else set())
        while pending and time.monotonic() < deadline:
            state = backend.snapshot()
            now = time.time()
            if "controller" in pending and controller_done():
                # Read now: the metrics rows since the restart soon outgrow what phases.py reads of them.
                phases = last_restart(state.job(ddp), Journal(root / "daemon" / "journal.sqlite"),
                                      owner_uid=pwd.getpwnam("root").pw_uid)
                pending.discard("controller")
            if plain is not None and "plain-requeue" in pending:
                m = marks["plain-requeue"]
                pj = state.job(plain)
                if "detected" not in m and state.node(victim).state is NodeState.DOWN:
                    m["detected"] = now
                if "requeued" not in m and pj.restarts > (plain_restarts or 0):
                    m["requeued"] = now
                if "running" not in m and pj.state is JobState.RUNNING and pj.restarts > (plain_restarts or 0):
                    m["running"] = float(pj.start_time or now)
                if "running" in m:
                    after = [r["t"] for r in rows_of(plain_ckpt / str(plain) / "metrics.jsonl")
                             if r.get("t", 0) > m["running"]]
                    if after:
                        m["first_step"] = after[0]
                        pending.discard("plain-requeue")
            time.sleep(0.5)
        if pending:
            raise SystemExit(f"timed out waiting for {', '.join(sorted(pending))}")
        if phases is None or phases.kind != "peer loss":
            raise SystemExit(f"the daemon did not act on the job's report: {phases}")
        for mark in MARKS[1:]:
            if getattr(phases, mark) is not None:
                marks["controller"][mark] = getattr(phases, mark)
        new_job = backend.snapshot().job(ddp)
        if victim in new_job.nodes:
            raise SystemExit(f"the DDP job was put back on the lost node {victim}")
    except SystemExit:
        log = root / "daemon.log"
        if log.exists():
            print(log.read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
        local.down()
        if args.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    cases = [c for c in marks if len(marks[c]) > 1]
    base = {c: marks[c].get("failed", marks[c].get("detected", 0.0)) for c in cases}   # a resize: the plan
    rows = []
    for mark in MARKS:
        if not any(mark in marks[c] for c in cases):
            continue
        rows.append({"mark": LABELS[mark], **{f"{c}_s": (round(marks[c][mark] - base[c], 1)
                                                          if mark in marks[c] else None) for c in cases}})
    print_rows(rows, args.json, columns=("mark", *(f"{c}_s" for c in cases)),
               title=f"seconds after the node was lost, or (grow, *shrink*) after the plan opened "
                     f"(SlurmdTimeout={args.slurmd_timeout} s, Slurm {backend.version})")


if __name__ == "__main__":
    main()
