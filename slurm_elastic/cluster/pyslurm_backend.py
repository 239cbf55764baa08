"""The Backend over pyslurm's object API (Nodes.load, Jobs.load, Job.modify/requeue/release/cancel).

pyslurm links against one Slurm release. It is used only when all of these hold (select.py):
`import pyslurm` succeeds in a child process first (libslurm's fatal() on an unusable
slurm.conf ends the process that imports it, so the probe must not be this one); its version
is not known broken (`known_problem`); the resize description builds (`self_check`); and its
major.minor is the running Slurm's.

Property names and value shapes follow pyslurm's source (pyslurm/core/job/job.pyx,
submission.pyx, node.pyx, 24.11 and 25.11). Where pyslurm cannot say what the model needs,
the Slurm commands do, in a constant number of calls: `sbatch` submits (it reads #SBATCH lines
as users expect), `scontrol update NumNodes=` resizes (Job.modify ignores a node count), and
`squeue -O cpus-per-tres,mem-per-tres` gives the per-GPU requests that pyslurm's accessors
return only in some encodings.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Mapping

from slurm_elastic.cluster.backend import SubmitDescription
from slurm_elastic.cluster.cli_backend import (CliBackend, classify, cpu_count_fields, node_count_fields,
                                               required_node_fields, update_args)
from slurm_elastic.cluster.model import ClusterState, Job, JobState, Node
from slurm_elastic.cluster.partitions import PartitionTimes
from slurm_elastic.cluster.reservations import AdvanceReservation
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.cluster.slurm_values import (SlurmVersion, expand_hostlist, gres_gpus, job_cpus_per_node,
                                                job_held, job_mem_per_node, job_state, node_state, per_gpu_value,
                                                reason_code, size_mb, spec_from_comment)
from slurm_elastic.errors import SlurmError, SlurmUnavailable, UnknownJob

log = logging.getLogger(__name__)

# JobSubmitDescription(memory_per_gpu=...) raises "NameError: name 'val' is not defined" in every
# pyslurm before 25.11.1 (submission.pyx _set_memory reads an undefined `val`); so does every
# resize, which sets memory per GPU. Seen with pyslurm 24.11 built against Slurm 24.11.5.
FIRST_WORKING = SlurmVersion(25, 11, 1)

# Errors that mean a bug in pyslurm or in this module, never a Slurm answer: they are not
# turned into (retryable) SlurmErrors.
PROGRAMMING_ERRORS = (TypeError, NameError, AttributeError)

# Longer than libslurm's own wait: it retries an unreadable slurm.conf for 60 s ("retrying in 1sec up to
# 60sec") before fatal(), and the probe must see that end, not cut it short.
LIBSLURM_CONF_RETRY_S = 60.0
PROBE_TIMEOUT_S = LIBSLURM_CONF_RETRY_S + 30.0
# Run by `sys.executable -c` in a child process: prints one JSON line, whatever happens.
_PROBE = """\
import json
try:
    import pyslurm
except BaseException as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    raise SystemExit(0)
from slurm_elastic.cluster.pyslurm_backend import self_check
print(json.dumps({"version": str(getattr(pyslurm, "__version__", "")), "self_check": self_check(pyslurm)}))
"""


class PyslurmUnusable(SlurmUnavailable):
    """pyslurm cannot be used here: not importable, kills its process, known broken, or fails its self-check."""


@dataclass(frozen=True, slots=True)
class Probe:
    """What a child process saw of pyslurm: its version, or why it cannot be used."""

    version: str | None
    problem: str | None


def pyslurm_version(module: ModuleType) -> SlurmVersion:
    """pyslurm's version is SLURM_MAJOR.SLURM_MINOR.PATCH, e.g. 25.11.2 for Slurm 25.11."""
    return SlurmVersion.parse(str(getattr(module, "__version__", "")))


def known_problem(version: SlurmVersion) -> str | None:
    """Why this pyslurm release cannot resize jobs, or None."""
    if version < FIRST_WORKING:
        return (f"pyslurm {version} is known broken: JobSubmitDescription(memory_per_gpu=...) raises "
                f"NameError: name 'val' is not defined (fixed in pyslurm {FIRST_WORKING})")
    return None


def resize_description(module: ModuleType, shape: RequestShape, *, start_now: bool) -> Any:
    """The JobSubmitDescription of a resize.

    GRES as a dict: pyslurm turns {'gpu': N} into 'gres:gpu:N', which every Slurm from 22.05
    takes; begin_time 'now' clears the ~120 s BeginTime of a requeued job.
    """
    changes: dict[str, Any] = {"gres_per_node": {"gpu": int(shape.gpus_per_node)},
                               "cpus_per_gpu": int(shape.cpus_per_gpu), "memory_per_gpu": int(shape.mem_per_gpu_mb)}
    if start_now:
        changes["begin_time"] = "now"
    return module.JobSubmitDescription(**changes)


def self_check(module: ModuleType) -> str | None:
    """Build the C description of a resize without sending it; None if it builds, else why not.

    `_create_job_submit_desc(is_update=True)` is what Job.modify() runs before its RPC, so a
    pyslurm that would fail a resize (the 24.11 NameError) fails here, and nothing reaches Slurm.
    """
    try:
        desc = resize_description(module, RequestShape(1, 1, 1, 1), start_now=True)
        build = getattr(desc, "_create_job_submit_desc", None)
        if not callable(build):
            return "pyslurm's JobSubmitDescription has no _create_job_submit_desc, so a resize cannot be checked"
        build(is_update=True)
    except Exception as exc:  # the check's answer, reported by the caller: never swallowed
        return f"self-check failed: JobSubmitDescription(gres_per_node, cpus_per_gpu, memory_per_gpu) " \
               f"raises {type(exc).__name__}: {exc}"
    return None


def probe_pyslurm(env: Mapping[str, str] | None = None, *, timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """Import pyslurm and run `self_check` in a child process (`sys.executable -c`).

    `import pyslurm` initialises libslurm, which calls fatal() -- exit(1) -- when slurm.conf is
    missing or unusable, so trying it in this process could end it. The child gets `env` (the
    caller's environment by default) and finds this package where this process does.
    """
    child_env = dict(os.environ if env is None else env)
    if child_env.get("PYTHONPATH") == os.environ.get("PYTHONPATH") and importlib.util.find_spec("pyslurm") is None:
        # Not installed where the child would look either: no process to start (find_spec only
        # searches the path, it runs nothing).
        return Probe(None, "`import pyslurm` failed: ModuleNotFoundError: No module named 'pyslurm'")
    package_root = str(Path(__file__).resolve().parents[2])
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, child_env.get("PYTHONPATH", "")) if p)
    try:
        # -P: the current directory is not put on the child's path, so a `pyslurm.py` planted where
        # an operator happens to stand (say /tmp) is never what the probe imports.
        proc = subprocess.run([sys.executable, "-P", "-c", _PROBE], capture_output=True, text=True,
                              env=child_env, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return Probe(None, f"`import pyslurm` did not finish within {timeout_s:.0f} s in a probe process")
    err = proc.stderr.strip().splitlines()
    if proc.returncode != 0:
        how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        return Probe(None, f"`import pyslurm` ended its process ({how}; libslurm exits on an unusable "
                           f"slurm.conf): {err[-1] if err else 'no message'}")
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return Probe(None, f"the pyslurm probe printed no answer: {proc.stdout[-200:]!r} {err[-1:]}")
    if "error" in answer:
        return Probe(None, f"`import pyslurm` failed: {answer['error']}")
    return Probe(str(answer.get("version") or ""), answer.get("self_check"))


def import_pyslurm(env: Mapping[str, str] | None = None) -> ModuleType:
    """`import pyslurm`, once a probe process showed that it neither fails nor ends the process."""
    probe = probe_pyslurm(env)
    if probe.version is None:
        raise PyslurmUnusable(probe.problem or "pyslurm cannot be imported")
    return importlib.import_module("pyslurm")


def usable_problem(module: ModuleType) -> str | None:
    """Why this pyslurm must not be used (unreadable version, known broken release, failed self-check), or None."""
    try:
        version = pyslurm_version(module)
    except SlurmError as exc:
        return f"pyslurm's version is unreadable: {exc}"
    return known_problem(version) or self_check(module)


class PyslurmBackend:
    """Slurm through pyslurm; `module` is pyslurm itself (or, in unit tests, a stand-in).

    Refuses (PyslurmUnusable) a pyslurm that `usable_problem` rejects.
    """

    name = "pyslurm"

    def __init__(self, module: ModuleType | None = None, *, cli: CliBackend | None = None) -> None:
        self._ps = module if module is not None else import_pyslurm()
        problem = usable_problem(self._ps)
        if problem:
            raise PyslurmUnusable(problem)
        self._cli = cli if cli is not None else CliBackend()
        self.calls = 0  # pyslurm calls; Slurm commands are counted by the CLI backend

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        try:
            return fn(*args, **kwargs)
        except PROGRAMMING_ERRORS:
            raise  # a bug is not a Slurm outage: never retried as one
        except SlurmError:
            raise
        except Exception as exc:  # pyslurm.RPCError (str() is Slurm's message), ValueError from its parsers
            raise classify(str(exc) or type(exc).__name__, ("pyslurm", what), getattr(exc, "errno", None)) from exc

    # --- reading -----------------------------------------------------------------------------------
    def snapshot(self) -> ClusterState:
        taken_at = time.time()
        nodes = _values(self._call("Nodes.load", self._ps.Nodes.load))
        jobs = _values(self._call("Jobs.load", self._ps.Jobs.load))
        return state_from_pyslurm(nodes, jobs, taken_at=taken_at, slurm_version=str(self._cli.version),
                                  per_gpu=self._per_gpu_requests(jobs))

    def _job(self, job_id: int) -> Job:
        """One job, read back from slurmctld (UnknownJob when Slurm does not know it)."""
        raw = self._call("Job.load", self._ps.Job.load, int(job_id))
        return job_from_pyslurm(raw, self._per_gpu_requests([raw]).get(int(raw.id)))

    def _per_gpu_requests(self, jobs: list[Any]) -> dict[int, tuple[int | None, int | None]]:
        """CPUs and memory per GPU of the jobs pyslurm leaves them out for, from one `squeue -O` call
        (`--states=all`: the finished jobs slurmctld still keeps are listed too).

        pyslurm's cpus_per_gpu is None whenever Slurm also sets cpus_per_task (24.11 and 26.05
        set 1 on every job of the captures), and memory_per_gpu is None whenever Slurm sets a
        memory per node (23.02+ do for --mem-per-gpu jobs); both parse only 'gres:gpu:N', not
        23.02's 'gres/gpu:N'. They are None for --mem jobs too, so every live GPU job is asked.
        """
        missing = [int(j.id) for j in jobs if _lacks_per_gpu(j)]
        if not missing:
            return {}
        try:
            out = self._cli._run(["squeue", "--noheader", "--states=all", f"--jobs={','.join(map(str, missing))}",
                                  "-O", "JobID:|,cpus-per-tres:|,mem-per-tres:|"])
        except UnknownJob:
            # squeue fails only when *every* listed id is gone (it skips single unknown ones, 22.05
            # to 26.05): those jobs were purged since Jobs.load and the next snapshot has none of them.
            return {}
        return per_gpu_requests(out)

    # --- acting ------------------------------------------------------------------------------------
    def submit(self, description: SubmitDescription) -> int:
        # sbatch reads #SBATCH lines and the script's environment exactly as a user would get.
        return self._cli.submit(description)

    def partition_times(self) -> tuple[PartitionTimes, ...]:
        # read as the wrapper's sbatch is run: through the commands (the submitting user's view)
        return self._cli.partition_times()

    def reservations(self) -> tuple[AdvanceReservation, ...]:
        return self._cli.reservations()

    def hold(self, job_id: int) -> None:
        self._call("Job.hold", self._ps.Job(int(job_id)).hold)

    def requeue_hold(self, job_id: int) -> None:
        self._call("Job.requeue", self._ps.Job(int(job_id)).requeue, hold=True)

    def requeue(self, job_id: int) -> None:
        self._call("Job.requeue", self._ps.Job(int(job_id)).requeue, hold=False)

    def set_resources(self, job_id: int, shape: RequestShape, *, start_now: bool = True,
                      nodes: tuple[str, ...] | None = None) -> None:
        """All or nothing: the new shape is read back, and any failure restores the old one."""
        sizes = shape.to_json()
        if min(sizes.values()) < 1:
            raise SlurmError("set_resources: every size must be >= 1 ("
                             + ", ".join(f"{k}={v}" for k, v in sizes.items()) + ")")
        raw = self._call("Job.load", self._ps.Job.load, int(job_id))
        before = job_from_pyslurm(raw, self._per_gpu_requests([raw]).get(int(raw.id)))
        # The resize's begin_time 'now' clears a BeginTime; a failed resize must put it back.
        begin = _begin_time(raw, before) if start_now else None
        target = (shape.nodes, shape.gpus_per_node, shape.cpus_per_gpu, shape.mem_per_gpu_mb)
        try:
            # Job.modify first: it is where pyslurm fails (before its RPC when the description does
            # not build), so the commonest failure leaves Slurm untouched.
            desc = resize_description(self._ps, shape, start_now=start_now)
            self._call("Job.modify", self._ps.Job(int(job_id)).modify, desc)
            # Job.modify() ignores a node count, so scontrol sets it (N-N: a bare N sets only the minimum),
            # and the CPU count, which per-GPU CPUs do not change (cpu_count_fields), and the nodes.
            self._cli._run(["scontrol", "update", f"JobId={int(job_id)}", *node_count_fields(shape.nodes),
                            *cpu_count_fields(shape), *required_node_fields(nodes)])
            after = self._job(job_id)
            if _shape(after) != target:
                raise SlurmError(f"job {job_id}: Slurm did not take the resize to {_show(target)}: it shows "
                                 f"{_show(_shape(after))}")
        except Exception as exc:
            try:
                self._roll_back(job_id, before, exc)
            finally:
                if begin is not None:
                    self._restore_begin(job_id, begin, exc)
            raise

    def _restore_begin(self, job_id: int, begin: float, cause: BaseException) -> None:
        """Put back the BeginTime the failed resize cleared (a job requeued moments ago must not start now)."""
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(begin))
        try:
            self._cli._run(["scontrol", "update", f"JobId={int(job_id)}", f"StartTime={when}"])
        except SlurmError as exc:
            log.error("job %d: resize failed (%s) and its begin time %s could not be put back: %s", job_id, cause,
                      when, exc)
            return
        log.warning("job %d: resize failed; its begin time %s put back", job_id, when)

    def _roll_back(self, job_id: int, before: Job, cause: BaseException) -> None:
        """Put back the shape `before` had (through scontrol, which takes every spelling on every version)."""
        try:
            now = self._job(job_id)
        except SlurmError as exc:
            log.error("job %d: resize failed (%s) and the job cannot be read back to roll it back: %s",
                      job_id, cause, exc)
            return
        if _shape(now) == _shape(before) and now.required_nodes == before.required_nodes:
            log.warning("job %d: resize failed (%s: %s); the job is unchanged", job_id, type(cause).__name__, cause)
            return
        nodes, gpus, cpus, mem = _shape(before)
        if min(gpus, cpus or 0, mem or 0) >= 1:
            args = update_args(self._cli.version, job_id, RequestShape(nodes, gpus, cpus or 1, mem or 1),
                               start_now=False, nodes=before.required_nodes)
        else:  # no per-GPU request to restore: the node count and nodes are what this backend changed alone
            args = ["scontrol", "update", f"JobId={int(job_id)}", *node_count_fields(nodes),
                    *required_node_fields(before.required_nodes)]
        try:
            self._cli._run(args)
            restored = _shape(self._job(job_id))
        except SlurmError as exc:
            raise SlurmError(f"job {job_id}: resize failed ({cause}) and rolling back to {_show(_shape(before))} "
                             f"failed too: {exc}") from cause
        if restored != _shape(before):
            raise SlurmError(f"job {job_id}: resize failed ({cause}); after the roll-back Slurm shows "
                             f"{_show(restored)}, not {_show(_shape(before))}") from cause
        log.warning("job %d: resize failed (%s: %s); rolled back to %s", job_id, type(cause).__name__, cause,
                    _show(restored))

    def release(self, job_id: int) -> None:
        self._call("Job.release", self._ps.Job(int(job_id)).release)

    def set_priority(self, job_id: int, priority: int) -> None:
        self._cli.set_priority(job_id, priority)      # one scontrol update, as on every version

    def signal(self, job_id: int, signal: str) -> None:
        # steps="all" sets KILL_FULL_JOB: the batch shell and every step, like scancel --full.
        name = str(signal).upper()
        name = name if name.isdigit() or name.startswith("SIG") else f"SIG{name}"
        self._call("Job.send_signal", self._ps.Job(int(job_id)).send_signal,
                   int(name) if name.isdigit() else name, steps="all")

    # --- a job's report of a lost node (NodeExcludingBackend) -------------------------------------------
    # pyslurm's Job.modify cannot shrink a running job to some of its nodes, and its description has no
    # excluded-node list; scontrol does all of these on every version, so they go through the CLI backend
    # (one Slurm command each), and the controller acts on peer-lost reports with this backend too.
    def keep_nodes(self, job_id: int, nodes: tuple[str, ...]) -> None:
        self._cli.keep_nodes(job_id, nodes)

    def exclude_nodes(self, job_id: int, nodes: tuple[str, ...], *, readmit: tuple[str, ...] = ()) -> None:
        self._cli.exclude_nodes(job_id, nodes, readmit=readmit)

    def drain(self, node: str, reason: str) -> None:
        self._cli.drain(node, reason)

    def resume(self, node: str) -> None:
        self._cli.resume(node)

    def kill_wait_s(self) -> float:
        return self._cli.kill_wait_s()

    def slurmd_timeout_s(self) -> float:
        return self._cli.slurmd_timeout_s()

    def cancel(self, job_id: int) -> None:
        """Cancel; an unknown or finished job is an error, as `scancel --verbose` reports it.

        pyslurm's cancel (send_signal(9)) ignores ESLURM_ALREADY_DONE and, for SIGKILL,
        ESLURM_INVALID_JOB_ID on purpose (job.pyx), so the job is looked at first.
        """
        job = self._job(job_id)  # UnknownJob "Invalid job id specified" for an id Slurm does not know
        if job.state.finished:
            raise SlurmError(f"pyslurm Job.cancel: job {job_id} is {job.state.value}: "
                             "Job/step already completing or completed", command=("pyslurm", "Job.cancel"))
        self._call("Job.cancel", self._ps.Job(int(job_id)).cancel)


def _begin_time(raw: Any, job: Job) -> float | None:
    """A pending job's BeginTime still ahead (epoch seconds), else None. Slurm reports it as the job's
    eligible time, and as its start time while it waits for it (24.11 and 26.05 captures alike)."""
    if job.state is not JobState.PENDING or job.reason != "BeginTime":
        return None
    for name in ("eligible_time", "start_time"):
        value = getattr(raw, name, None)
        if value:
            return float(value) if float(value) > time.time() else None
    return None


def _shape(job: Job) -> tuple[int, int, int | None, int | None]:
    return job.num_nodes, job.gpus_per_node, job.cpus_per_gpu, job.mem_per_gpu_mb


def _show(shape: tuple[int, int, int | None, int | None]) -> str:
    nodes, gpus, cpus, mem = shape
    return f"{nodes}x{gpus} GPUs, {cpus} CPUs and {mem} MB per GPU"


def per_gpu_requests(squeue_out: str) -> dict[int, tuple[int | None, int | None]]:
    """`squeue -O JobID:|,cpus-per-tres:|,mem-per-tres:|` lines -> {job id: (CPUs per GPU, MB per GPU)}."""
    out: dict[int, tuple[int | None, int | None]] = {}
    for line in squeue_out.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) < 3 or not fields[0].isdigit():
            continue
        cpg, mpg = per_gpu_value(fields[1]), per_gpu_value(fields[2])
        out[int(fields[0])] = (int(cpg) if cpg and cpg.isdigit() else None, size_mb(mpg) if mpg else None)
    return out


def _values(collection: Any) -> Iterable[Any]:
    """pyslurm's Nodes/Jobs are MultiClusterMaps: values() runs over every cluster's entries."""
    values = getattr(collection, "values", None)
    return list(values()) if callable(values) else list(collection)


def _gpu_count(gres: Any) -> int | None:
    """pyslurm GRES dicts: {'gpu': 4}, {'gpu:a100': 2}, {'gres/gpu': 3}, {'gpu': {'count': 3, ...}}
    or, from 25.11's `Job.gpus`, {'gpu': GPU(count=3)}."""
    if not gres:
        return None
    if isinstance(gres, str):
        return gres_gpus(gres)
    total = None
    for key, val in dict(gres).items():
        name = str(key)
        for prefix in ("gres/", "gres:"):
            name = name.removeprefix(prefix)
        if name.split(":")[0] != "gpu":
            continue
        if isinstance(val, dict):
            val = val.get("count", 0)
        total = (total or 0) + int(getattr(val, "count", val))
    return total


def node_from_pyslurm(n: Any) -> Node:
    state, flags = node_state(str(n.state or "UNKNOWN"))
    used = _gpu_count(getattr(n, "allocated_gres", None))
    return Node(
        name=str(n.name), state=state, flags=flags,
        cpus=int(n.effective_cpus or n.total_cpus or 0), cpus_alloc=int(n.allocated_cpus or 0),
        mem_mb=int(n.real_memory or 0), mem_alloc_mb=int(n.allocated_memory or 0),
        gpus=_gpu_count(n.configured_gres) or 0, gpus_alloc=used if used is not None else -1,
        partitions=tuple(n.partitions or ()), reason=str(n.reason or ""),
        slurmd_started_at=float(getattr(n, "slurmd_start_time", 0) or 0) or None,
    )


def _accessor(j: Any, name: str) -> Any:
    """A pyslurm per-GPU accessor, or None where it cannot parse Slurm's encoding.

    cpus_per_gpu and memory_per_gpu take field [2] of 'gres:gpu:N', so the 23.02+ spelling
    'gres/gpu:N' raises IndexError inside pyslurm (job.pyx, 25.11.2 too); the squeue fill-in
    covers those.
    """
    try:
        return getattr(j, name)
    except (IndexError, ValueError):
        return None


def _allocated_mem_per_node(j: Any) -> int | None:
    """The largest memory Slurm allocated on a node of a running job (get_resource_layout_per_node)."""
    layout = getattr(j, "get_resource_layout_per_node", None)
    if not callable(layout):
        return None
    mems = [int(v["memory"]) for v in (layout() or {}).values() if isinstance(v, dict) and v.get("memory")]
    return max(mems) if mems else None


def _lacks_per_gpu(j: Any) -> bool:
    """A job with GPUs whose per-GPU CPUs or memory pyslurm does not give (a finished one too: its memory
    per node is G x M only when M is known, and the CLI backend's parse gives both)."""
    return (bool(_gpu_count(j.gres_per_node))
            and (_accessor(j, "cpus_per_gpu") is None or _accessor(j, "memory_per_gpu") is None))


def _node_names(value: object) -> tuple[str, ...]:
    """A node-list attribute as names: pyslurm gives a list of names, or a hostlist string."""
    if not value:
        return ()
    if isinstance(value, str):
        return expand_hostlist(value)
    return tuple(str(v) for v in value)  # type: ignore[attr-defined]


def job_from_pyslurm(j: Any, per_gpu: tuple[int | None, int | None] | None = None) -> Job:
    """One pyslurm Job; `per_gpu` (CPUs, MB per GPU) fills what its accessors leave out."""
    state = job_state(str(j.state))
    nodes = expand_hostlist(j.allocated_nodes or "")
    num_nodes = len(nodes) if (nodes and state.active) else int(j.num_nodes or 1)
    gpn = _gpu_count(j.gres_per_node)
    if gpn is None:
        total = _gpu_count(getattr(j, "gpus", None))
        gpn = -(-total // max(num_nodes, 1)) if total else 0
    cpus_per_gpu = _accessor(j, "cpus_per_gpu")
    cpus_per_gpu = int(cpus_per_gpu) if cpus_per_gpu else None
    mem_per_gpu = _mem(_accessor(j, "memory_per_gpu"))
    if per_gpu is not None:
        cpus_per_gpu = cpus_per_gpu or per_gpu[0]
        mem_per_gpu = mem_per_gpu or per_gpu[1]
    cpus_per_node = job_cpus_per_node(int(j.cpus or 0), num_nodes, gpus_per_node=gpn, cpus_per_gpu=cpus_per_gpu,
                                      running=state.active)
    mem_node = job_mem_per_node(
        allocated=_allocated_mem_per_node(j) if state.active else None, per_gpu=mem_per_gpu, gpus_per_node=gpn,
        per_node=_mem(j.memory_per_node), per_cpu=_mem(j.memory_per_cpu), cpus_per_node=cpus_per_node)
    comment = str(j.comment or "")
    spec, spec_error = spec_from_comment(comment)
    ran = state.active or state.finished
    return Job(
        job_id=int(j.id), user=str(j.user_name or j.user_id), name=str(j.name or ""), state=state,
        # pyslurm gives the state description where Slurm set one ("job requeued in held state")
        reason=reason_code(str(j.state_reason or "")),
        nodes=nodes, num_nodes=num_nodes, gpus_per_node=gpn, cpus_per_node=cpus_per_node, mem_per_node_mb=mem_node,
        batch_host=str(getattr(j, "batch_host", "") or "") if state.active else "",
        cpus_per_gpu=cpus_per_gpu, mem_per_gpu_mb=mem_per_gpu,
        restarts=int(j.requeue_count or 0), requeue=bool(j.is_requeueable),
        held=job_held(state, hold_flag=False, priority=j.priority),
        partition=str(j.partition or ""), comment=comment, user_id=j.user_id, reservation=str(j.reservation or ""),
        required_nodes=_node_names(getattr(j, "required_nodes", None)),
        excluded_nodes=_node_names(getattr(j, "excluded_nodes", None)),
        constraint=str(getattr(j, "constraints", None) or ""),   # job.pyx: cstr.to_unicode(ptr.features)
        submit_time=float(j.submit_time) if j.submit_time else None,
        start_time=float(j.start_time) if (j.start_time and ran) else None,
        end_time=float(j.end_time) if (state.finished and getattr(j, "end_time", None)) else None,
        exit_signal=(int(getattr(j, "exit_code_signal", 0) or 0) or None) if state.finished else None,
        spec=spec, spec_error=spec_error, priority=None if j.priority is None else int(j.priority),
    )


def _mem(value: Any) -> int | None:
    if value is None or value == 0:
        return None
    if isinstance(value, (int, float)):
        return int(value)
    return size_mb(str(value))


def state_from_pyslurm(nodes: Iterable[Any], jobs: Iterable[Any], *, taken_at: float, slurm_version: str = "",
                       per_gpu: Mapping[int, tuple[int | None, int | None]] | None = None) -> ClusterState:
    """Translate pyslurm objects; a node whose GPU use pyslurm does not report gets it from its jobs.

    pyslurm exposes a node's used GRES only through its allocated TRES, which lack gres/gpu
    unless the site accounts GPUs (AccountingStorageTRES); the running jobs say the same thing.
    `per_gpu` holds the per-GPU requests read elsewhere (PyslurmBackend._per_gpu_requests).
    """
    per_gpu = per_gpu or {}
    job_list = tuple(job_from_pyslurm(j, per_gpu.get(int(j.id))) for j in jobs)
    held: dict[str, int] = {}
    for job in job_list:
        if job.state.active:
            for name in job.nodes:
                held[name] = held.get(name, 0) + job.gpus_per_node
    node_list = []
    for raw in nodes:
        node = node_from_pyslurm(raw)
        if node.gpus_alloc < 0:
            node = replace(node, gpus_alloc=held.get(node.name, 0))
        node_list.append(node)
    return ClusterState(nodes=tuple(node_list), jobs=job_list, taken_at=taken_at, slurm_version=slurm_version)


