"""`slurm-elastic sbatch/watch/status/admin`: the bad-input matrix, help examples and outputs.

Slurm is FakeSlurm here (tests/control/fake_slurm.py, a stand-in for Slurm);
the live paths are in tests/control/test_live.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.spec import ElasticSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from control.fake_slurm import FakeSlurm  # noqa: E402


@pytest.fixture
def slurm(monkeypatch, tmp_path):
    fake = FakeSlurm()
    monkeypatch.setattr("slurm_elastic.cluster.select.select_backend", lambda *a, **k: fake)
    monkeypatch.setenv("SLURM_ELASTIC_DAEMON_DIR", str(tmp_path / "daemon"))
    monkeypatch.setenv("SLURM_ELASTIC_STATE_DIR", str(tmp_path / "user"))
    return fake


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.sbatch"
    path.write_text("#!/bin/bash\n#ELASTIC --gpus 2-8 --gpu-step 2\n#SBATCH -t 10\nsrun python train.py\n")
    return path


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


BAD_INPUT = [
    (["--gpus", "8-2"], "min GPUs 8 exceeds max GPUs 2"),
    (["--gpus", "two"], "--gpus must be MIN-MAX"),
    (["--gpus", "2-8", "--gpu-step", "3"], "multiples of the GPU step 3"),
    (["--gpus", "0-4"], "min_gpus must be at least 1"),
    (["--gpus", "1-4", "--weight", "-1"], "weight must be a positive"),
    (["--gpus", "1-4", "--mem-per-gpu", "lots"], "memory must be a number"),
    (["--gpus", "1-4", "--ckpt-dir", "relative/dir"], "must be an absolute path"),
    (["--gpus", "1-4", "--frobnicate"], "unknown option --frobnicate"),
    (["--gpus", "1-4", "-Z"], "unknown option -Z"),
    (["--gpus", "1-4", "--array", "1-3"], "elastic job arrays are not supported"),
    (["--gpus", "1-4", "-a", "1-3"], "elastic job arrays are not supported"),
    (["--gpus", "1-4", "-N", "2"], "node count is chosen by slurm-elastic"),
    (["--gpus", "1-4", "--gres=gpu:2"], "drop --gres"),
    (["--gpus", "1-4", "--no-requeue"], "must be requeueable"),
    (["--gpus", "1-4", "--comment", "x"], "carries the elastic spec"),
    (["--gpus", "1-4", "--mem", "4G"], "memory is given per GPU"),
    (["--gpus", "--weight", "2"], "--gpus needs a value"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT)
def test_bad_sbatch_input_is_one_line_exit_2_and_submits_nothing(slurm, tmp_path, args, message):
    script = tmp_path / "bare.sbatch"
    script.write_text("#!/bin/bash\nsrun python train.py\n")
    result = run("sbatch", *args, str(script))
    assert result.exit_code == 2, result.output
    error = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(error) == 1 and message in error[0], result.output
    assert slurm.calls == [] and not slurm.jobs


def test_missing_script_and_missing_shebang(slurm, tmp_path):
    result = run("sbatch", "--gpus", "1-4")
    assert result.exit_code == 2 and "missing the batch script" in result.output
    result = run("sbatch", "--gpus", "1-4", str(tmp_path / "nope.sbatch"))
    assert result.exit_code == 2 and "does not exist" in result.output
    plain = tmp_path / "plain.sh"
    plain.write_text("srun hostname\n")
    result = run("sbatch", "--gpus", "1-4", str(plain))
    assert result.exit_code == 2 and "shebang" in result.output
    bad_directive = tmp_path / "array.sbatch"
    bad_directive.write_text("#!/bin/bash\n#SBATCH --array=1-4\nsrun true\n")
    result = run("sbatch", "--gpus", "1-4", str(bad_directive))
    assert result.exit_code == 2 and "#SBATCH --array" in result.output
    no_gpus = tmp_path / "nogpus.sbatch"
    no_gpus.write_text("#!/bin/bash\nsrun true\n")
    result = run("sbatch", str(no_gpus))
    assert result.exit_code == 2 and "needs --gpus" in result.output
    assert not slurm.jobs


def test_sbatch_submits_at_the_size_the_allocator_gives_now(slurm, script):
    busy = slurm.add_job(None, nodes=2, gpus_per_node=4)      # 8 of 16 GPUs taken by a plain job
    result = run("sbatch", "--parsable", "--gpus", "2-16", "--gpu-step", "2", "-p", "gpu", "--ckpt-dir",
                 "/scratch/ckpt", str(script), "--lr", "0.1")
    assert result.exit_code == 0, result.output
    job_id = int(result.output.strip())
    job = slurm.jobs[job_id]
    assert job.spec == ElasticSpec(2, 16, gpu_step=2, ckpt_dir="/scratch/ckpt")   # the command line wins over #ELASTIC
    assert job.gpus == 8 and job.num_nodes == 2                # what is free, whole nodes when spanning
    assert job.requeue and job.comment == job.spec.to_comment()
    assert busy in slurm.jobs


def test_sbatch_directives_and_dry_run_print_the_sbatch_command(slurm, script):
    result = run("sbatch", "--dry-run", "-t", "5", "--ckpt-dir=/scratch/ckpt", str(script), "arg1")
    assert result.exit_code == 0, result.output
    line = result.output.strip()
    assert line.startswith("sbatch --parsable --nodes=")
    assert "--requeue" in line and "'--comment=elastic:v1 gpus=2-8 step=2" in line
    assert "SLURM_ELASTIC_CKPT_DIR=/scratch/ckpt" in line
    # sbatch's options pass on spelled out in full; the user's come last but for the three the
    # wrapper must have the last word on (--ignore-pbs, the warning before the time limit, and
    # the one merged --export). The interpreter the wrapper runs on is recorded for the job
    # templates (unless the user set one).
    python = os.environ.get("SLURM_ELASTIC_PYTHON") or sys.executable
    assert line.endswith(f"--time=5 --ignore-pbs --signal=B:USR2@120 --export=ALL,SLURM_ELASTIC_CKPT_DIR=/scratch/ckpt,"
                         f"SLURM_ELASTIC_MIN_GPUS=2,SLURM_ELASTIC_LIMIT_WARNING_S=120,SLURM_ELASTIC_PYTHON={python} "
                         f"{script} arg1")
    assert line.count("--export") == 1
    assert not slurm.jobs


def test_a_value_that_spells_a_directive_word_is_only_a_value(slurm, tmp_path):
    script = tmp_path / "named.sbatch"
    script.write_text("#!/bin/bash\n#ELASTIC --gpus 1-2 --ckpt-dir /scratch/ckpt\n#SBATCH -J hetjob --acco=lab\ntrue\n")
    result = run("sbatch", "--dry-run", str(script))
    assert result.exit_code == 0, result.output
    assert not slurm.jobs


def test_status_lists_own_elastic_jobs_with_checkpoint_step(slurm, tmp_path, monkeypatch):
    monkeypatch.setattr("getpass.getuser", lambda: "alice")
    ckpt = tmp_path / "ckpt"
    job_id = slurm.add_job(ElasticSpec(1, 4, ckpt_dir=str(ckpt)), nodes=1, gpus_per_node=2)
    (ckpt / str(job_id)).mkdir(parents=True)
    (ckpt / str(job_id) / "LATEST").write_text("step-0000000042\n")
    slurm.add_job(ElasticSpec(1, 4), nodes=1, gpus_per_node=1, user="bob")
    bad = slurm.add_job(None, nodes=1, gpus_per_node=1, comment="elastic:v1 nonsense", spec_error="malformed")
    result = run("status", "--json")
    rows = json.loads(result.output)
    assert [r["job_id"] for r in rows] == [job_id, bad]
    assert rows[0]["gpus"] == 2 and rows[0]["min_gpus"] == 1 and rows[0]["max_gpus"] == 4
    assert rows[0]["checkpoint_step"] == 42 and rows[1]["spec_error"] == "malformed"
    table = run("status").output
    assert "malformed spec" in table and "42" in table


def test_admin_commands_refuse_non_elastic_and_unknown_job_ids(slurm):
    plain = slurm.add_job(None, nodes=1, gpus_per_node=1)
    bad = slurm.add_job(None, nodes=1, gpus_per_node=1, comment="elastic:v1 x", spec_error="not canonical")
    for args, message in ((["--job", str(plain)], "is not an elastic job"),
                          (["--job", "99999"], "no such job"),
                          (["--job", str(bad)], "its elastic spec is malformed")):
        result = run("admin", "rebalance", "--dry-run", *args)
        assert result.exit_code == 2 and message in result.output, result.output
    assert slurm.calls == []


def test_admin_rebalance_needs_operator_rights(slurm, monkeypatch):
    from slurm_elastic.control import permissions

    monkeypatch.setattr(permissions, "current_caller", lambda: permissions.Caller(1234, "alice"))
    monkeypatch.setattr(permissions, "_run", lambda argv: _completed(argv))
    slurm.add_job(ElasticSpec(1, 4), nodes=1, gpus_per_node=1)
    result = run("admin", "rebalance")
    assert result.exit_code == 2
    assert "only root, the SlurmUser (slurm) or a Slurm operator" in result.output
    assert "sacctmgr failed" in result.output
    assert slurm.calls == []
    assert run("admin", "rebalance", "--dry-run").exit_code == 0     # looking is open to everyone


def _completed(argv):
    import subprocess

    if argv[0] == "scontrol":
        return subprocess.CompletedProcess(argv, 0, "SlurmUser               = slurm(64030)\n", "")
    return subprocess.CompletedProcess(argv, 1, "", "sacctmgr: error: Problem talking to the database\n")


def test_admin_rebalance_acts_and_reports_json(slurm):
    job_id = slurm.add_job(ElasticSpec(1, 8), nodes=1, gpus_per_node=1)
    result = run("admin", "rebalance", "--json", "--ack-timeout", "0", "--hysteresis", "0")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["plans"][0]["job_id"] == job_id and report["outcomes"][0]["status"] == "done"
    assert slurm.jobs[job_id].gpus == report["jobs"][0]["target_gpus"] > 1
    status = json.loads(run("admin", "status", "--json").output)
    assert status["jobs"][0]["gpus"] == status["jobs"][0]["target_gpus"]
    assert {n["name"] for n in status["nodes"]} == {"n1", "n2", "n3", "n4"}


def test_admin_status_shows_the_drains_made_on_jobs_reports_until_they_expire(slurm, tmp_path):
    from slurm_elastic.control.journal import Journal
    from slurm_elastic.control.state_dir import JOURNAL_FILE, daemon_dir

    daemon_dir().mkdir(mode=0o711, parents=True)
    journal = Journal(daemon_dir() / JOURNAL_FILE)
    journal.record_drain("n2", user="alice", job_id=7, reason="slurm-elastic: job 7 (alice) reported its ranks "
                         "here lost", until=4102488000.0, now=4102484400.0)
    journal.close()
    status = json.loads(run("admin", "status", "--json").output)
    [drain] = status["drains"]
    assert (drain["node"], drain["user"], drain["job_id"], drain["until"]) == ("n2", "alice", 7, 4102488000.0)
    text = run("admin", "status").output
    assert "node n2: drained on job 7's report (alice) until 2100-01-01" in text


def test_install_plugin_prints_and_applies_its_changes(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nJobSubmitPlugins=pbs\n")
    dry = run("admin", "install-plugin", "--slurm-conf", str(conf), "--dry-run")
    assert dry.exit_code == 0
    assert f"would create {tmp_path / 'job_submit.lua'}" in dry.output
    assert "JobSubmitPlugins=pbs -> JobSubmitPlugins=pbs,lua" in dry.output
    assert not (tmp_path / "job_submit.lua").exists()
    done = run("admin", "install-plugin", "--slurm-conf", str(conf))
    assert done.exit_code == 0 and "scontrol reconfigure" in done.output
    assert "JobSubmitPlugins=pbs,lua" in conf.read_text()
    again = run("admin", "install-plugin", "--slurm-conf", str(conf))
    assert "unchanged" in again.output and conf.read_text().count("lua") == 1
    missing = run("admin", "install-plugin", "--slurm-conf", str(tmp_path / "none.conf"))
    assert missing.exit_code == 2


@pytest.mark.parametrize("command", [["sbatch"], ["watch"], ["status"], ["admin"], ["admin", "status"],
                                     ["admin", "rebalance"], ["admin", "daemon"], ["admin", "install-plugin"]])
def test_every_help_has_an_example(command):
    result = run(*command, "--help")
    assert result.exit_code == 0
    assert "Example" in result.output and "slurm-elastic " + command[0] in result.output


def test_sbatch_reads_the_partitions_and_reservations_once(slurm, script, monkeypatch):
    # Each is an scontrol call on a real site: the notices and the sizing share one read.
    reads = {"partitions": 0, "reservations": 0}
    partitions, reservations = slurm.partition_times, slurm.reservations

    def count(name, read):
        def counted():
            reads[name] += 1
            return read()
        return counted

    monkeypatch.setattr(slurm, "partition_times", count("partitions", partitions))
    monkeypatch.setattr(slurm, "reservations", count("reservations", reservations))
    result = run("sbatch", "--ckpt-dir", str(script.parent / "ckpt"), str(script))
    assert result.exit_code == 0, result.output
    assert reads == {"partitions": 1, "reservations": 1}
