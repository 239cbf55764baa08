"""The Backend protocol: every Slurm call the controller makes goes through one of these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from slurm_elastic.cluster.model import ClusterState
from slurm_elastic.cluster.shape import RequestShape


@dataclass(frozen=True, slots=True)
class SubmitDescription:
    """What to submit, in Slurm's nouns; the backend turns it into sbatch flags or an API call."""

    script: str                                # path of the batch script
    shape: RequestShape                        # GPUs per node 0: a job without GPUs (no --gres)
    comment: str = ""                          # the canonical ElasticSpec text for elastic jobs
    job_name: str | None = None
    requeue: bool = True
    hold: bool = False
    extra_args: tuple[str, ...] = ()           # other sbatch options, passed through unchanged
    script_args: tuple[str, ...] = ()
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """Slurm behind one interface (CLI, pyslurm, or the simulator)."""

    name: str

    def snapshot(self) -> ClusterState:
        """All nodes and jobs, in a constant number of Slurm calls."""
        ...

    def submit(self, description: SubmitDescription) -> int: ...

    def hold(self, job_id: int) -> None: ...

    def requeue_hold(self, job_id: int) -> None: ...

    def requeue(self, job_id: int) -> None:
        """Put a running or finished batch job back in the queue, not held (`scontrol requeue`)."""
        ...

    def set_resources(self, job_id: int, shape: RequestShape, *, start_now: bool = True,
                      nodes: tuple[str, ...] | None = None) -> None:
        """Change a pending (held) job's shape; `start_now` clears the requeue BeginTime delay; `nodes`
        (ReqNodeList) are where it must start, () clears them, None leaves them as they are."""
        ...

    def release(self, job_id: int) -> None: ...

    def signal(self, job_id: int, signal: str) -> None:
        """Send `signal` (e.g. 'USR2') to every step of the job, including the batch step."""
        ...

    def cancel(self, job_id: int) -> None: ...


@runtime_checkable
class PriorityKeepingBackend(Backend, Protocol):
    """A backend that can give a released job back the priority it had before the controller held it.

    Slurm recomputes a job's priority when it is released: priority/basic gives it the lowest of all
    (behind every job submitted since), multifactor an age counted from its requeue. A job the controller
    resized would then wait behind jobs that came after it, and the GPUs the plan freed for it go to them.
    """

    def set_priority(self, job_id: int, priority: int) -> None:
        """Set a pending job's priority (`scontrol update Priority=`: an operator's right)."""
        ...


@runtime_checkable
class NodeExcludingBackend(Backend, Protocol):
    """A backend that can act on a job's report of a lost node (control/peer_loss.py).

    Slurm itself may not notice a dead node for SlurmdTimeout (often 300 s); until then a requeued
    job that still holds the node stays COMPLETING, and a released one may be placed on it again.
    """

    def keep_nodes(self, job_id: int, nodes: tuple[str, ...]) -> None:
        """Shrink a running job to `nodes` (a subset of its own): it gives up the others at once."""
        ...

    def exclude_nodes(self, job_id: int, nodes: tuple[str, ...], *, readmit: tuple[str, ...] = ()) -> None:
        """Never place this (pending) job on `nodes` again (ExcNodeList, for this job only); the nodes in
        `readmit` leave its list (excluded before, they have come back)."""
        ...

    def drain(self, node: str, reason: str) -> None:
        """Drain a node with a reason (no new jobs; running ones go on)."""
        ...

    def resume(self, node: str) -> None:
        """End a drain this controller set (State=RESUME): the node takes new jobs again."""
        ...

    def kill_wait_s(self) -> float:
        """Slurm's KillWait: how long a step's srun waits for a node that does not answer."""
        ...

    def slurmd_timeout_s(self) -> float:
        """Slurm's SlurmdTimeout: how long a node may not answer before Slurm sets it DOWN."""
        ...
