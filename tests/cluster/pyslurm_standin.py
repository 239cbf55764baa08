"""A stand-in for pyslurm that behaves like the real one, over job and node records of a real Slurm.

pyslurm cannot be installed here (it builds against one Slurm release; this machine runs 22.05).
The stand-in has two halves:

- `FakeSlurmctld` holds what slurmctld holds for each job as the fields of Slurm's
  slurm_job_info_t (job_state with its flags, state_reason and state_desc, priority,
  pn_min_memory, cpus_per_task, cpus_per_tres, mem_per_tres, tres_per_node, ...), filled from
  the real 24.11.5 and 26.05.5 captures (`squeue --json` renders that struct). Its RPCs answer
  like Slurm's, as measured on every version (tests/cluster/slurm-json/README.md): SIGKILL of a
  finished job -> ESLURM_ALREADY_DONE, any other signal -> ESLURM_INVALID_JOB_ID, an update of
  a finished job -> "Job has already finished".
- `FakePyslurm` exposes them through pyslurm's own rules, as read in pyslurm's source
  (pyslurm/core/job/job.pyx, submission.pyx, node.pyx, utils/cstr.pyx: GitHub's files, and the
  25.11.2 source distribution from PyPI):
  * `Job.state` is job_state_string(): a flag (REQUEUE_HOLD, COMPLETING, ...) before the base state;
  * `Job.state_reason` is the state description when Slurm set one, else the reason code;
  * `Job.cpus_per_gpu` is None unless cpus_per_task is NO_VAL16, `Job.memory_per_gpu` None
    unless pn_min_memory is NO_VAL64; both read field [2] of the TRES string, so the 23.02+
    spelling 'gres/gpu:1' raises IndexError;
  * `Job.gres_per_node` is to_gres_dict(tres_per_node): {'gres/gpu': 2} for 'gres/gpu:2';
  * `Node.allocated_gres` is the gres/ part of the node's allocated TRES (25.11);
  * `Job.send_signal` ignores ESLURM_ALREADY_DONE, and ESLURM_INVALID_JOB_ID for SIGKILL;
    `cancel()` is send_signal(9), so it returns silently for an unknown or finished job;
  * `Job.modify` builds the C description first (`_create_job_submit_desc(is_update=True)`),
    then sends it; it has no node count; `hold()`/`release()` are modify(priority=0/INFINITE);
  * `JobSubmitDescription(memory_per_gpu=...)` raises NameError: name 'val' is not defined
    while building, before 25.11.1; from_gres_dict turns {'gpu': N} into 'gres:gpu:N'.
No pyslurm code is copied; the rules are re-expressed from reading it.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from typing import Any

from slurm_elastic.cluster.slurm_values import SlurmVersion, number

NO_VAL16 = 0xFFFE
NO_VAL64 = 0xFFFFFFFFFFFFFFFE
MEM_PER_CPU = 0x8000000000000000
INFINITE = 0xFFFFFFFF

# The errors these RPCs return, with slurm_strerror()'s texts (seen live through scancel/scontrol);
# the numbers only tell them apart here: the backend reads the message, as pyslurm.RPCError gives it.
ESLURM_INVALID_JOB_ID = 2017
ESLURM_ALREADY_DONE = 2021
ESLURM_JOB_FINISHED = 2052
ESLURM_JOB_NOT_PENDING = 2020
ESLURM_JOB_PENDING = 2019
SLURMCTLD_COMMUNICATIONS_CONNECTION_ERROR = 1001
STRERROR = {SLURMCTLD_COMMUNICATIONS_CONNECTION_ERROR: "Unable to contact slurm controller (connect failure)",
            ESLURM_INVALID_JOB_ID: "Invalid job id specified",
            ESLURM_ALREADY_DONE: "Job/step already completing or completed",
            ESLURM_JOB_FINISHED: "Job has already finished",
            ESLURM_JOB_NOT_PENDING: "Job is no longer pending execution",
            ESLURM_JOB_PENDING: "Job is pending execution"}

_FLAG_ORDER = ("COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
               "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING")
_FINISHED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
             "OUT_OF_MEMORY"}


class FakeRPCError(Exception):
    """pyslurm.RPCError: str() is slurm_strerror(errno)."""

    def __init__(self, errno: int) -> None:
        super().__init__(STRERROR[errno])
        self.errno = errno


@dataclass
class RawJob:
    """The slurm_job_info_t fields pyslurm's Job reads."""

    job_id: int
    name: str
    user_id: int
    user_name: str
    job_state: list[str]           # base state first, then flags, as squeue --json lists them
    state_reason: str
    state_desc: str | None
    priority: int
    nodes: str | None
    num_nodes: int
    num_cpus: int | None
    pn_min_memory: int
    cpus_per_task: int
    cpus_per_tres: str | None
    mem_per_tres: str | None
    tres_per_node: str | None
    restart_cnt: int
    requeue: bool
    partition: str
    comment: str | None
    submit_time: int
    start_time: int
    memory_allocated: dict[str, int] = field(default_factory=dict)  # job_resources, running jobs only
    end_time: int = 0
    exit_code: int = 0   # job_info's raw wait status
    resv_name: str | None = None
    batch_host: str | None = None
    req_nodes: str | None = None
    exc_nodes: str | None = None
    features: str | None = None

    @property
    def base(self) -> str:
        return self.job_state[0]

    @property
    def finished(self) -> bool:
        return self.base in _FINISHED


def raw_job_from_capture(rec: dict) -> RawJob:
    """A 23.02+ `squeue --json` job record back to the struct fields it was rendered from."""
    states = rec["job_state"] if isinstance(rec["job_state"], list) else [rec["job_state"]]
    mem_node, mem_cpu = rec.get("memory_per_node"), rec.get("memory_per_cpu")
    if isinstance(mem_cpu, dict) and mem_cpu.get("set"):
        pn_min_memory = number(mem_cpu) | MEM_PER_CPU
    elif isinstance(mem_node, dict) and mem_node.get("set"):
        pn_min_memory = number(mem_node)
    else:
        pn_min_memory = NO_VAL64
    cpt = rec.get("cpus_per_task")
    resources = rec.get("job_resources") or {}
    allocated = {a["name"]: a["memory"]["allocated"] for a in (resources.get("nodes") or {}).get("allocation") or ()}
    return RawJob(
        job_id=rec["job_id"], name=rec["name"], user_id=rec["user_id"], user_name=rec["user_name"],
        job_state=list(states), state_reason=rec["state_reason"], state_desc=rec["state_description"] or None,
        priority=number(rec["priority"]), nodes=rec.get("nodes") or None, num_nodes=number(rec["node_count"]),
        num_cpus=number(rec["cpus"]), pn_min_memory=pn_min_memory,
        cpus_per_task=number(cpt) if isinstance(cpt, dict) and cpt.get("set") else NO_VAL16,
        cpus_per_tres=rec.get("cpus_per_tres") or None, mem_per_tres=rec.get("memory_per_tres") or None,
        tres_per_node=rec.get("tres_per_node") or None, restart_cnt=number(rec["restart_cnt"]),
        requeue=bool(rec["requeue"]), partition=rec["partition"], comment=rec.get("comment") or None,
        submit_time=number(rec["submit_time"]) or 0, start_time=number(rec["start_time"]) or 0,
        memory_allocated=allocated, end_time=number(rec.get("end_time")) or 0,
        exit_code=_wait_status(rec.get("exit_code")), resv_name=rec.get("resv_name") or None,
        batch_host=rec.get("batch_host") or None, req_nodes=rec.get("required_nodes") or None,
        exc_nodes=rec.get("excluded_nodes") or None, features=rec.get("features") or None)


def _wait_status(ec: object) -> int:
    """The wait status slurmrestd rendered as {return_code, signal} (23.02 on)."""
    if not isinstance(ec, dict):
        return 0
    sig = number((ec.get("signal") or {}).get("id")) or 0
    return sig if sig else (number(ec.get("return_code")) or 0) << 8


def to_gres_dict(text: str | None) -> dict:
    """pyslurm's cstr.to_gres_dict for the per-node request forms ('gres/gpu:2', 'gres:gpu:2', 'gpu:4')."""
    out: dict = {}
    if not text or text == "(null)":
        return out
    for item in re.split(r",(?=[^,]+?:)", text):
        item = item.replace("gres:", "")
        parts = re.split(r":(?=[^:]+?)", item.replace("(", ":", 1).replace(")", ""))
        name, typ = parts[0], parts[1]
        if typ.isdigit():
            count, typ = typ, None
        else:
            count = parts[2]
        key = f"{name}:{typ}" if typ else name
        if "IDX" in parts:
            out[key] = {"count": count, "indexes": parts[3] if not typ else parts[4]}
        else:
            out[key] = int(count)
    return out


class FakeJob:
    """pyslurm.Job over a RawJob (properties as job.pyx computes them)."""

    def __init__(self, raw: RawJob) -> None:
        self._r = raw

    id = property(lambda self: self._r.job_id)
    name = property(lambda self: self._r.name)
    user_id = property(lambda self: self._r.user_id)
    user_name = property(lambda self: self._r.user_name)
    priority = property(lambda self: self._r.priority)
    allocated_nodes = property(lambda self: self._r.nodes)
    num_nodes = property(lambda self: self._r.num_nodes)
    cpus = property(lambda self: self._r.num_cpus if self._r.num_cpus is not None else 1)
    requeue_count = property(lambda self: self._r.restart_cnt)
    is_requeueable = property(lambda self: self._r.requeue)
    partition = property(lambda self: self._r.partition)
    reservation = property(lambda self: self._r.resv_name)   # job.pyx: cstr.to_unicode(ptr.resv_name)
    batch_host = property(lambda self: self._r.batch_host)   # job.pyx: cstr.to_unicode(ptr.batch_host)
    required_nodes = property(lambda self: self._r.req_nodes)  # job.pyx: cstr.to_unicode(ptr.req_nodes)
    excluded_nodes = property(lambda self: self._r.exc_nodes)  # job.pyx: cstr.to_unicode(ptr.exc_nodes)
    constraints = property(lambda self: self._r.features)      # job.pyx: cstr.to_unicode(ptr.features)
    comment = property(lambda self: self._r.comment)
    submit_time = property(lambda self: self._r.submit_time or None)
    start_time = property(lambda self: self._r.start_time or None)
    end_time = property(lambda self: self._r.end_time or None)
    # job.pyx _get_exit_code: WTERMSIG of a signalled status, else 0
    exit_code_signal = property(lambda self: os.WTERMSIG(self._r.exit_code) if os.WIFSIGNALED(self._r.exit_code)
                                else 0)
    gres_per_node = property(lambda self: to_gres_dict(self._r.tres_per_node))
    gpus: dict = {}

    @property
    def state(self) -> str:
        for flag in _FLAG_ORDER:
            if flag in self._r.job_state:
                return flag
        return self._r.base

    @property
    def state_reason(self) -> str:
        return self._r.state_desc or self._r.state_reason

    @property
    def cpus_per_gpu(self) -> int | None:
        if not self._r.cpus_per_tres or self._r.cpus_per_task != NO_VAL16:
            return None
        return int(self._r.cpus_per_tres.split(":")[2])

    @property
    def memory_per_node(self) -> int | None:
        m = self._r.pn_min_memory
        return None if m == NO_VAL64 or m & MEM_PER_CPU or m == 0 else m

    @property
    def memory_per_cpu(self) -> int | None:
        m = self._r.pn_min_memory
        return (m & ~MEM_PER_CPU) or None if m != NO_VAL64 and m & MEM_PER_CPU else None

    @property
    def memory_per_gpu(self) -> int | None:
        if self._r.mem_per_tres and self._r.pn_min_memory == NO_VAL64:
            return int(self._r.mem_per_tres.split(":")[2])
        return None

    def get_resource_layout_per_node(self) -> dict:
        return {name: {"cpu_ids": "", "gres": {}, "memory": mem} for name, mem in self._r.memory_allocated.items()}


class FakeNode:
    """pyslurm.Node over a real `scontrol show nodes --json` record (node.pyx property names)."""

    def __init__(self, rec: dict) -> None:
        self._n = rec

    name = property(lambda self: self._n["name"])
    state = property(lambda self: "+".join(self._n["state"]))          # slurm_node_state_string_complete
    configured_gres = property(lambda self: to_gres_dict(self._n["gres"]))
    # 25.11: gres_from_tres_dict(allocated_tres), the gres/ entries of alloc_tres_fmt_str, which
    # lack gres/gpu unless the site accounts GPUs (AccountingStorageTRES); the captures' do not.
    allocated_gres = property(lambda self: {k.removeprefix("gres/"): v for k, v in (
        item.split("=", 1) for item in (self._n.get("tres_used") or "").split(",") if "=" in item)
        if k.startswith("gres/")})
    total_cpus = property(lambda self: self._n["cpus"])
    effective_cpus = property(lambda self: self._n.get("effective_cpus"))
    allocated_cpus = property(lambda self: self._n["alloc_cpus"])
    real_memory = property(lambda self: self._n["real_memory"])
    allocated_memory = property(lambda self: self._n["alloc_memory"])
    partitions = property(lambda self: list(self._n.get("partitions") or ()))
    reason = property(lambda self: self._n.get("reason") or None)
    # _raw_time(info.slurmd_start_time): epoch seconds, None for 0
    slurmd_start_time = property(lambda self: (self._n.get("slurmd_start_time") or {}).get("number") or None)


class FakeMap(dict):
    """pyslurm.xcollections.MultiClusterMap: {cluster: {key: obj}}, values() flattens."""

    def values(self):  # noqa: D401 - mimics MultiClusterMap.values()
        return [v for per_cluster in dict.values(self) for v in per_cluster.values()]


class FakeSlurmctld:
    """The jobs and nodes of one real capture, and Slurm's answers to the RPCs pyslurm sends."""

    def __init__(self, squeue_doc: dict, nodes_doc: dict | None = None) -> None:
        self.version = SlurmVersion.from_meta(squeue_doc["meta"])
        self.jobs = {rec["job_id"]: raw_job_from_capture(rec) for rec in squeue_doc["jobs"]}
        self.nodes = list((nodes_doc or {}).get("nodes") or ())
        self.down = False
        self.ignore_memory_updates = False   # a Slurm that takes an update but drops a field
        self.rpcs: list[tuple] = []

    def _gpu(self, count: int | str) -> str:
        # slurmctld stores a TRES request in its own spelling (23.02+: 'gres/gpu', seen in the captures)
        return f"gres/gpu:{count}" if self.version >= SlurmVersion(23, 2) else f"gres:gpu:{count}"

    def check_up(self) -> None:
        if self.down:
            raise FakeRPCError(SLURMCTLD_COMMUNICATIONS_CONNECTION_ERROR)

    def job(self, job_id: int) -> RawJob:
        self.check_up()
        if job_id not in self.jobs:
            raise FakeRPCError(ESLURM_INVALID_JOB_ID)
        return self.jobs[job_id]

    def kill(self, job_id: int, signal: int) -> int:
        """slurm_kill_job: the errno (0 on success)."""
        self.rpcs.append(("kill", job_id, signal))
        if job_id not in self.jobs:
            return ESLURM_INVALID_JOB_ID
        raw = self.jobs[job_id]
        if raw.finished:
            return ESLURM_ALREADY_DONE if signal == 9 else ESLURM_INVALID_JOB_ID
        if signal == 9:
            raw.job_state = ["CANCELLED"]
        return 0

    def update(self, job_id: int, changes: dict) -> None:
        """slurm_update_job with the fields a resize, hold or release sets."""
        self.rpcs.append(("update", job_id, dict(changes)))
        raw = self.job(job_id)
        if raw.finished:
            raise FakeRPCError(ESLURM_JOB_FINISHED)
        if "priority" in changes:
            if changes["priority"] == 0:
                if raw.base != "PENDING":
                    raise FakeRPCError(ESLURM_JOB_NOT_PENDING)
                raw.priority, raw.state_reason, raw.state_desc = 0, "JobHeldAdmin", None
            else:
                raw.priority, raw.state_reason, raw.state_desc = 1, "None", None
        tres = {k: v for k, v in changes.items() if k in ("tres_per_node", "cpus_per_tres", "mem_per_tres", "num_nodes")}
        if tres and raw.base != "PENDING":
            raise FakeRPCError(ESLURM_JOB_NOT_PENDING)
        if "tres_per_node" in changes:
            raw.tres_per_node = self._gpu(changes["tres_per_node"].rsplit(":", 1)[1])
        if "cpus_per_tres" in changes:
            raw.cpus_per_tres = self._gpu(changes["cpus_per_tres"].rsplit(":", 1)[1])
        if "mem_per_tres" in changes and not self.ignore_memory_updates:
            mem = changes["mem_per_tres"].rsplit(":", 1)[1]
            raw.mem_per_tres = self._gpu(mem)
            if self.version >= SlurmVersion(23, 2):
                raw.pn_min_memory = int(mem)   # what 23.02+ report for a --mem-per-gpu job (the captures)
        if "num_nodes" in changes:
            raw.num_nodes = int(changes["num_nodes"])

    def requeue(self, job_id: int, hold: bool) -> None:
        self.rpcs.append(("requeue", job_id, hold))
        raw = self.job(job_id)
        if raw.base == "PENDING":
            raise FakeRPCError(ESLURM_JOB_PENDING)
        raw.job_state, raw.nodes, raw.memory_allocated = ["PENDING"], None, {}
        raw.restart_cnt += 1
        if hold:  # job_mgr.c: WAIT_HELD_USER with this description
            raw.priority, raw.state_reason, raw.state_desc = 0, "JobHeldUser", "job requeued in held state"

    def squeue_format(self, job_ids: list[int]) -> str:
        """`squeue --noheader --states=all --jobs=.. -O JobID:|,cpus-per-tres:|,mem-per-tres:|` as 22.05-26.05 print it."""
        return "".join(f"{j}|{self.jobs[j].cpus_per_tres or 'N/A'}|{self.jobs[j].mem_per_tres or 'N/A'}|\n"
                       for j in sorted(job_ids, reverse=True) if j in self.jobs)


class FakeJobSubmitDescription:
    """pyslurm.JobSubmitDescription: attributes now, the C description only when built."""

    broken_memory_per_gpu = False   # set per module (pyslurm < 25.11.1)

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)
        self.ptr: dict | None = None

    def _create_job_submit_desc(self, is_update: bool = False) -> None:
        ptr: dict[str, Any] = {}
        gres = self.__dict__.get("gres_per_node")
        if isinstance(gres, dict):  # cstr.from_gres_dict
            ptr["tres_per_node"] = ",".join(f"gres:{k}:{int(v)}" for k, v in gres.items())
        if self.__dict__.get("cpus_per_gpu") is not None:
            ptr["cpus_per_tres"] = f"gres:gpu:{int(self.cpus_per_gpu)}"
        if self.__dict__.get("priority") is not None:
            ptr["priority"] = self.priority
        if self.__dict__.get("memory_per_gpu"):
            if self.broken_memory_per_gpu:
                raise NameError("name 'val' is not defined")
            ptr["mem_per_tres"] = f"gres:gpu:{int(self.memory_per_gpu)}"
        self.ptr = ptr


class FakePyslurm:
    """The pyslurm module: Nodes, Jobs, Job, JobSubmitDescription, RPCError, __version__."""

    def __init__(self, ctld: FakeSlurmctld, version: str = "25.11.2") -> None:
        self.__version__ = version
        self.ctld = ctld
        self.RPCError = FakeRPCError
        broken = SlurmVersion.parse(version) < SlurmVersion(25, 11, 1)
        self.JobSubmitDescription = type("JobSubmitDescription", (FakeJobSubmitDescription,),
                                         {"broken_memory_per_gpu": broken})
        module = self

        class Nodes:
            @staticmethod
            def load():
                ctld.check_up()
                return FakeMap({"elastic": {n["name"]: FakeNode(n) for n in ctld.nodes}})

        class Jobs:
            @staticmethod
            def load():
                ctld.check_up()
                return FakeMap({"elastic": {j: FakeJob(copy.copy(r)) for j, r in ctld.jobs.items()}})

        class Job:
            def __init__(self, job_id: int) -> None:
                self.id = int(job_id)

            @staticmethod
            def load(job_id: int) -> FakeJob:
                return FakeJob(copy.copy(ctld.job(int(job_id))))

            def send_signal(self, signal: int | str, steps: str = "children", hurry: bool = False) -> None:
                sig = signal if isinstance(signal, int) else {"SIGKILL": 9, "SIGUSR2": 12, "SIGUSR1": 10}[signal]
                errno = ctld.kill(self.id, sig)
                if errno == ESLURM_ALREADY_DONE or (errno == ESLURM_INVALID_JOB_ID and sig == 9):
                    return  # job.pyx ignores these on purpose
                if errno:
                    raise FakeRPCError(errno)

            def cancel(self) -> None:
                self.send_signal(9)

            def modify(self, changes: FakeJobSubmitDescription) -> None:
                changes._create_job_submit_desc(is_update=True)
                ctld.update(self.id, changes.ptr or {})

            def hold(self, mode: str | None = None) -> None:
                self.modify(module.JobSubmitDescription(priority=0))

            def release(self) -> None:
                self.modify(module.JobSubmitDescription(priority=INFINITE))

            def requeue(self, hold: bool = False) -> None:
                ctld.requeue(self.id, hold)

        self.Nodes, self.Jobs, self.Job = Nodes, Jobs, Job


class FakeCli:
    """The CLI backend the pyslurm backend leans on, answering from the same FakeSlurmctld.

    `scontrol --version` is the capture's Slurm; `scontrol update JobId=J NumNodes=..` (and the
    roll-back's TresPerNode/CpusPerTres/MemPerTres) change the job; `squeue -O` prints its TRES.
    """

    def __init__(self, ctld: FakeSlurmctld, *, fail_numnodes: str | None = None) -> None:
        self.ctld = ctld
        self.runs: list[list[str]] = []
        self.fail_numnodes = fail_numnodes
        self.version = ctld.version

    def _run(self, argv, **kwargs) -> str:
        from slurm_elastic.cluster.cli_backend import classify
        argv = [str(a) for a in argv]
        self.runs.append(argv)
        if argv[:2] == ["scontrol", "update"]:
            fields = dict(a.split("=", 1) for a in argv[2:])
            job_id = int(fields.pop("JobId"))
            if self.fail_numnodes and "NumNodes" in fields and "TresPerNode" not in fields:
                raise classify(self.fail_numnodes, tuple(argv), 1)
            changes: dict[str, Any] = {}
            if "NumNodes" in fields:
                changes["num_nodes"] = int(fields["NumNodes"].split("-")[0])
            fields.pop("NumTasks", None)   # the node count's companion (cli_backend.node_count_fields)
            for key, name in (("TresPerNode", "tres_per_node"), ("CpusPerTres", "cpus_per_tres"),
                              ("MemPerTres", "mem_per_tres")):
                if key in fields:
                    changes[name] = fields[key]
            try:
                self.ctld.update(job_id, changes)
            except FakeRPCError as exc:
                raise classify(f"{exc} for job {job_id}", tuple(argv), 1) from None
            return ""
        if argv[0] == "squeue" and "-O" in argv:
            ids = [int(x) for x in next(a for a in argv if a.startswith("--jobs=")).split("=", 1)[1].split(",")]
            if not any(j in self.ctld.jobs for j in ids):  # squeue skips unknown ids unless all are (seen live)
                raise classify("slurm_load_jobs error: Invalid job id specified", tuple(argv), 1)
            return self.ctld.squeue_format(ids)
        raise AssertionError(f"unexpected command {argv}")

    def submit(self, description) -> int:
        raise AssertionError("not used")
