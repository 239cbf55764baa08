"""The pyslurm backend against a stand-in that behaves like the real pyslurm (tests/cluster/pyslurm_standin.py).

The stand-in's jobs and nodes are real 24.11.5 and 26.05.5 records, so each snapshot is checked
against what the CLI backend's parser makes of the very same capture.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_elastic.cluster import pyslurm_backend
from slurm_elastic.cluster.model import JobState
from slurm_elastic.cluster.parse_json import parse_jobs, parse_nodes
from slurm_elastic.cluster.pyslurm_backend import (FIRST_WORKING, PyslurmBackend, PyslurmUnusable, known_problem,
                                                   per_gpu_requests, probe_pyslurm, pyslurm_version, self_check)
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.cluster.slurm_values import SlurmVersion
from slurm_elastic.errors import SlurmError, SlurmUnavailable, UnknownJob

from tests.cluster.captures import MEM_PER_GPU_JOB, load, project_load, project_text
from tests.cluster.pyslurm_standin import FakeCli, FakePyslurm, FakeSlurmctld

NEW_VERSIONS = ("24.11", "26.05")  # the data_parser versions of the struct pyslurm reads
PROJECT = ("squeue-mem-per-gpu-running.json", "squeue-requeue-held.json", "squeue-held-then-cancelled.json")


def backend_on(squeue_doc: dict, nodes_doc: dict | None = None, *, version: str = "25.11.2",
               **cli_kwargs) -> tuple[PyslurmBackend, FakePyslurm, FakeCli]:
    ctld = FakeSlurmctld(squeue_doc, nodes_doc)
    ps, cli = FakePyslurm(ctld, version=version), FakeCli(ctld, **cli_kwargs)
    return PyslurmBackend(ps, cli=cli), ps, cli  # type: ignore[arg-type]


# --- the snapshot is the CLI backend's model of the same Slurm -----------------------------------------

@pytest.mark.parametrize("version", NEW_VERSIONS)
def test_snapshot_equals_the_cli_parse_of_the_same_capture(version: str) -> None:
    squeue, nodes = load(version, "squeue.json"), load(version, "scontrol-show-nodes.json")
    b, _, cli = backend_on(squeue, nodes)
    state = b.snapshot()
    assert sorted(state.jobs, key=lambda j: j.job_id) == sorted(parse_jobs(squeue), key=lambda j: j.job_id)
    assert sorted(state.nodes, key=lambda n: n.name) == sorted(parse_nodes(nodes), key=lambda n: n.name)
    # Nodes.load + Jobs.load, and one squeue -O for every live GPU job: pyslurm's per-GPU accessors
    # are None for --mem jobs too, so it cannot tell which ones asked per GPU.
    assert b.calls == 2 and [r[:4] for r in cli.runs] == [["squeue", "--noheader", "--states=all", "--jobs=1,2,3"]]


@pytest.mark.parametrize("version", NEW_VERSIONS)
@pytest.mark.parametrize("name", PROJECT)
def test_per_gpu_jobs_reasons_and_holds_equal_the_cli_parse(version: str, name: str) -> None:
    """(d), (f) and the held flag on the cases where pyslurm's accessors fall short."""
    doc = project_load(version, name)
    b, ps, cli = backend_on(doc)
    raw = ps.Job.load(1)
    # what the real pyslurm gives for job 1 here: no per-GPU values, and the description as reason
    assert raw.cpus_per_gpu is None and raw.memory_per_gpu is None
    assert raw.memory_per_node == 500
    jobs = {j.job_id: j for j in b.snapshot().jobs}
    assert jobs == {j.job_id: j for j in parse_jobs(doc)}
    assert {k: getattr(jobs[1], k) for k in MEM_PER_GPU_JOB} == MEM_PER_GPU_JOB
    if name == "squeue-requeue-held.json":
        assert raw.state_reason == "job requeued in held state"
        assert (jobs[1].reason, jobs[1].held) == ("JobHeldUser", True)
    if name == "squeue-held-then-cancelled.json":
        assert (jobs[2].state, jobs[2].held) == (JobState.CANCELLED, False)
    gpu_jobs = [j for j in jobs.values() if j.gpus_per_node]   # finished ones too (their memory is G x M)
    assert len(cli.runs) == 1 and cli.runs[0][0] == "squeue"  # one call for all of them
    assert cli.runs[0][3] == "--jobs=" + ",".join(str(j.job_id) for j in gpu_jobs)


@pytest.mark.parametrize("version", NEW_VERSIONS)
def test_the_squeue_call_prints_what_real_squeue_printed(version: str) -> None:
    # The stand-in's `squeue -O` against the real one at the same moment (requeue-held).
    ctld = FakeSlurmctld(project_load(version, "squeue-requeue-held.json"))
    real = {int(line.split("|")[0]): line.split("|") for line in project_text(version, "squeue-format.txt").splitlines()}
    fake = ctld.squeue_format([1, 2])
    for line in fake.splitlines():
        jid, cpg, mpg, _ = line.split("|")
        assert [cpg, mpg] == real[int(jid)][2:4]
    assert per_gpu_requests(fake)[1] == (1, 500)


def test_jobs_purged_between_the_two_reads_have_no_per_gpu_requests() -> None:
    b, ps, _ = backend_on(project_load("26.05", "squeue-mem-per-gpu-running.json"))
    gone = ps.Job.load(1)
    del ps.ctld.jobs[1], ps.ctld.jobs[2]
    assert b._per_gpu_requests([gone]) == {}


def test_slurm_version_is_slurms_not_pyslurms() -> None:
    b, ps, _ = backend_on(load("26.05", "squeue.json"), load("26.05", "scontrol-show-nodes.json"))
    assert ps.__version__ == "25.11.2"
    assert b.snapshot().slurm_version == "26.05.5"


# --- actions -----------------------------------------------------------------------------------------

def test_resize_is_applied_and_read_back() -> None:
    b, ps, cli = backend_on(project_load("26.05", "squeue-mem-per-gpu-running.json"))
    b.requeue_hold(1)
    b.set_resources(1, RequestShape(1, 3, 2, 700))
    job = {j.job_id: j for j in b.snapshot().jobs}[1]
    assert (job.num_nodes, job.gpus_per_node, job.cpus_per_gpu, job.mem_per_gpu_mb, job.mem_per_node_mb,
            job.held) == (1, 3, 2, 700, 2100, True)
    assert ["scontrol", "update", "JobId=1", "NumNodes=1-1", "NumTasks=1", "NumCPUs=6", "MinCPUsNode=6"] in cli.runs
    update = [r for r in ps.ctld.rpcs if r[0] == "update"][0]
    assert update[2] == {"tres_per_node": "gres:gpu:3", "cpus_per_tres": "gres:gpu:2", "mem_per_tres": "gres:gpu:700"}


def test_pyslurm_that_cannot_build_the_resize_leaves_the_job_and_is_not_a_slurm_error(monkeypatch) -> None:
    """pyslurm 24.11's NameError: raised as it is (a bug, not an outage), and the job keeps its shape."""
    monkeypatch.setattr(pyslurm_backend, "usable_problem", lambda module: None)  # as if the checks missed it
    b, ps, cli = backend_on(project_load("24.11", "squeue-requeue-held.json"), version="24.11.0")
    before = ps.Job.load(1)
    with pytest.raises(NameError, match="'val' is not defined"):
        b.set_resources(1, RequestShape(1, 3, 2, 700))
    after = ps.Job.load(1)
    assert (after.num_nodes, after.gres_per_node) == (before.num_nodes, before.gres_per_node) == (2, {"gres/gpu": 2})
    assert not [r for r in cli.runs if r[:2] == ["scontrol", "update"]]  # the node count was never touched


def test_failed_node_count_rolls_the_gpus_back() -> None:
    b, ps, cli = backend_on(project_load("24.11", "squeue-requeue-held.json"),
                            fail_numnodes="Requested node configuration is not available")
    with pytest.raises(SlurmError, match="Requested node configuration is not available"):
        b.set_resources(1, RequestShape(3, 3, 2, 700))
    job = {j.job_id: j for j in b.snapshot().jobs}[1]
    assert (job.num_nodes, job.gpus_per_node, job.cpus_per_gpu, job.mem_per_gpu_mb) == (2, 2, 1, 500)
    rollback = [r for r in cli.runs if any(a.startswith("TresPerNode=") for a in r)]
    assert rollback == [["scontrol", "update", "JobId=1", "NumNodes=2-2", "NumTasks=2", "NumCPUs=4", "MinCPUsNode=2",
                         "TresPerNode=gres/gpu:2",
                         "CpusPerTres=gres/gpu:1", "MemPerTres=gres/gpu:500",
                         "ReqNodeList="]]   # and the job's node list as it was (none): a resize may have set one


def test_a_field_slurm_did_not_keep_fails_the_resize_and_rolls_back() -> None:
    b, ps, cli = backend_on(project_load("26.05", "squeue-requeue-held.json"))
    ps.ctld.ignore_memory_updates = True
    with pytest.raises(SlurmError, match="did not take the resize to 1x3 GPUs, 2 CPUs and 700 MB per GPU"):
        b.set_resources(1, RequestShape(1, 3, 2, 700))
    job = {j.job_id: j for j in b.snapshot().jobs}[1]
    assert (job.num_nodes, job.gpus_per_node, job.cpus_per_gpu, job.mem_per_gpu_mb) == (2, 2, 1, 500)


def test_programming_errors_pass_through_unwrapped() -> None:
    b, ps, _ = backend_on(project_load("26.05", "squeue-requeue-held.json"))

    def broken(self):  # e.g. a pyslurm whose Job lost a method
        raise AttributeError("'pyslurm.core.job.job.Job' object has no attribute 'ptr'")
    ps.Job.release = broken
    with pytest.raises(AttributeError):
        b.release(1)


@pytest.mark.parametrize("version", NEW_VERSIONS)
def test_finished_and_unknown_jobs_raise_what_the_cli_backend_raises(version: str) -> None:
    """The contract of test_cli_backend::test_finished_and_unknown_job_errors_as_slurm_words_them."""
    b, ps, _ = backend_on(project_load(version, "squeue-held-then-cancelled.json"))
    ps.Job(999999).cancel()   # the real pyslurm returns silently here ...
    ps.Job(2).cancel()        # ... and here (job 2 is CANCELLED)
    with pytest.raises(UnknownJob, match="Invalid job id specified"):
        b.cancel(999999)
    with pytest.raises(SlurmError, match="already completing or completed") as info:
        b.cancel(2)
    assert type(info.value) is SlurmError
    with pytest.raises(UnknownJob, match="Invalid job id specified"):
        b.signal(2, "USR2")
    for action in (b.hold, b.release,
                   lambda j: b.set_resources(j, RequestShape(1, 1, 1, 100))):
        with pytest.raises(SlurmError, match="Job has already finished") as info:
            action(2)
        assert type(info.value) is SlurmError
    for action in (b.hold, b.requeue_hold, b.release, lambda j: b.signal(j, "USR2"),
                   lambda j: b.set_resources(j, RequestShape(1, 1, 1, 100))):
        with pytest.raises(UnknownJob, match="Invalid job id specified"):
            action(999999)


def test_cancel_of_a_live_job() -> None:
    b, ps, _ = backend_on(project_load("26.05", "squeue-mem-per-gpu-running.json"))
    b.cancel(2)
    assert ps.ctld.jobs[2].base == "CANCELLED" and ("kill", 2, 9) in ps.ctld.rpcs


def test_signal_hold_release() -> None:
    b, ps, _ = backend_on(project_load("26.05", "squeue-mem-per-gpu-running.json"))
    b.signal(1, "USR2")
    assert ("kill", 1, 12) in ps.ctld.rpcs
    b.release(2)
    assert not {j.job_id: j for j in b.snapshot().jobs}[2].held
    b.hold(2)
    job = {j.job_id: j for j in b.snapshot().jobs}[2]
    assert job.held and job.reason == "JobHeldAdmin"  # pyslurm's hold() is an admin hold


def test_controller_down_is_unavailable() -> None:
    b, ps, _ = backend_on(load("26.05", "squeue.json"), load("26.05", "scontrol-show-nodes.json"))
    ps.ctld.down = True
    with pytest.raises(SlurmUnavailable, match="Unable to contact"):
        b.snapshot()
    with pytest.raises(SlurmError, match=">= 1"):
        b.set_resources(1, RequestShape(0, 1, 1, 1))


# --- refusing a pyslurm known broken: by version and by the self-check --------------------------------

def test_known_broken_versions() -> None:
    assert "NameError: name 'val' is not defined" in known_problem(SlurmVersion(24, 11, 0))
    assert known_problem(SlurmVersion(25, 11, 0)) and known_problem(FIRST_WORKING) is None


def test_self_check_finds_the_24_11_bug_without_calling_slurm() -> None:
    ctld = FakeSlurmctld(project_load("24.11", "squeue-requeue-held.json"))
    assert "NameError: name 'val' is not defined" in self_check(FakePyslurm(ctld, version="24.11.0"))
    assert self_check(FakePyslurm(ctld, version="25.11.2")) is None
    assert ctld.rpcs == []


def test_the_backend_refuses_a_broken_pyslurm() -> None:
    ctld = FakeSlurmctld(project_load("24.11", "squeue-requeue-held.json"))
    with pytest.raises(PyslurmUnusable, match="known broken"):
        PyslurmBackend(FakePyslurm(ctld, version="24.11.0"), cli=FakeCli(ctld))  # type: ignore[arg-type]
    odd = FakePyslurm(ctld, version="25.11.3")
    odd.JobSubmitDescription.broken_memory_per_gpu = True  # a future release that breaks it again
    with pytest.raises(PyslurmUnusable, match="self-check failed"):
        PyslurmBackend(odd, cli=FakeCli(ctld))  # type: ignore[arg-type]


def test_pyslurm_version() -> None:
    ctld = FakeSlurmctld(load("26.05", "squeue.json"))
    assert pyslurm_version(FakePyslurm(ctld)) == SlurmVersion(25, 11, 2)  # type: ignore[arg-type]


# --- probing pyslurm cannot take this process down -------------------------------------------------------

FATAL_PYSLURM = '''
import os, sys
conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
if not os.path.isfile(conf):
    # libslurm's fatal() when slurm_init() cannot read slurm.conf: a message, then exit(1)
    sys.stderr.write(f"error: s_p_parse_file: unable to status file {conf}: No such file or directory\\n")
    sys.stderr.write("fatal: Unable to process configuration file\\n")
    sys.stderr.flush()
    os._exit(1)
__version__ = "{version}"

class JobSubmitDescription:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
    def _create_job_submit_desc(self, is_update=False):
        if self.__dict__.get("memory_per_gpu") and {broken}:
            raise NameError("name 'val' is not defined")
'''


def fake_pyslurm_package(root: Path, *, version: str = "25.11.2", broken: bool = False) -> Path:
    """A `pyslurm` that dies like libslurm without a usable slurm.conf, on `root` for PYTHONPATH."""
    (root / "pyslurm").mkdir(parents=True)
    (root / "pyslurm" / "__init__.py").write_text(FATAL_PYSLURM.replace("{version}", version)
                                                  .replace("{broken}", str(broken)))
    return root


def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_CONF", "PYTHONPATH")}
    env["PYTHONPATH"] = str(fake_pyslurm_package(tmp_path / "site"))
    env.update(extra)
    return env


def test_probe_survives_a_pyslurm_that_kills_its_process(tmp_path: Path) -> None:
    env = child_env(tmp_path, SLURM_CONF=str(tmp_path / "missing.conf"))
    probe = probe_pyslurm(env)
    assert probe.version is None
    assert "exit code 1" in probe.problem and "Unable to process configuration file" in probe.problem
    with pytest.raises(PyslurmUnusable, match="ended its process"):
        pyslurm_backend.import_pyslurm(env)   # and this process is still here to say so


def test_probe_reports_version_and_self_check(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\n")
    env = child_env(tmp_path, SLURM_CONF=str(conf))
    probe = probe_pyslurm(env)
    assert (probe.version, probe.problem) == ("25.11.2", None)
    broken = fake_pyslurm_package(tmp_path / "broken", version="24.11.0", broken=True)
    probe = probe_pyslurm({**env, "PYTHONPATH": str(broken)})
    assert probe.version == "24.11.0" and "NameError: name 'val' is not defined" in probe.problem


def test_probe_never_imports_a_pyslurm_planted_in_the_current_directory(tmp_path: Path, monkeypatch) -> None:
    planted = tmp_path / "cwd"
    planted.mkdir()
    (planted / "pyslurm.py").write_text("import pathlib\npathlib.Path(__file__).with_name('ran').touch()\n"
                                        "__version__ = '99.1.1'\n")
    monkeypatch.chdir(planted)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path / "empty")   # not ours, so the child runs
    probe = probe_pyslurm(env)
    assert probe.version != "99.1.1" and not (planted / "ran").exists()


# A finder ahead of all others: `import pyslurm` fails as it does where none is installed.
HIDE_PYSLURM = """\
import sys

class _NoPyslurm:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "pyslurm" or name.startswith("pyslurm."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoPyslurm())
"""


def test_probe_without_pyslurm(tmp_path: Path) -> None:
    """Holds where a pyslurm is installed too (here: one on the child's path), hidden by a sitecustomize."""
    site = fake_pyslurm_package(tmp_path / "site")
    (site / "sitecustomize.py").write_text(HIDE_PYSLURM)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    probe = probe_pyslurm(env)
    assert probe.version is None and "No module named 'pyslurm'" in probe.problem, probe


def test_the_probe_outwaits_libslurms_own_retry_of_an_unreadable_slurm_conf() -> None:
    assert pyslurm_backend.PROBE_TIMEOUT_S > pyslurm_backend.LIBSLURM_CONF_RETRY_S == 60.0


def test_collecting_the_live_tests_survives_a_fatal_pyslurm(tmp_path: Path) -> None:
    """pytest collection must not die when SLURM_CONF is unset (test_live.py asks for pyslurm at collection)."""
    env = child_env(tmp_path)
    env.pop("SLURM_ELASTIC_TEST_CLUSTER", None)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/cluster/test_live.py"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "test_contract_snapshot_and_unknown_jobs[pyslurm]" in proc.stdout


def test_selection_logs_why_it_refused(tmp_path: Path, caplog) -> None:
    from slurm_elastic.cluster.select import select_backend
    env = child_env(tmp_path, SLURM_CONF=str(tmp_path / "missing.conf"))
    with caplog.at_level(logging.INFO, logger="slurm_elastic.cluster.select"):
        backend = select_backend("auto", env=env)
    assert backend.name == "cli"
    (line,) = [r.getMessage() for r in caplog.records if r.name == "slurm_elastic.cluster.select"]
    assert line.startswith("Slurm backend: cli (auto: `import pyslurm` ended its process (exit code 1")


@pytest.mark.parametrize("version", NEW_VERSIONS)
@pytest.mark.parametrize("sig, status", [(15, 0), (0, 1)])
def test_the_ending_signal_equals_the_cli_parse(version: str, sig: int, status: int) -> None:
    from tests.cluster.test_parse_json import failed_by_signal

    rec = failed_by_signal(version, sig=sig, exit_status=status)
    doc = {**project_load(version, "squeue-mem-per-gpu-running.json"), "jobs": [rec]}
    b, _, _ = backend_on(doc)
    (job,) = b.snapshot().jobs
    cli = parse_jobs(doc)[0]
    assert job == cli         # the per-GPU requests and the memory per node (G x M) of a finished job too
    assert job.exit_signal == (sig or None) and job.end_time is not None
    assert job.mem_per_gpu_mb == 500 and job.mem_per_node_mb == 500 * job.gpus_per_node


def test_a_job_that_lost_a_node_is_acted_on_through_scontrol(monkeypatch) -> None:
    from slurm_elastic.cluster.backend import NodeExcludingBackend
    from slurm_elastic.cluster.cli_backend import CliBackend

    calls: list[list[str]] = []
    cli = CliBackend(version=SlurmVersion(26, 5, 5))
    monkeypatch.setattr(cli, "_run", lambda argv, **kw: calls.append(list(argv)) or (
        "JobId=1 ExcNodeList=(null)\n" if argv[:3] == ["scontrol", "-o", "show"] else
        "KillWait                = 30 sec\n" if argv[:3] == ["scontrol", "show", "config"] else ""))
    ctld = FakeSlurmctld(project_load("26.05", "squeue-mem-per-gpu-running.json"))
    b = PyslurmBackend(FakePyslurm(ctld), cli=cli)  # type: ignore[arg-type]
    assert isinstance(b, NodeExcludingBackend)
    b.keep_nodes(1, ("n1",))
    b.exclude_nodes(1, ("n2",))
    b.drain("n2", "slurm-elastic: job 1 (alice) reported its ranks here lost")
    b.resume("n2")
    assert b.kill_wait_s() == 30.0
    updates = [c for c in calls if c[:2] == ["scontrol", "update"]]
    assert updates[0][:3] == ["scontrol", "update", "JobId=1"] and "NodeList=n1" in updates[0]
    assert "ExcNodeList=n2" in updates[1]
    assert updates[2][2:4] == ["NodeName=n2", "State=DRAIN"] and updates[3] == ["scontrol", "update", "NodeName=n2",
                                                                               "State=RESUME"]


def test_the_live_tests_probe_pyslurm_with_the_test_clusters_slurm_conf() -> None:
    """At collection SLURM_CONF is unset; with only SLURM_ELASTIC_TEST_CLUSTER set, libslurm would end the
    probe and every pyslurm live test would be skipped."""
    from tests.cluster.test_live import probe_env

    env = probe_env({"PATH": "/usr/bin", "SLURM_ELASTIC_TEST_CLUSTER": "/etc/slurm-test/slurm.conf"})
    assert env["SLURM_CONF"] == "/etc/slurm-test/slurm.conf"
    assert probe_env({"SLURM_CONF": "/a.conf", "SLURM_ELASTIC_TEST_CLUSTER": "/b.conf"})["SLURM_CONF"] == "/a.conf"


def test_a_failed_resize_puts_back_the_begin_time_it_cleared() -> None:
    """Job 2 of the 26.05 capture was requeued (PENDING, BeginTime): the resize's begin_time 'now' clears
    that, so when the node count then fails, the roll-back must set it again."""
    import dataclasses
    import time

    b, ps, cli = backend_on(load("26.05", "squeue.json"), fail_numnodes="Requested node configuration is not available")
    begin = int(time.time()) + 100
    ps.ctld.jobs[2] = dataclasses.replace(ps.ctld.jobs[2], start_time=begin)   # its BeginTime still ahead
    with pytest.raises(SlurmError, match="Requested node configuration is not available"):
        b.set_resources(2, RequestShape(2, 1, 1, 500))
    assert cli.runs[-1] == ["scontrol", "update", "JobId=2",
                            "StartTime=" + time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(begin))]
    cli.runs.clear()
    ps.ctld.jobs[2] = dataclasses.replace(ps.ctld.jobs[2], start_time=int(time.time()) - 5)   # already past
    with pytest.raises(SlurmError):
        b.set_resources(2, RequestShape(2, 1, 1, 500))
    assert not any(a.startswith("StartTime=") for r in cli.runs for a in r)
