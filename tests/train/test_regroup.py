"""The survivors of a lost rank keep their processes and re-form the group at the new size (train/regroup.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.regroup import survivor_env

from .launch import rank_envs, wait_ranks

NODES = ["nodeA", "nodeA", "nodeB"]
DIGITS = ["-m", "slurm_elastic.train.examples.digits"]


def _start(tmp_path: Path, name: str, steps: int, *, keep: bool = True, job_id: str = "51") -> tuple[list, Path]:
    ckpt = tmp_path / name
    log = tmp_path / f"{name}-loss.jsonl"
    runner = ["-m", "slurm_elastic.train.regroup"] if keep else []
    args = [*DIGITS, "--ckpt-dir", str(ckpt), "--steps", str(steps), "--every-steps", "7", "--step-sleep", "0.03",
            "--loss-log", str(log), "--timeout-s", "600"]
    procs = [subprocess.Popen([sys.executable, *runner, *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for env in rank_envs(world_size=3, job_id=job_id, nodes=NODES)]
    return procs, log


def _rows(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def _wait_rows(log: Path, n: int, procs: list) -> None:
    deadline = time.monotonic() + 180
    while len(_rows(log)) < n:
        if time.monotonic() >= deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            outs = [p.communicate(timeout=60)[0] for p in procs]
            raise AssertionError("training stopped:\n" + "\n----\n".join(o[-3000:] for o in outs))
        time.sleep(0.05)


def _params(ckpt: Path, job_id: str) -> dict:
    return json.loads((ckpt / job_id / "final-params.json").read_text())


def test_survivors_go_on_in_their_processes_twice_and_end_with_the_weights_of_a_run_that_never_shrank(
        tmp_path: Path) -> None:
    steps = 45
    procs, log = _start(tmp_path, "kept", steps)
    try:
        _wait_rows(log, 10, procs)
        os.kill(procs[2].pid, signal.SIGKILL)          # nodeB's rank: 3 -> 2 ranks
        procs[2].wait()
        _wait_rows(log, 25, procs[:2])
        os.kill(procs[1].pid, signal.SIGKILL)          # then 2 -> 1
        procs[1].wait()
        results = wait_ranks(procs[:1], timeout=240)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = results[0].stdout
    assert results[0].returncode == 0, out[-4000:]
    # Rank 0 kept one process through both losses and went on at 2 ranks, then at 1.
    assert "rank 0 goes on as rank 0 of 2" in out and "rank 0 goes on as rank 0 of 1" in out, out[-4000:]
    assert out.count("slurm-elastic: started at step 0") == 1 and out.count(
        "after a lost peer (the survivors committed and went on in their processes)") == 2, out[-4000:]
    rows = _rows(log)
    sizes = [r["world_size"] for r in rows]
    assert sizes[0] == 3 and sizes[-1] == 1 and 2 in sizes
    # No completed step lost: each generation resumed right after the last step every survivor completed.
    report = protocol.PeerLostReport.parse((tmp_path / "kept" / "51" / protocol.peer_lost_file_name("51", 0, 0))
                                           .read_bytes())
    assert report.commit == "done" and report.world_size == 2    # the second loss's report (generation 1)
    for before, after in zip(rows, rows[1:]):
        assert after["step"] <= before["step"] + 1               # never a step skipped
    assert rows[-1]["step"] == steps
    # The lone survivor said it ended where the batch script looks (a group of one has no run directory of its own).
    last = tmp_path / "kept" / "51" / (protocol.run_dir_name("51", 0, 0) + ".2")
    assert (last / protocol.exited_file_name(0)).read_text() == "0\n"
    # The math is unchanged: the same weights as 3 ranks throughout (float64, reduction order aside).
    reference, ref_log = _start(tmp_path, "reference", steps, keep=False, job_id="52")
    ref_results = wait_ranks(reference, timeout=240)
    assert [r.returncode for r in ref_results] == [0, 0, 0], ref_results[0].stdout[-3000:]
    kept, ref = _params(tmp_path / "kept", "51"), _params(tmp_path / "reference", "52")
    assert kept["step"] == ref["step"] == steps
    for name, values in ref["params"].items():
        import torch

        torch.testing.assert_close(torch.tensor(kept["params"][name]), torch.tensor(values), rtol=1e-9, atol=1e-9)


def test_survivors_of_a_frozen_peer_go_on_in_their_processes(tmp_path: Path) -> None:
    """A frozen rank holds the others' collective open and closes nothing: the survivors learn of it from
    its heartbeat only. Their training threads, blocked in a collective with it, still unwind at once:
    each survivor cuts its own connections of the old group (train/connections.py), so they re-form the
    group in their processes instead of waiting the collective timeout (600 s here) or exiting."""
    procs, log = _start(tmp_path, "frozen", 40)
    try:
        _wait_rows(log, 10, procs)
        os.kill(procs[2].pid, signal.SIGSTOP)
        results = wait_ranks(procs[:2], timeout=240)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = results[0].stdout
    assert [r.returncode for r in results] == [0, 0], out[-4000:]
    run = tmp_path / "frozen" / "51" / protocol.run_dir_name("51", 0, 0)
    assert json.loads((run / protocol.REGROUP_FILE).read_text())["go"] is True
    assert "rank 0 goes on as rank 0 of 2" in out, out[-4000:]
    report = protocol.PeerLostReport.parse((tmp_path / "frozen" / "51" / protocol.peer_lost_file_name("51", 0, 0))
                                           .read_bytes())
    assert report.commit == "done" and report.detected_by == "heartbeat", report
    rows = _rows(log)
    for before, after in zip(rows, rows[1:]):
        assert after["step"] <= before["step"] + 1               # never a step skipped
    at_two = [r["step"] for r in rows if r["world_size"] == 2]
    assert at_two[0] == report.committed_step + 1 and rows[-1]["step"] == 40, (report.committed_step, at_two[:3])
    # Each survivor said it ended, with its code, where the batch script looks (its srun never ends by itself).
    regrouped = run.with_name(run.name + ".1")
    assert sorted(f.name for f in regrouped.glob("exited-*")) == [protocol.exited_file_name(r) for r in (0, 1)]
    assert {f.read_text() for f in regrouped.glob("exited-*")} == {"0\n"}
    assert not list(run.glob("exited-*"))      # the group that lost its peer did not end


def test_survivors_that_stop_for_a_requeue_say_they_ended_for_the_batch_script(tmp_path: Path) -> None:
    """After going on in their processes, the survivors are signalled (a later grow): they commit and leave
    at once (os._exit, the requeue code), and each still writes exited-<rank> with that code: their srun
    waits for the lost rank's task, and the batch script ends it on that word only (without it a later
    requeue waited KillWait for that srun)."""
    procs, log = _start(tmp_path, "signalled", 100000)
    try:
        _wait_rows(log, 10, procs)
        os.kill(procs[2].pid, signal.SIGKILL)
        procs[2].wait()
        _wait_rows(log, len(_rows(log)) + 5, procs[:2])
        run = tmp_path / "signalled" / "51" / protocol.run_dir_name("51", 0, 0)
        assert json.loads((run / protocol.REGROUP_FILE).read_text())["go"] is True
        for p in procs[:2]:
            os.kill(p.pid, getattr(signal, "SIG" + protocol.DEFAULT_SIGNAL))
        results = wait_ranks(procs[:2], timeout=180)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = results[0].stdout
    assert [r.returncode for r in results] == [protocol.REQUEUE_EXIT_CODE] * 2, out[-4000:]
    assert "rank 0 goes on as rank 0 of 2" in out, out[-4000:]
    regrouped = run.with_name(run.name + ".1")
    assert sorted(f.name for f in regrouped.glob("exited-*")) == [protocol.exited_file_name(r) for r in (0, 1)]
    assert {f.read_text() for f in regrouped.glob("exited-*")} == {f"{protocol.REQUEUE_EXIT_CODE}\n"}


def test_a_stop_signal_that_comes_with_the_lost_peer_is_not_lost_by_the_survivors_going_on(tmp_path: Path) -> None:
    """Slurm requeues a job whose node failed and sends its other tasks SIGTERM, KillWait before SIGKILL: it
    comes while the survivors agree and move to their next session. Seen before they go on, they do not
    (peer-lost code, the commit done); seen after, it is held for the next session, which commits and exits
    with the requeue code. Either way they stop at once instead of training on to the SIGKILL and losing
    what they ran after the last periodic commit."""
    procs, log = _start(tmp_path, "stopped", 100000)
    try:
        _wait_rows(log, 10, procs)
        os.kill(procs[2].pid, signal.SIGKILL)
        time.sleep(0.3)
        for p in procs[:2]:
            os.kill(p.pid, signal.SIGTERM)
        results = wait_ranks(procs[:2], timeout=180)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = results[0].stdout
    codes = [r.returncode for r in results]
    assert codes in ([protocol.REQUEUE_EXIT_CODE] * 2, [protocol.PEER_LOST_EXIT_CODE] * 2), out[-4000:]
    last = _rows(log)[-1]["step"]
    if codes[0] == protocol.REQUEUE_EXIT_CODE:
        ack = protocol.Ack.parse(protocol.load_json(
            (tmp_path / "stopped" / "51" / protocol.ack_file_name(51, 0)).read_bytes()))
        assert ack.committed and ack.step == last, (ack, _rows(log)[-3:])
    else:
        assert "Slurm is ending the job's tasks (SIGTERM)" in out, out[-4000:]
        report = protocol.PeerLostReport.parse(
            (tmp_path / "stopped" / "51" / protocol.peer_lost_file_name("51", 0, 0)).read_bytes())
        # the last step every survivor completed: rank 0 may have applied (and logged) one more
        assert report.commit == "done" and report.committed_step in (last, last - 1), (report, last)


def test_survivor_coordinates_renumber_ranks_and_keep_nodes_in_order() -> None:
    decision = {"survivors": [0, 1, 3], "survivor_nodes": {"0": "a", "1": "a", "3": "c"}}
    env = survivor_env({"MASTER_PORT": "1234", "SLURM_ELASTIC_GENERATION": "1"}, decision, 3)
    assert env["SLURM_PROCID"] == "2" and env["SLURM_NTASKS"] == "3" and env["SLURM_NODEID"] == "1"
    assert env["SLURM_STEP_NODELIST"] == "a,c" and env["SLURM_STEP_TASKS_PER_NODE"] == "2,1"
    assert env["SLURM_STEP_NUM_NODES"] == "2" and env["SLURM_ELASTIC_GENERATION"] == "2"
    assert env["MASTER_PORT"] is None and "MASTER_ADDR" not in env     # rank 0 survived: its address stands
    moved = survivor_env({}, {"survivors": [1, 2], "survivor_nodes": {"1": "a", "2": "b"}}, 1)
    assert moved["SLURM_PROCID"] == "0" and moved["MASTER_ADDR"] is None and moved["SLURM_ELASTIC_GENERATION"] == "1"


@pytest.mark.parametrize("argv", [[], ["-m"], ["--help"]])
def test_the_runner_without_a_command_says_how_to_call_it(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "slurm_elastic.train.regroup", *argv], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "usage: python -m slurm_elastic.train.regroup" in proc.stderr


@pytest.mark.parametrize("catch", ["hydra", "lightning"])
def test_survivors_go_on_in_their_processes_whatever_the_loop_does_with_the_error(tmp_path: Path, catch: str) -> None:
    """The loss reaches the loop inside DDP's gradient all-reduce, where a Hydra-style runner catches it and
    exits 1 (or a Lightning-style one raises its own error): the session still commits and the survivors
    go on in their processes at the new size, to the last step."""
    args = ["-m", "slurm_elastic.train.regroup", "-m", "tests.train.jit_trainer", "--ckpt-dir", str(tmp_path / "ckpt"),
            "--log-dir", str(tmp_path), "--steps", "12", "--die", "2:6:bucket-first:kill", "--catch", catch]
    procs = [subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=Path(__file__).resolve().parents[2])
             for env in rank_envs(world_size=3, job_id="53", nodes=NODES)]
    try:
        results = wait_ranks(procs, timeout=240)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert results[2].returncode == -signal.SIGKILL
    for rank, result in enumerate(results[:2]):
        out = result.stdout
        assert result.returncode == 0, out[-4000:]
        went_on = out.find(f"rank {rank} goes on as rank {rank} of 2 from step 5")
        assert went_on >= 0, out[-4000:]
        if catch == "hydra":
            assert 0 <= out.find("Error executing job") < went_on, out[-4000:]
    applied = [json.loads(x)["step"] for x in (tmp_path / "applied-0.jsonl").read_text().splitlines()]
    assert applied == list(range(1, 13)), applied     # every step once: 0 lost, none applied twice
