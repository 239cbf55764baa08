"""The immutable picture of a Slurm cluster: nodes, jobs and one snapshot of both."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from slurm_elastic.spec import ElasticSpec


@dataclass(frozen=True, slots=True)
class Resources:
    """A vector over the resources the allocator reasons about."""

    gpus: int = 0
    cpus: int = 0
    mem_mb: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(self.gpus + other.gpus, self.cpus + other.cpus, self.mem_mb + other.mem_mb)

    def __sub__(self, other: Resources) -> Resources:
        return Resources(self.gpus - other.gpus, self.cpus - other.cpus, self.mem_mb - other.mem_mb)

    def clamp(self) -> Resources:
        """No negative capacity (Slurm may over-report use on a node in transition)."""
        return Resources(max(self.gpus, 0), max(self.cpus, 0), max(self.mem_mb, 0))


class NodeState(enum.Enum):
    """Slurm's base node state."""

    IDLE = "idle"
    MIXED = "mixed"
    ALLOCATED = "allocated"
    COMPLETING = "completing"
    DOWN = "down"
    ERROR = "error"
    FUTURE = "future"
    UNKNOWN = "unknown"


class NodeFlag(enum.Enum):
    """State flags that change whether a node can take elastic work."""

    DRAIN = "drain"            # DRAIN set; draining while jobs still run, drained once empty
    NOT_RESPONDING = "not_responding"
    FAIL = "fail"
    POWERED_DOWN = "powered_down"
    POWERING_DOWN = "powering_down"
    POWERING_UP = "powering_up"
    MAINTENANCE = "maintenance"
    RESERVED = "reserved"
    REBOOT = "reboot"
    COMPLETING = "completing"


# Flags that make a node give nothing to the allocator.
UNAVAILABLE_FLAGS = frozenset({
    NodeFlag.DRAIN, NodeFlag.NOT_RESPONDING, NodeFlag.FAIL, NodeFlag.POWERED_DOWN,
    NodeFlag.POWERING_DOWN, NodeFlag.MAINTENANCE, NodeFlag.REBOOT,
})


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    state: NodeState
    flags: frozenset[NodeFlag] = frozenset()
    cpus: int = 0
    cpus_alloc: int = 0
    mem_mb: int = 0
    mem_alloc_mb: int = 0
    gpus: int = 0
    gpus_alloc: int = 0
    partitions: tuple[str, ...] = ()
    reason: str = ""
    slurmd_started_at: float | None = None   # when its slurmd last started (Slurm's clock); None: not said

    @property
    def available(self) -> bool:
        """Up and schedulable: the only nodes that give capacity to elastic work."""
        if self.state in (NodeState.DOWN, NodeState.ERROR, NodeState.FUTURE, NodeState.UNKNOWN):
            return False
        return not (self.flags & UNAVAILABLE_FLAGS)

    @property
    def drained(self) -> bool:
        return NodeFlag.DRAIN in self.flags and self.state is NodeState.IDLE

    @property
    def draining(self) -> bool:
        return NodeFlag.DRAIN in self.flags and self.state in (NodeState.MIXED, NodeState.ALLOCATED,
                                                               NodeState.COMPLETING)

    @property
    def total(self) -> Resources:
        return Resources(self.gpus, self.cpus, self.mem_mb)

    @property
    def allocated(self) -> Resources:
        return Resources(self.gpus_alloc, self.cpus_alloc, self.mem_alloc_mb)

    @property
    def free(self) -> Resources:
        return (self.total - self.allocated).clamp() if self.available else Resources()


class JobState(enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    RESIZING = "RESIZING"
    UNKNOWN = "UNKNOWN"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def active(self) -> bool:
        """Holding (or about to hold) resources."""
        return self in (JobState.RUNNING, JobState.COMPLETING, JobState.SUSPENDED, JobState.RESIZING)


_FINISHED = frozenset({
    JobState.COMPLETED, JobState.CANCELLED, JobState.FAILED, JobState.TIMEOUT, JobState.NODE_FAIL,
    JobState.PREEMPTED, JobState.BOOT_FAIL, JobState.DEADLINE, JobState.OUT_OF_MEMORY,
})


@dataclass(frozen=True, slots=True)
class Job:
    """One Slurm job as the controller sees it.

    `gpus_per_node`, `cpus_per_node` and `mem_per_node_mb` describe what it
    holds on each of `nodes` while it runs, or what it asks for while pending.
    """

    job_id: int
    user: str
    name: str
    state: JobState
    reason: str = ""
    nodes: tuple[str, ...] = ()
    num_nodes: int = 1
    gpus_per_node: int = 0
    batch_host: str = ""               # the node its batch script runs on ("": not running, or unread)
    cpus_per_node: int = 0
    mem_per_node_mb: int = 0
    cpus_per_gpu: int | None = None
    mem_per_gpu_mb: int | None = None
    restarts: int = 0
    requeue: bool = False
    held: bool = False
    partition: str = ""
    reservation: str = ""              # the advance reservation it runs in or waits for ("": none)
    required_nodes: tuple[str, ...] = ()  # ReqNodeList: it starts only with all of these (the plan's placement)
    excluded_nodes: tuple[str, ...] = ()  # ExcNodeList: it never starts on these (its user's, lost nodes)
    constraint: str = ""               # --constraint (node features): not modelled, so no plan names its nodes
    comment: str = ""
    user_id: int | None = None
    priority: int | None = None        # Slurm's priority (higher starts first); None where unread
    time_limit_s: float | None = None  # None: unlimited (or unread)
    submit_time: float | None = None
    start_time: float | None = None
    end_time: float | None = None      # when a finished job ended (Slurm's expected end is not kept)
    exit_signal: int | None = None     # the signal that ended its batch script; None when it exited
    spec: ElasticSpec | None = None
    spec_error: str | None = None  # the comment claims elasticity but does not parse

    @property
    def elastic(self) -> bool:
        return self.spec is not None

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def first_node(self) -> str | None:
        """The node Slurm cannot take from it while it runs: its batch host (else its first node)."""
        if self.batch_host and self.batch_host in self.nodes:
            return self.batch_host
        return self.nodes[0] if self.nodes else None

    @property
    def uses_per_node(self) -> Resources:
        return Resources(self.gpus_per_node, self.cpus_per_node, self.mem_per_node_mb)

    @property
    def expected_end(self) -> float:
        """When a running job will have ended at the latest (its time limit; inf when it has none)."""
        if self.start_time is None or self.time_limit_s is None:
            return float("inf")
        return self.start_time + self.time_limit_s


def queue_order(job: Job) -> tuple[int, int]:
    """Slurm's order of pending jobs: higher priority first, then the earlier job id."""
    return (-(job.priority or 0), job.job_id)


@dataclass(frozen=True, slots=True)
class ClusterState:
    """One consistent-enough observation of the cluster (taken at `taken_at`, epoch seconds)."""

    nodes: tuple[Node, ...]
    jobs: tuple[Job, ...]
    taken_at: float
    slurm_version: str = ""
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def job(self, job_id: int) -> Job:
        for j in self.jobs:
            if j.job_id == job_id:
                return j
        raise KeyError(job_id)

    @property
    def elastic_jobs(self) -> tuple[Job, ...]:
        return tuple(j for j in self.jobs if j.spec is not None and not j.state.finished)
