"""Input that must be refused whatever its spelling, and the local cluster's exposure (issue 14, classes 7-9).

- Class 7: sbatch reads options in more spellings than one (unambiguous long
  prefixes, bundled short options, values in the next word or the next
  #SBATCH line, #SLURM and #PBS directives, SBATCH_* variables); a refused
  option is refused in every one of them, checked against the live cluster:
  nothing reaches its queue. A user's --export keeps its meaning and the
  wrapper's SLURM_ELASTIC_* variables still reach the job (read back from
  the job's own environment).
- Class 8: the local cluster's daemons listen on 127.0.0.1 only (`ss`).
- Class 9: one clear line, never a traceback or a hang: `cluster node-down`
  and `down` by a real unprivileged user, a garbled cluster.json, a state
  directory slurm.conf cannot hold, a batch script that is a named pipe, a
  device or unreadable.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.devcluster import processes

import tcp_listeners  # tests/tcp_listeners.py

CLI = Path(sys.executable).parent / "slurm-elastic"     # the installed entry point
SCRIPT_BODY = "true\n"


def _script(*directives: str) -> str:
    return "#!/bin/bash\n" + "".join(f"{line}\n" for line in directives) + SCRIPT_BODY


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def _queued_with_name(slurm_cluster: Any, name: str) -> list[str]:
    out = slurm_cluster.run("squeue", "-h", "-o", "%i %j", "--states=all").stdout
    return [line for line in out.splitlines() if line.split()[-1:] == [name]]


# -- class 7: refused options in every spelling --------------------------------------------------------------
# (case id, command-line options, #SBATCH-style lines, environment, fragment of the reason)
SPELLINGS = [
    ("long-prefix", ["--arr=0-2"], [], {}, "arrays are not supported"),
    ("long-prefix-next-word", ["--arra", "0-2"], [], {}, "arrays are not supported"),
    ("short-bundle", ["-Ha", "0-2"], [], {}, "arrays are not supported"),
    ("short-glued-value", ["-a0-2"], [], {}, "arrays are not supported"),
    ("short-bundle-nodes", ["-HN2"], [], {}, "node count is chosen"),
    ("prefix-no-requeue", ["--no-req"], [], {}, "requeueable"),
    ("short-bundle-nodelist", ["-Hw", "n1"], [], {}, "nodes are chosen by slurm-elastic"),
    ("sbatch-nodefile", [], ["#SBATCH --nodefile=hosts"], {}, "nodes are chosen by slurm-elastic"),
    ("prefix-mem-per-cpu", ["--mem-per-c=100"], [], {}, "memory is given per GPU"),
    ("prefix-cpus-per-task", ["--cpus-per-t=2"], [], {}, "CPUs are given per GPU"),
    ("prefix-comment", ["--comm=x"], [], {}, "carries the elastic spec"),
    ("prefix-gpus-per-node", ["--gpus-per-n=2"], [], {}, "GPUs are given as --gpus"),
    ("sbatch-long-prefix", [], ["#SBATCH --arr=0-2"], {}, "arrays are not supported"),
    ("sbatch-short-bundle", [], ["#SBATCH -Ha 0-2"], {}, "arrays are not supported"),
    ("sbatch-value-on-next-line", [], ["#SBATCH -a", "#SBATCH 0-2"], {}, "arrays are not supported"),
    ("sbatch-glued-to-magic", [], ["#SBATCH--array=0-2"], {}, "arrays are not supported"),
    ("slurm-magic-word", [], ["#SLURM --array=0-2"], {}, "arrays are not supported"),
    ("pbs-array", [], ["#PBS -t 0-2"], {}, "#PBS/#BSUB"),
    ("sbatch-sbatch-gpus", [], ["#SBATCH -G 2"], {}, "sbatch's --gpus is not elastic"),
    ("sbatch-hetjob", [], ["#SBATCH -t 5", "#SBATCH hetjob", "#SBATCH -t 5"], {}, "heterogeneous"),
    ("env-array", [], [], {"SBATCH_ARRAY_INX": "0-2"}, "SBATCH_ARRAY_INX"),
    ("env-gpus-per-task", [], [], {"SBATCH_GPUS_PER_TASK": "1"}, "SBATCH_GPUS_PER_TASK"),
]


@pytest.mark.slurm
@pytest.mark.parametrize("case,options,directives,env,reason", SPELLINGS, ids=[c[0] for c in SPELLINGS])
def test_refused_options_are_refused_in_every_spelling_and_nothing_is_queued(
        slurm_cluster: Any, tmp_path: Path, figures: Any, case: str, options: list[str], directives: list[str],
        env: dict[str, str], reason: str) -> None:
    name = f"inputsec-{case}"
    script = tmp_path / "job.sbatch"
    script.write_text(_script(*directives))
    argv = [str(CLI), "sbatch", "--gpus", "1-2", f"--job-name={name}", "-o", str(tmp_path / "out"), *options,
            str(script)]
    proc = subprocess.run(argv, env={**slurm_cluster.env, **env}, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    try:
        time.sleep(0.5)
        queued = _queued_with_name(slurm_cluster, name)
        figures.put(exit_code=proc.returncode, queued=len(queued), message=proc.stderr.strip()[-200:])
        assert queued == [], f"a refused option reached Slurm ({case}): {queued}"
        assert proc.returncode == 2, (proc.stdout, proc.stderr)
        assert reason in _one_error_line(proc.stderr)
    finally:
        for line in _queued_with_name(slurm_cluster, name):   # 12, 12_[0-2] or 12+0: the job is 12
            slurm_cluster.cancel(int(re.match(r"[0-9]+", line)[0]))


ENV_DUMP = "env | grep -E '^(SLURM_ELASTIC_CKPT_DIR|INPUTSEC_[A-Z]*)=' | sort > {out}\n"


def _job_environment(slurm_cluster: Any, tmp_path: Path, options: list[str], directives: list[str]) -> set[str]:
    """Submit through the wrapper (caller's environment has INPUTSEC_CALLER=1); the job's own variables."""
    out = tmp_path / "job-env.txt"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    script = tmp_path / "env.sbatch"
    script.write_text("#!/bin/bash\n" + "".join(f"{d}\n" for d in directives) + ENV_DUMP.format(out=out))
    argv = [str(CLI), "sbatch", "--parsable", "--gpus", "1-2", "--ckpt-dir", str(ckpt), "-o", str(tmp_path / "o"),
            *options, str(script)]
    env = {**slurm_cluster.env, "INPUTSEC_CALLER": "1"}
    env.pop("SLURM_ELASTIC_CKPT_DIR", None)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = int(proc.stdout.strip().split(";")[0])
    try:
        slurm_cluster.wait_for(lambda: out.exists() and slurm_cluster.job(job).get("JobState") == "COMPLETED",
                               300, what=f"job {job} to write its environment")
    finally:
        slurm_cluster.cancel(job)
    return set(out.read_text().split())


@pytest.mark.slurm
@pytest.mark.parametrize("where", ["command-line", "sbatch-line"])
def test_export_none_keeps_its_meaning_and_the_wrappers_variables(slurm_cluster: Any, tmp_path: Path,
                                                                  figures: Any, where: str) -> None:
    options, directives = (["--export=NONE"], []) if where == "command-line" else ([], ["#SBATCH --export=NONE"])
    seen = _job_environment(slurm_cluster, tmp_path, options, directives)
    figures.put(job_environment=sorted(seen))
    assert f"SLURM_ELASTIC_CKPT_DIR={tmp_path / 'ckpt'}" in seen, seen     # the wrapper's variable arrived
    assert "INPUTSEC_CALLER=1" not in seen, seen                            # and NONE still means none


@pytest.mark.slurm
def test_export_list_is_kept_and_the_wrappers_variables_added(slurm_cluster: Any, tmp_path: Path) -> None:
    seen = _job_environment(slurm_cluster, tmp_path, ["--export=INPUTSEC_MINE=7"], [])
    assert {"INPUTSEC_MINE=7", f"SLURM_ELASTIC_CKPT_DIR={tmp_path / 'ckpt'}"} <= seen, seen
    assert "INPUTSEC_CALLER=1" not in seen, seen      # a list without ALL exports only itself


def test_a_stale_wrapper_variable_in_the_callers_environment_is_refused(tmp_path: Path) -> None:
    """sbatch gives the job the caller's SLURM_* variables over any --export value (seen on 22.05)."""
    script = tmp_path / "job.sbatch"
    script.write_text(_script())
    result = CliRunner().invoke(main, ["sbatch", "--gpus", "1-2", "--ckpt-dir", str(tmp_path), str(script)],
                                env={"SLURM_ELASTIC_CKPT_DIR": "/somewhere/else"})
    assert result.exit_code == 2
    assert "SLURM_ELASTIC_CKPT_DIR=/somewhere/else" in _one_error_line(result.stderr)


# -- class 8: loopback only ----------------------------------------------------------------------------------
@pytest.mark.slurm
def test_local_cluster_daemons_listen_on_loopback_only(slurm_cluster: Any, figures: Any) -> None:
    local = slurm_cluster.require_local()
    layout = local.layout
    by_port: dict[int, list[str]] = {}
    for host, port in tcp_listeners.listening():
        by_port.setdefault(port, []).append(host)
    serving = [spec.port for spec in layout.node_specs if not spec.spare]
    figures.put(ctld=by_port.get(layout.ctld_port), nodes={p: by_port.get(p) for p in serving})
    assert by_port.get(layout.ctld_port) == ["127.0.0.1"], f"slurmctld listens on {by_port.get(layout.ctld_port)}"
    for port in serving:
        assert by_port.get(port) == ["127.0.0.1"], f"a slurmd listens on {by_port.get(port)} (port {port})"


# -- class 9: one line, no traceback, no hang ----------------------------------------------------------------
@pytest.mark.slurm
@pytest.mark.parametrize("command", [["node-down", "{node}"], ["node-down", "{node}", "--mark-down"], ["down"],
                                     ["node-up", "{spare}"]], ids=["node-down", "node-down-mark", "down", "node-up"])
def test_cluster_commands_by_a_non_root_user_are_one_line_and_change_nothing(
        slurm_cluster: Any, user_pythons: Any, command: list[str]) -> None:
    local = slurm_cluster.require_local()
    if "{spare}" in command and not slurm_cluster.spares:
        pytest.skip("the cluster has no spare node")
    before = local.status()
    node = slurm_cluster.nodes[-1]
    args = [part.format(node=node, spare=(slurm_cluster.spares or ("",))[0]) for part in command]
    user = user_pythons("se-inputsec")
    proc = subprocess.run(user.cli_argv("cluster", *args, "--state-dir", str(local.state_dir)), capture_output=True,
                          text=True, timeout=300, cwd="/", env=_user_env())
    assert proc.returncode != 0, proc.stdout
    assert "must run as root" in _one_error_line(proc.stderr)
    after = local.status()
    assert after.controller_pid == before.controller_pid
    assert [(n.name, n.slurmd_pid) for n in after.nodes] == [(n.name, n.slurmd_pid) for n in before.nodes]


def _user_env() -> dict[str, str]:
    """What the user's command inherits: PATH, and PYTHONPATH when the tests run another tree's code."""
    return {key: os.environ[key] for key in ("PATH", "PYTHONPATH") if key in os.environ}


GARBLED = {
    "empty-object": "{}",
    "missing-keys": json.dumps({"state_dir": "{dir}", "slurm_version": "22.05.8"}),
    "not-an-object": "[1, 2]",
    "not-json": "state_dir = {dir}",
    "wrong-type": json.dumps({"state_dir": "{dir}", "slurm_version": "22.05.8", "nodes": "four", "spares": 0,
                              "gpus_per_node": 4, "cpus_per_node": 8, "memory_mb": 16000, "port_base": 6817}),
    "null-number": json.dumps({"state_dir": "{dir}", "slurm_version": "22.05.8", "nodes": None, "spares": 0,
                               "gpus_per_node": 4, "cpus_per_node": 8, "memory_mb": 16000, "port_base": 6817}),
    "other-state-dir": json.dumps({"state_dir": "/elsewhere", "slurm_version": "22.05.8", "nodes": 4, "spares": 0,
                                   "gpus_per_node": 4, "cpus_per_node": 8, "memory_mb": 16000, "port_base": 6817}),
    "binary": "\udcff\udcfe",
}


@pytest.mark.parametrize("name", sorted(GARBLED))
@pytest.mark.parametrize("command", [["status"], ["node-down", "n1"], ["env"], ["down"]],
                         ids=["status", "node-down", "env", "down"])
def test_a_garbled_cluster_json_is_one_line(tmp_path: Path, name: str, command: list[str]) -> None:
    text = GARBLED[name].replace("{dir}", str(tmp_path))
    (tmp_path / "cluster.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    result = CliRunner().invoke(main, ["cluster", *command, "--state-dir", str(tmp_path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (1, 2)
    assert "cluster.json" in _one_error_line(result.stderr)


@pytest.mark.slurm
def test_a_garbled_cluster_json_neither_strands_the_daemons_nor_blocks_a_new_up(short_cluster_dir: Path) -> None:
    """down still stops what runs in the state directory; up on a garbled cluster.json starts afresh."""
    from slurm_elastic.devcluster import LocalCluster
    from slurm_elastic.devcluster.version import find_program

    if os.geteuid() != 0 or find_program("slurmctld") is None:
        pytest.skip("needs root and Slurm's daemons to start a local cluster")
    state = short_cluster_dir
    local = LocalCluster(state)
    up = ["cluster", "up", "--state-dir", str(state), "--nodes", "1", "--spares", "0"]
    base = str(processes.free_port_base(5))
    try:
        first = CliRunner().invoke(main, [*up, "--port-base", base])
        assert first.exit_code == 0, first.output
        running = local.leftover_processes()
        assert running
        (state / "cluster.json").write_text('{"state_dir": 5}')
        down = CliRunner().invoke(main, ["cluster", "down", "--state-dir", str(state)])
        assert down.exit_code == 0, down.output
        assert local.leftover_processes() == [] and not any(processes.is_alive(p) for p in running)
        again = CliRunner().invoke(main, [*up, "--port-base", str(processes.free_port_base(5))])
        assert again.exit_code == 0, again.output
        assert local.status().running
    finally:
        if local.leftover_processes():
            (state / "cluster.json").write_text("{}")   # down must manage either way
            local.down()


@pytest.mark.parametrize("bad", ["with space", "hash#mark", "per%cent", "com,ma", "eq=uals", "new\nline"])
def test_a_state_dir_slurm_conf_cannot_hold_is_refused_before_anything_starts(tmp_path: Path, bad: str) -> None:
    state = tmp_path / bad / "cluster"
    result = CliRunner().invoke(main, ["cluster", "up", "--state-dir", str(state), "--port-base", "29917"])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code != 0
    assert "cannot be written into slurm.conf" in _one_error_line(result.stderr)
    assert not (tmp_path / bad).exists(), "files were written for a refused state directory"
    assert processes.processes_mentioning(str(state), ("munged", "slurmctld", "slurmd")) == []


def _run_sbatch(path: Path, cwd: Path, argv_prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [*(argv_prefix or [str(CLI)]), "sbatch", "--gpus", "1-2", str(path)]
    try:
        # The refusal needs no Slurm: a wrong SLURM_CONF makes any Slurm call fail loudly.
        # Generous for a loaded machine (the refusal takes ~3 s there); the old code waited forever.
        return subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=cwd,
                              env={**_user_env(), "SLURM_CONF": "/nonexistent/slurm.conf"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"`slurm-elastic sbatch {path}` hung for 180 s instead of refusing")


def test_a_named_pipe_as_batch_script_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "train.sbatch"
    os.mkfifo(fifo)
    proc = _run_sbatch(fifo, tmp_path)
    assert proc.returncode == 2
    assert "is not a regular file (a named pipe)" in _one_error_line(proc.stderr)


def test_a_device_as_batch_script_is_refused(tmp_path: Path) -> None:
    proc = _run_sbatch(Path("/dev/zero"), tmp_path)
    assert proc.returncode == 2
    assert "is not a regular file (a character device)" in _one_error_line(proc.stderr)


def test_an_unreadable_batch_script_is_one_line_for_a_real_user(tmp_path: Path, user_pythons: Any) -> None:
    user = user_pythons("se-inputsec")
    work = tmp_path / "work"
    work.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(work, 0o755)
    script = work / "train.sbatch"
    script.write_text(_script())
    os.chmod(script, 0o600)      # root's: the user may not read it
    proc = _run_sbatch(script, Path("/"), argv_prefix=user.cli_argv())
    assert proc.returncode == 2, proc.stderr
    assert "Permission denied" in _one_error_line(proc.stderr)
