"""CLI backend: the commands it builds per Slurm version, its error mapping, and a slurmctld that is down."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from slurm_elastic.cluster.backend import SubmitDescription
from slurm_elastic.cluster.cli_backend import CliBackend, classify, sbatch_args, update_args
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.cluster.slurm_values import SlurmVersion
from slurm_elastic.errors import SlurmError, SlurmUnavailable, UnknownJob
from slurm_elastic.spec import ElasticSpec

from tests.cluster.captures import VERSIONS, project_text


@pytest.mark.parametrize("version,gpu", [(SlurmVersion(22, 5, 8), "gres:gpu"), (SlurmVersion(24, 11, 5), "gres/gpu"),
                                         (SlurmVersion(26, 5, 5), "gres/gpu")])
def test_update_spelling_follows_the_version(version: SlurmVersion, gpu: str) -> None:
    args = update_args(version, 12, RequestShape(1, 3, 2, 4000))
    assert args == ["scontrol", "update", "JobId=12", "NumNodes=1-1", "NumTasks=1", "NumCPUs=6", "MinCPUsNode=6",
                    f"TresPerNode={gpu}:3",
                    f"CpusPerTres={gpu}:2", f"MemPerTres={gpu}:4000", "StartTime=now"]
    assert "StartTime=now" not in update_args(version, 12, RequestShape(1, 3, 2, 4000), start_now=False)


def test_update_refuses_empty_shapes() -> None:
    with pytest.raises(SlurmError, match="gpus_per_node must be >= 1"):
        update_args(SlurmVersion(22, 5), 1, RequestShape(1, 0, 1, 1))


def test_sbatch_args() -> None:
    spec = ElasticSpec(2, 8, cpus_per_gpu=2, mem_per_gpu_mb=1000)
    d = SubmitDescription(script="/x/train.sh", shape=RequestShape(2, 2, 2, 1000),
                          comment=spec.to_comment(), job_name="t", extra_args=("--time=10",), script_args=("--lr", "1"),
                          workdir="/x", env={"A": "1"})
    assert sbatch_args(d) == [
        "sbatch", "--parsable", "--nodes=2", "--gres=gpu:2", "--cpus-per-gpu=2", "--mem-per-gpu=1000M",
        f"--comment={spec.to_comment()}", "--job-name=t", "--requeue", "--chdir=/x", "--export=ALL,A=1",
        "--time=10", "/x/train.sh", "--lr", "1"]
    held = SubmitDescription(script="s", shape=RequestShape(1, 1, 1, 1), requeue=False,
                             hold=True)
    assert "--no-requeue" in sbatch_args(held) and "--hold" in sbatch_args(held)
    with pytest.raises(SlurmError, match="--export"):
        sbatch_args(SubmitDescription(script="s", shape=RequestShape(1, 1, 1, 1),
                                      env={"A": "1,2"}))


@pytest.mark.parametrize("message,kind", [
    # Slurm 22.05.8's own messages, seen live
    ("Invalid job id specified for job 9999", UnknownJob),
    ("scancel: error: Kill job error on job id 9999: Invalid job id specified", UnknownJob),
    ("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)",
     SlurmUnavailable),
    ("slurm_suspend error: Unexpected message received", SlurmUnavailable),
    ("Job is no longer pending execution for job 5", SlurmError),
    ("sbatch: error: Batch job submission failed: Requested node configuration is not available", SlurmError),
])
def test_classify(message: str, kind: type) -> None:
    err = classify(message, ("scontrol", "hold", "1"), 1)
    assert type(err) is kind and message in str(err) and err.command == ("scontrol", "hold", "1")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dead_controller(tmp_path: Path) -> dict[str, str]:
    """A slurm.conf whose slurmctld is not running: real Slurm commands, real failures."""
    if shutil.which("squeue") is None:
        pytest.skip("Slurm client commands are not installed")
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=dead\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={_closed_port()}\n"
                    f"AuthType=auth/munge\nAuthInfo=socket={tmp_path}/no-munge.socket\nMessageTimeout=2\n"
                    "SelectType=select/cons_tres\nGresTypes=gpu\n"
                    "NodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n")
    return {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "SLURM_CONF": str(conf)}


def test_controller_down_is_a_clear_error_after_bounded_retries(dead_controller, caplog) -> None:
    b = CliBackend(env=dead_controller, retries=3, backoff_s=0.05, max_backoff_s=0.1)
    started = time.monotonic()
    with pytest.raises(SlurmUnavailable) as info:
        b.snapshot()
    assert time.monotonic() - started < 60
    assert b.calls == 3  # three attempts of squeue, no more
    assert "squeue" in str(info.value)
    assert sum("retrying" in r.getMessage() for r in caplog.records) == 2
    once = CliBackend(env=dead_controller, retries=1)
    for action in (lambda: once.hold(1), lambda: once.release(1), lambda: once.cancel(1)):
        with pytest.raises(SlurmUnavailable):
            action()


def test_controller_down_submit_is_not_retried(dead_controller, tmp_path) -> None:
    script = tmp_path / "s.sh"
    script.write_text("#!/bin/sh\ntrue\n")
    # The version given: submit would otherwise first ask `scontrol --version` (for --requeue=expedite).
    b = CliBackend(env=dead_controller, retries=3, backoff_s=0.05, version=SlurmVersion(22, 5, 8))
    with pytest.raises(SlurmUnavailable, match="Unable to contact slurm controller"):
        b.submit(SubmitDescription(script=str(script), shape=RequestShape(1, 1, 1, 10)))
    assert b.calls == 1  # a retried sbatch could submit twice


def test_missing_slurm_commands(tmp_path) -> None:
    b = CliBackend(env={"PATH": str(tmp_path)}, retries=1)
    with pytest.raises(SlurmUnavailable, match="not found"):
        b.snapshot()


def recorded_actions(version: str) -> dict[str, tuple[str, int]]:
    """finished-job-actions.txt of a project capture: command -> (its output, its exit code)."""
    out: dict[str, tuple[str, int]] = {}
    for block in project_text(version, "finished-job-actions.txt").split("== ")[1:]:
        command, _, rest = block.partition("\n")
        lines = rest.rstrip("\n").splitlines()
        rc_line = next(ln for ln in lines if ln.startswith("rc="))
        out[command] = ("\n".join(lines[:lines.index(rc_line)]), int(rc_line[3:]))
    return out


def replaying_slurm(tmp_path: Path, recorded: dict[str, tuple[str, int]]) -> dict[str, str]:
    """scancel/scontrol stand-ins that answer with what the real ones printed (to stderr) and exited with.

    A command matches a recording by its first two arguments after the program (`scontrol update
    JobId=1 ...` whatever the rest), or exactly.
    """
    table = tmp_path / "recorded.json"
    table.write_text(json.dumps({cmd: list(v) for cmd, v in recorded.items()}))
    stub = (f"#!{sys.executable}\nimport json, os, sys\n"
            f"table = json.load(open({str(table)!r}))\n"
            "argv = [os.path.basename(sys.argv[0])] + sys.argv[1:]\n"
            "for cmd, (text, rc) in table.items():\n"
            "    words = cmd.split()\n"
            "    if words == argv or (words[0] == 'scontrol' and words[:3] == argv[:3]):\n"
            "        sys.stderr.write(text + '\\n'); sys.exit(rc)\n"
            "sys.stderr.write('no recording for ' + ' '.join(argv) + '\\n'); sys.exit(99)\n")
    for name in ("scancel", "scontrol"):
        path = tmp_path / name
        path.write_text(stub)
        path.chmod(0o755)
    return {"PATH": str(tmp_path)}


@pytest.mark.parametrize("version", VERSIONS)
def test_finished_and_unknown_job_errors_as_slurm_words_them(version: str, tmp_path: Path) -> None:
    """The errors every backend raises for a finished or unknown job (the pyslurm backend matches these)."""
    recorded = recorded_actions(version)
    finished = int(project_text(version, "finished-job-actions.txt").split("job ids: ")[1].split()[0])
    b = CliBackend(env=replaying_slurm(tmp_path, recorded), version=SlurmVersion.parse(version), retries=1)
    with pytest.raises(SlurmError, match="already completing or completed") as info:
        b.cancel(finished)            # scancel exits 0 here and says so only with --verbose
    assert type(info.value) is SlurmError
    with pytest.raises(UnknownJob, match="Invalid job id specified"):
        b.cancel(999999)
    with pytest.raises(UnknownJob, match="Invalid job id specified"):
        b.signal(finished, "USR2")
    for action in (b.hold, b.release,
                   lambda j: b.set_resources(j, RequestShape(1, 1, 1, 100))):
        with pytest.raises(SlurmError, match="Job has already finished") as info:
            action(finished)
        assert type(info.value) is SlurmError


@pytest.mark.parametrize("version,flag", [
    ("22.05.8", "--requeue"), ("23.02.7", "--requeue"), ("23.11.10", "--requeue"), ("24.05.4", "--requeue"),
    # 24.11's sbatch refuses an argument to --requeue (checked on Debian's 24.11.5)
    ("24.11.5", "--requeue"), ("25.05.3", "--requeue"),
    ("25.11.0", "--requeue=expedite"), ("25.11.2", "--requeue=expedite"), ("26.05.5", "--requeue=expedite")])
def test_requeue_is_expedited_where_slurm_has_it(version: str, flag: str) -> None:
    d = SubmitDescription(script="s", shape=RequestShape(1, 1, 1, 1))
    args = sbatch_args(d, SlurmVersion.parse(version), expedite_enabled=True)
    assert flag in args and sum(a.startswith("--requeue") for a in args) == 1
    # Not enabled in slurm.conf: 26.05's slurmctld refuses the submission, so plain --requeue.
    assert "--requeue" in sbatch_args(d, SlurmVersion.parse(version), expedite_enabled=False)
    assert "--requeue" in sbatch_args(d)                         # version unknown: what every sbatch takes
    no = SubmitDescription(script="s", shape=RequestShape(1, 1, 1, 1), requeue=False)
    assert "--no-requeue" in sbatch_args(no, SlurmVersion.parse(version))


@pytest.mark.parametrize("params,flag", [
    ("enable_expedited_requeue", "--requeue=expedite"), ("idle_on_node_suspend,enable_expedited_requeue",
                                                         "--requeue=expedite"),
    ("(null)", "--requeue"), ("enable_expedited_requeue_not", "--requeue")])
def test_submit_asks_for_the_expedited_requeue_only_where_slurmctld_enables_it(monkeypatch, params: str,
                                                                               flag: str) -> None:
    calls = []
    backend = CliBackend(version=SlurmVersion(26, 5, 5))
    config = f"KillWait                = 30 sec\nSlurmctldParameters     = {params}\n"
    monkeypatch.setattr(backend, "_run", lambda args, **kw: calls.append(list(args))
                        or (config if args[:3] == ["scontrol", "show", "config"] else "42\n"))
    assert backend.submit(SubmitDescription(script="s", shape=RequestShape(1, 1, 1, 1))) == 42
    submitted = [c for c in calls if c[0] == "sbatch"][0]
    assert flag in submitted and sum(a.startswith("--requeue") for a in submitted) == 1


def test_a_drain_and_its_end_are_scontrol_updates_of_the_node(monkeypatch) -> None:
    calls: list[list[str]] = []
    backend = CliBackend(version=SlurmVersion(24, 11, 5))
    monkeypatch.setattr(backend, "_run", lambda args, **kw: calls.append(list(args)) or "")
    backend.drain("n2", "slurm-elastic: job 7 (alice)   reported\nits ranks here lost")
    backend.resume("n2")
    assert calls == [["scontrol", "update", "NodeName=n2", "State=DRAIN",
                      "Reason=slurm-elastic: job 7 (alice) reported its ranks here lost"],
                     ["scontrol", "update", "NodeName=n2", "State=RESUME"]]
