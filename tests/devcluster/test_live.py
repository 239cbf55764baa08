"""The local cluster against real Slurm daemons: GPU jobs, a node failure, a node gained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_elastic.devcluster import node_state_serving, processes

pytestmark = pytest.mark.slurm

GPU_JOB = """#!/bin/bash
echo "batch SLURM_GPUS_ON_NODE=$SLURM_GPUS_ON_NODE CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
srun bash -c 'echo "step $SLURMD_NODENAME SLURM_GPUS_ON_NODE=$SLURM_GPUS_ON_NODE \
CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"'
"""


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "slurm-elastic"), *args],   # the venv's entry point, not PATH's
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_two_node_gpu_job_sees_its_gpus(slurm_cluster, tmp_path: Path) -> None:
    out = tmp_path / "gpu.out"
    job = slurm_cluster.sbatch(GPU_JOB, "-N2", "--gres=gpu:2", "--mem=1G", "-o", str(out), cwd=tmp_path)
    slurm_cluster.wait_for(lambda: slurm_cluster.job(job).get("JobState") == "COMPLETED", 60, what=f"job {job} done")
    lines = out.read_text().splitlines()
    steps = sorted(line for line in lines if line.startswith("step "))
    assert any(line.startswith("batch SLURM_GPUS_ON_NODE=2 ") for line in lines), lines
    assert len(steps) == 2, lines
    assert len({line.split()[1] for line in steps}) == 2, "the two tasks ran on the same node"
    for line in steps:
        assert "SLURM_GPUS_ON_NODE=2" in line
        if slurm_cluster.local is not None:  # our fake GPUs are character devices
            assert "CUDA_VISIBLE_DEVICES=0,1" in line, line


def test_status_json_lists_idle_gpu_nodes(slurm_cluster) -> None:
    local = slurm_cluster.require_local()
    result = _cli("cluster", "status", "--json", "--state-dir", str(local.state_dir))
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["slurm_conf"] == str(slurm_cluster.slurm_conf)
    assert status["slurm_version"] == slurm_cluster.slurm_version
    by_name = {node["name"]: node for node in status["nodes"]}
    for name in slurm_cluster.nodes:
        assert node_state_serving(by_name[name]["state"]), by_name[name]
        assert by_name[name]["gpus"] == slurm_cluster.gpus_per_node
        assert by_name[name]["started"] is True
    for name in slurm_cluster.spares:
        assert by_name[name]["spare"] is True
        assert by_name[name]["started"] is False
        assert "DOWN" in by_name[name]["state"]


def test_node_failure_requeues_its_job_and_node_up_restores_it(slurm_cluster, tmp_path: Path) -> None:
    local = slurm_cluster.require_local()
    victim = slurm_cluster.nodes[-1]
    pid_file = tmp_path / "job.pid"
    script = f"#!/bin/bash\necho $$ > {pid_file}\nsleep 600\n"
    job = slurm_cluster.sbatch(script, "-N1", "-w", victim, "--gres=gpu:1", "--mem=1G", "--requeue",
                               "-o", str(tmp_path / "r.out"), cwd=tmp_path)
    try:
        slurm_cluster.wait_for(lambda: slurm_cluster.job(job).get("JobState") == "RUNNING" and pid_file.exists(),
                               30, what=f"job {job} running")
        job_pid = int(pid_file.read_text())
        before = local.status().node(victim).slurmd_pid
        assert before is not None
        # node_down first shortens SlurmdTimeout (tests/conftest.py); from 23.11 that reconfigure
        # replaces every slurmd, so the pid it kills may be a newer one than `before`.
        killed = local.node_down(victim)
        # A real failure: the node's slurmd and the job's processes are gone at once.
        assert not processes.is_alive(killed) and not processes.is_alive(before)
        assert not processes.is_alive(job_pid)
        assert local.status().node(victim).started is False
        state = slurm_cluster.wait_for(
            lambda: (s := slurm_cluster.node_state(victim)).startswith("DOWN") and s, 60, what=f"{victim} DOWN"
        )
        assert "NOT_RESPONDING" in state
        requeued = slurm_cluster.wait_for(
            lambda: (j := slurm_cluster.job(job)).get("JobState") == "PENDING" and j, 10, what="job requeued"
        )
        assert int(requeued["Restarts"]) >= 1
        # Other nodes kept serving through the failure. Waited for, not read once: from 23.11 the reconfigure
        # that shortened SlurmdTimeout replaced slurmctld, and about 28 s later the new one marks every node
        # "not responding, setting DOWN" and takes the healthy ones back in the same second (seen in CI's
        # trixie chroot, 24.11.5: the one read caught n1-n3 DOWN).
        others = [n for n in slurm_cluster.nodes if n != victim]
        serving = lambda: all(node_state_serving(slurm_cluster.node_states()[n]) for n in others)  # noqa: E731
        if not serving():
            slurm_cluster.wait_for(serving, 30, what=f"the other nodes serving (were: {slurm_cluster.node_states()})")

        local.node_up(victim)
        assert node_state_serving(slurm_cluster.node_state(victim))
    finally:
        slurm_cluster.cancel(job)
        slurm_cluster.restore()


def test_started_spare_becomes_idle(slurm_cluster) -> None:
    local = slurm_cluster.require_local()
    if not slurm_cluster.spares:
        pytest.skip("the local cluster has no spare nodes")
    spare = slurm_cluster.spares[0]
    assert slurm_cluster.node_state(spare).startswith("DOWN")
    try:
        result = _cli("cluster", "node-up", spare, "--state-dir", str(local.state_dir))
        assert result.returncode == 0, result.stderr
        assert node_state_serving(slurm_cluster.node_state(spare))
        assert local.status().node(spare).started
    finally:
        slurm_cluster.restore()
    assert slurm_cluster.node_state(spare).startswith("DOWN")


def test_cli_rejects_bad_input_with_one_line(slurm_cluster) -> None:
    local = slurm_cluster.require_local()
    state = ["--state-dir", str(local.state_dir)]
    unknown = _cli("cluster", "node-down", "nope", *state)
    assert unknown.returncode == 2
    assert "unknown node 'nope'" in unknown.stderr
    again = _cli("cluster", "up", *state)
    assert again.returncode == 2
    assert "already up" in again.stderr
    running = _cli("cluster", "node-up", slurm_cluster.nodes[0], *state)
    assert running.returncode == 1
    assert "already up" in running.stderr
    # Nothing was changed by the refused commands.
    assert all(node.started for node in local.status().nodes if not node.spare)
