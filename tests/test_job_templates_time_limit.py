"""The job templates at a time limit or a preemption, against stand-ins for srun, scontrol and scancel (no Slurm).

Each template runs under bash as a batch script would; `scontrol show job` reports the EndTime the
test sets, `srun` is a rank that commits (writes its ACK) and exits 85 on the checkpoint signal,
and every Slurm command is logged. What is checked: which signal the template takes for Slurm's,
that it passes that one on to the ranks and requeues its own job after their commit, and that it
leaves the controller's signal, and a run past its --total-time, alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TEMPLATES = Path(__file__).resolve().parents[1] / "job_templates"
JOB = "42"

SRUN = """#!/bin/bash
echo "srun $*" >> "$FAKE_DIR/calls"
echo $$ > "$FAKE_DIR/srun.pid"
ack="$SLURM_ELASTIC_CKPT_DIR/$SLURM_JOB_ID/ACK-$SLURM_JOB_ID-0"
trap 'mkdir -p "$(dirname "$ack")"; echo "{}" > "$ack"; exit 85' USR2
while :; do sleep 0.1; done
"""
SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_DIR/calls"
case "$*" in
    "-o show job "*) echo "JobId=$SLURM_JOB_ID JobState=RUNNING Restarts=0 EndTime=$(cat "$FAKE_DIR/end") PreemptTime=$(cat "$FAKE_DIR/preempted" 2>/dev/null || echo None) NumNodes=1 " ;;
    "show hostnames "*) echo n1 ;;
    "-o show node "*) echo "NodeName=n1 NodeAddr=127.0.0.1 State=ALLOCATED " ;;
esac
"""
SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$FAKE_DIR/calls"
case "$*" in --signal=*) kill -"${1#--signal=}" "$(cat "$FAKE_DIR/srun.pid")" ;; esac
"""


def _slurm_time(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch))


def _run(tmp_path: Path, template: str, *, end_in_s: float, preempted: bool = False,
         env: dict[str, str] | None = None, signal_ranks_too: bool = False,
         signal_shell: bool = True) -> tuple[int, list[str], str]:
    """Start the template, signal its shell once the ranks run; (exit code, Slurm calls, its output)."""
    fake = tmp_path / "fake"
    bin_dir = fake / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("scancel", SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (fake / "end").write_text(_slurm_time(time.time() + end_in_s))
    job_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(fake), "SLURM_JOB_ID": JOB,
               "SLURM_ELASTIC_CKPT_DIR": str(tmp_path / "ckpt"), "SLURM_ELASTIC_PYTHON": sys.executable,
               "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "SLURM_GPUS_ON_NODE": "1",
               "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_ELASTIC_REQUEUE_WAIT_S": "0",
               "SLURM_ELASTIC_LIMIT_WARNING_S": "30", **(env or {})}
    out = tmp_path / "out"
    with open(out, "w") as log:
        proc = subprocess.Popen(["bash", str(TEMPLATES / f"{template}.sbatch")], env=job_env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        # the fake srun's `echo $$ > srun.pid` creates the file before it writes the pid (seen empty under load)
        while not (fake / "srun.pid").exists() or not (fake / "srun.pid").read_text().strip().isdigit():
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, "the template never launched the ranks"
            time.sleep(0.05)
        if preempted:                   # scontrol shows when Slurm started preempting the job
            (fake / "preempted").write_text(_slurm_time(time.time()))
        if signal_ranks_too:            # the controller's `scancel --full`, or Slurm's SIGTERM to the tasks
            os.kill(int((fake / "srun.pid").read_text()), signal.SIGUSR2)
        if signal_shell:
            proc.send_signal(signal.SIGUSR2)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    calls = (fake / "calls").read_text().splitlines()
    return rc, calls, out.read_text()


@pytest.mark.parametrize("template", ["ddp", "fsdp", "torchrun"])
def test_the_warning_before_the_limit_reaches_the_ranks_and_the_job_requeues_itself(tmp_path, template) -> None:
    rc, calls, out = _run(tmp_path, template, end_in_s=60)
    assert f"scancel --signal=USR2 {JOB}" in calls, (calls, out)     # every step, not the batch shell
    assert f"scontrol requeue {JOB}" in calls, (calls, out)
    assert rc == 85 and "requeues itself before its end" in out, out
    assert _ended(tmp_path) == "time limit\n"        # the next start line's cause


def _ended(tmp_path: Path) -> str | None:
    path = tmp_path / "ckpt" / JOB / f"ENDED-{JOB}-0"
    return path.read_text() if path.exists() else None


def test_a_preemption_is_taken_for_slurms_signal_however_far_the_end(tmp_path) -> None:
    rc, calls, out = _run(tmp_path, "ddp", end_in_s=3600, preempted=True)
    assert f"scancel --signal=USR2 {JOB}" in calls and f"scontrol requeue {JOB}" in calls, (calls, out)
    assert _ended(tmp_path) == "preemption\n"


def test_ranks_that_slurm_signalled_alone_at_a_preemption_commit_and_the_job_requeues_itself(tmp_path) -> None:
    # 22.05 without the job's own signal at preemption: SIGTERM to the tasks only (the shim commits on it).
    rc, calls, out = _run(tmp_path, "ddp", end_in_s=3600, preempted=True, signal_ranks_too=True, signal_shell=False)
    assert f"scontrol requeue {JOB}" in calls and not any(c.startswith("scancel") for c in calls), (calls, out)
    assert "the ranks committed on Slurm's signal before the job's end" in out, out
    assert _ended(tmp_path) == "preemption\n"


def test_the_controllers_signal_is_left_to_the_controller(tmp_path) -> None:
    rc, calls, out = _run(tmp_path, "ddp", end_in_s=3600, signal_ranks_too=True)
    assert not any(c.startswith(("scancel", "scontrol requeue")) for c in calls), (calls, out)
    assert rc == 85 and "waiting up to 0s for the controller's requeue" in out, out
    assert _ended(tmp_path) is None                   # a resize: the start line says so without this file


def test_a_run_past_its_total_time_commits_but_does_not_requeue(tmp_path) -> None:
    rc, calls, out = _run(tmp_path, "ddp", end_in_s=60, env={"SLURM_ELASTIC_RUN_DEADLINE": str(int(time.time()) - 1)})
    assert f"scancel --signal=USR2 {JOB}" in calls and f"scontrol requeue {JOB}" not in calls, (calls, out)
    assert rc == 85 and "--total-time has passed" in out and f"scontrol requeue {JOB})" in out, out


def test_without_a_warning_asked_for_the_signal_is_the_controllers(tmp_path) -> None:
    rc, calls, out = _run(tmp_path, "ddp", end_in_s=60, env={"SLURM_ELASTIC_LIMIT_WARNING_S": "0"},
                          signal_ranks_too=True)
    assert not any(c.startswith(("scancel", "scontrol")) for c in calls), (calls, out)
