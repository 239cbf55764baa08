"""Just-in-time checkpoints on peer loss: a rank of 3 dies (SIGKILL) or freezes (SIGSTOP) at many points of a step.

Real processes (forked from one interpreter that imported torch once), gloo on
loopback, DDP with several gradient buckets. For each kill point the test checks
that the survivors committed exactly the last step every survivor had applied
(0 completed steps lost), that the committed files hold that step's state
bit for bit (the digest of a run that lost nobody: no torn or mixed commit),
that the peer-lost report names the lost rank and node, and that a frozen
victim woken afterwards commits nothing.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.checkpointer import state_digest
from slurm_elastic.train.store import CheckpointStore

from .launch import rank_envs

MODULE = "tests.train.jit_trainer"
STEPS = 8
DIE_AT = 4
NODES = ["n0", "n1", "n2"]
REPO = Path(__file__).resolve().parents[2]


class ForkServer:
    """tests/train/forkserver.py: one interpreter with torch imported, forking the ranks of each job."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.train.forkserver", MODULE], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def start(self, args: list[str], logs: Path, *, world_size: int = 3, job_id: str = "900",
              restart_count: int = 0) -> list[int]:
        logs.mkdir(parents=True, exist_ok=True)
        envs = rank_envs(world_size=world_size, job_id=job_id, restart_count=restart_count,
                         nodes=NODES[:world_size])
        job = {"args": args, "envs": envs, "logs": [str(logs / f"rank{r}.log") for r in range(world_size)]}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["pids"]

    def codes(self) -> list[int]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)["codes"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    server = ForkServer()
    yield server
    server.close()


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _args(tmp: Path, *extra: str) -> list[str]:
    return ["--ckpt-dir", str(tmp / "ck"), "--log-dir", str(tmp), "--steps", str(STEPS), *extra]


@pytest.fixture(scope="module")
def reference(forks: ForkServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, object]]:
    """A run that loses nobody: the state digest and the loss after every step."""
    tmp = tmp_path_factory.mktemp("reference")
    forks.start(_args(tmp), tmp)
    assert forks.codes() == [0, 0, 0], (tmp / "rank0.log").read_text()[-3000:]
    digests = {r["step"]: r["digest"] for r in _rows(tmp / "applied-0.jsonl")}
    for rank in (1, 2):      # DDP replicas are bit-identical: the premise of committing from one of them
        assert {r["step"]: r["digest"] for r in _rows(tmp / f"applied-{rank}.jsonl")} == digests
    return {"digest": digests, "loss": {r["step"]: r["loss"] for r in _rows(tmp / "loss.jsonl")}}


@dataclass(frozen=True)
class Case:
    victim: int
    point: str
    mode: str                 # kill (connections reset) or stop (frozen: only the heartbeat tells)
    every_steps: int | None = None
    lag: str | None = None    # RANK:POINT:SECONDS - a survivor late at a point of the same step
    catch: str | None = None  # how the loop treats exceptions (jit_trainer --catch)

    @property
    def id(self) -> str:
        lag = f"-lag{self.lag.replace(':', '-')}" if self.lag else ""
        every = f"-every{self.every_steps}" if self.every_steps else ""
        catch = f"-{self.catch}" if self.catch else ""
        return f"r{self.victim}-{self.point}-{self.mode}{every}{lag}{catch}"


CASES = [
    Case(2, "forward", "kill"),
    Case(2, "mid-forward", "stop", every_steps=1),          # a periodic snapshot half taken, half written
    Case(1, "bucket-first", "kill"),
    Case(1, "bucket-last", "stop"),                         # some gradient buckets reduced, not all
    Case(2, "bucket-done", "kill"),
    Case(0, "bucket-done", "stop"),                         # rank 0 lost: rank 1 commits
    Case(2, "after-backward", "kill"),
    Case(0, "before-step", "stop"),
    Case(2, "in-step", "kill"),
    Case(1, "after-step", "stop"),
    Case(2, "after-agree", "kill", every_steps=1),
    Case(0, "mid-forward", "kill", every_steps=1),
    # Survivors at different steps: one applied step 4, the other had not when the loss was seen.
    Case(2, "before-step", "stop", lag="1:before-step:8"),
    Case(2, "after-step", "kill", lag="0:before-step:8"),
    # A survivor halfway through its optimizer step when the loss is seen: it finishes first.
    Case(2, "before-step", "stop", lag="1:in-step:8"),
]
LONG_CASES = [Case(v, p, m, every_steps=e) for v in range(3) for p in
              ("forward", "mid-forward", "bucket-first", "bucket-last", "bucket-done", "after-backward",
               "before-step", "in-step", "after-step", "after-agree") for m in ("kill", "stop") for e in (None, 1)]

RESULTS: list[dict] = []


def _run_case(forks: ForkServer, reference: dict, tmp: Path, case: Case) -> dict:
    extra = ["--die", f"{case.victim}:{DIE_AT}:{case.point}:{case.mode}"]
    if case.every_steps:
        extra += ["--every-steps", str(case.every_steps)]
    if case.catch:
        extra += ["--catch", case.catch]
    if case.lag:
        rank, point, seconds = case.lag.split(":")
        extra += ["--lag", f"{rank}:{DIE_AT}:{point}:{seconds}"]
    pids = forks.start(_args(tmp, *extra), tmp)
    job_dir = tmp / "ck" / "900"
    report_path = job_dir / protocol.peer_lost_file_name("900", 0, 0)
    survivors = [r for r in range(3) if r != case.victim]

    def report() -> protocol.PeerLostReport | None:
        try:
            return protocol.PeerLostReport.parse(report_path.read_bytes())
        except (OSError, ValueError):
            return None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (report() is None or report().commit == "pending"):
        time.sleep(0.2)
    got = report()
    assert got is not None and got.commit != "pending", f"no final report; rank logs:\n" + \
        "\n".join((tmp / f"rank{r}.log").read_text()[-1500:] for r in range(3))
    latest = (job_dir / protocol.LATEST_FILE).read_text() if (job_dir / protocol.LATEST_FILE).exists() else None
    if case.mode == "stop":
        os.kill(pids[case.victim], signal.SIGCONT)     # woken after the fact: must commit nothing
    codes = forks.codes()
    logs = "\n".join(f"--- rank {r}\n" + (tmp / f"rank{r}.log").read_text()[-2000:] for r in range(3))
    assert [codes[r] for r in survivors] == [protocol.PEER_LOST_EXIT_CODE] * 2, (codes, logs)
    woken = protocol.PEER_LOST_EXIT_CODE      # a frozen victim, woken, finds the decision and leaves
    assert codes[case.victim] == (-signal.SIGKILL if case.mode == "kill" else woken), (codes, logs)
    latest_after = (job_dir / protocol.LATEST_FILE).read_text() if (job_dir / protocol.LATEST_FILE).exists() else None
    assert latest_after == latest, "the woken victim changed the checkpoint"

    applied = {r: [row["step"] for row in _rows(tmp / f"applied-{r}.jsonl")] for r in survivors}
    expected = min(max(steps, default=0) for steps in applied.values())
    completed = max((row["step"] for row in _rows(tmp / "loss.jsonl")), default=0)
    assert got.lost == (protocol.LostRank(case.victim, NODES[case.victim]),) and got.lost_nodes == (NODES[case.victim],)
    if case.mode == "stop":
        assert got.detected_by == "heartbeat"     # nothing else can tell: no connection was closed
    assert got.commit == "done", (got, logs)
    assert got.committed_step == got.agreed_step == expected, (got, applied, logs)   # 0 completed steps lost
    assert expected >= completed
    assert latest_after is not None and protocol.parse_step_dir_name(latest_after.strip()) == expected
    store = CheckpointStore(str(job_dir))
    manifest = store.read_manifest(expected)
    assert manifest["user_state"].get("computing") == expected, manifest["user_state"]   # as at that step
    tensors = [kv for t in store.read_files(expected, manifest["files"]) for kv in t.items()]
    on_disk = state_digest(tensors)
    torn = on_disk != reference["digest"][expected]
    row = {"case": case.id, "committed_step": expected, "applied": {str(r): max(s) for r, s in applied.items()},
           "torn": torn, "detected_by": got.detected_by,
           "jit": "jit" in manifest and manifest["jit"]["digest"] == reference["digest"][expected]}
    RESULTS.append(row)
    assert not torn, (row, logs)
    assert row["jit"], manifest.get("jit")
    return {"step": expected, "codes": codes}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_peer_loss_commits_the_last_step_all_survivors_applied(forks: ForkServer, reference: dict, tmp_path: Path,
                                                              case: Case) -> None:
    _run_case(forks, reference, tmp_path, case)


@pytest.mark.long
@pytest.mark.parametrize("case", LONG_CASES, ids=[c.id for c in LONG_CASES])
def test_peer_loss_every_point_rank_and_mode(forks: ForkServer, reference: dict, tmp_path: Path, case: Case) -> None:
    _run_case(forks, reference, tmp_path, case)


# A victim killed while the survivors are in a collective (DDP's gradient all-reduce, or the loop's
# own all-reduce): the error reaches the user's loop, which hides it in each framework's way.
CATCH_CASES = [Case(2, point, "kill", catch=catch)
               for catch in ("carry-on", "swallow", "hydra", "hydra-detached", "lightning")
               for point in ("bucket-first", "after-backward")]


@pytest.mark.parametrize("case", CATCH_CASES, ids=[c.id for c in CATCH_CASES])
def test_the_commit_happens_whatever_the_loop_does_with_the_error(forks: ForkServer, reference: dict,
                                                                  tmp_path: Path, case: Case) -> None:
    """A loop that swallows the error and goes on (even to optimizer_step), a Hydra-style runner that
    logs and exits 1, a Lightning-style one that raises its own error: the survivors still commit the
    last step all of them completed (bit for bit the reference's) and end with the peer-lost code."""
    _run_case(forks, reference, tmp_path, case)


def test_an_error_of_every_ranks_own_under_a_hydra_style_runner_is_not_a_lost_peer(forks: ForkServer,
                                                                                    tmp_path: Path) -> None:
    """Every rank raises at step 3, half a second apart, and the runner exits 1 after its except block:
    each rank looks for a lost peer for one liveness timeout, finds none (the first to end says
    `failed`, which is not a loss), and ends with 1; nothing is committed, no peer-lost report."""
    forks.start(_args(tmp_path, "--fail", "3", "--catch", "hydra-detached"), tmp_path)
    codes = forks.codes()
    assert codes == [1, 1, 1], (codes, (tmp_path / "rank0.log").read_text()[-3000:])
    assert not list((tmp_path / "ck" / "900").glob(protocol.PEER_LOST_PREFIX + "*"))


@pytest.fixture(scope="module", autouse=True)
def kill_point_summary() -> Iterator[None]:
    """After the module, the kill points this process ran and the torn commits among them (each case asserts
    its own commit whole; run with -s to see the line); with SLURM_ELASTIC_JIT_SUMMARY set, their rows as
    JSON, one file per xdist worker."""
    yield
    if not RESULTS:
        return
    torn = sum(r["torn"] for r in RESULTS)
    mixed = sum(len(set(r["applied"].values())) > 1 for r in RESULTS)
    print(f"\nkill points: {len(RESULTS)}, torn commits: {torn}, survivors at different steps: {mixed}")
    target = os.environ.get("SLURM_ELASTIC_JIT_SUMMARY")
    if target:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        Path(f"{target}.{worker}" if worker else target).write_text(json.dumps(RESULTS, indent=1))


def test_jit_checkpoint_resumes_exactly_on_fewer_ranks(forks: ForkServer, reference: dict, tmp_path: Path) -> None:
    """Survivors at different steps, the committed one restored at world size 2: the losses of the
    steps after it are those of the run that lost nobody (momentum and sampler position included)."""
    first = _run_case(forks, reference, tmp_path, Case(2, "before-step", "stop", lag="1:before-step:8"))
    forks.start(_args(tmp_path), tmp_path, world_size=2, restart_count=1)
    assert forks.codes() == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    losses = {r["step"]: r for r in _rows(tmp_path / "loss.jsonl")}
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in range(first["step"] + 1, STEPS + 1):
        assert losses[step]["world_size"] == 2
        assert math.isclose(losses[step]["loss"], reference["loss"][step], rel_tol=1e-9), step


def test_a_slow_step_is_not_a_lost_peer(forks: ForkServer, tmp_path: Path) -> None:
    """One rank's step 3x the liveness timeout long (far more than a 3x slower step): nobody is declared lost."""
    forks.start(_args(tmp_path, "--slow", "1:3:9", "--liveness-timeout", "3"), tmp_path)
    assert forks.codes() == [0, 0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    assert not list((tmp_path / "ck" / "900").glob(protocol.PEER_LOST_PREFIX + "*"))
    assert max(r["step"] for r in _rows(tmp_path / "loss.jsonl")) == STEPS
