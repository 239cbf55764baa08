"""FakeSlurm: an in-memory Backend that STANDS IN FOR SLURM in fast unit tests of plans, journal and protocol.

It models only what the protocol relies on (requeuehold/hold/update/release,
the ~120 s BeginTime after a requeue unless StartTime=now, node loss
requeueing jobs, first-fit start of released jobs, and a shim that writes its
ACK file on the signal). The live tests in tests/control/test_live_*.py prove
the same paths on a real Slurm.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from slurm_elastic.cluster.backend import SubmitDescription
from slurm_elastic.cluster.model import ClusterState, Job, JobState, Node, NodeFlag, NodeState
from slurm_elastic.errors import SlurmError, UnknownJob
from slurm_elastic.spec import ElasticSpec
from slurm_elastic.train import protocol as shim


class FakeSlurm:
    """Stands in for Slurm (see module docstring). `now` is a fake clock the test advances."""

    name = "fake"

    def __init__(self, nodes: int = 4, gpus_per_node: int = 4, *, ack: bool = True) -> None:
        self.now = 1_000_000.0
        self.nodes: dict[str, Node] = {
            f"n{i}": Node(name=f"n{i}", state=NodeState.IDLE, cpus=32, mem_mb=64000, gpus=gpus_per_node,
                          partitions=("gpu",))
            for i in range(1, nodes + 1)}
        self.jobs: dict[int, Job] = {}
        self.begin: dict[int, float] = {}
        self.ack = ack
        self.calls: list[tuple[str, int]] = []
        self.fail: dict[str, Callable[[int], bool]] = {}   # verb -> predicate(job_id): raise SlurmError
        self._next = 100

    # -- test set-up --------------------------------------------------------------------------
    def add_job(self, spec: ElasticSpec | None, *, nodes: int, gpus_per_node: int, user: str = "alice",
                run: bool = True, comment: str | None = None, spec_error: str | None = None) -> int:
        self._next += 1
        job_id = self._next
        text = comment if comment is not None else (spec.to_comment() if spec else "")
        job = Job(job_id=job_id, user=user, name=f"job{job_id}", state=JobState.PENDING, reason="Priority",
                  num_nodes=nodes, gpus_per_node=gpus_per_node, cpus_per_node=gpus_per_node,
                  mem_per_node_mb=gpus_per_node * 1024, cpus_per_gpu=1, mem_per_gpu_mb=1024,
                  requeue=True, comment=text, spec=spec, spec_error=spec_error, partition="gpu")
        self.jobs[job_id] = job
        if run:
            self.schedule()
        return job_id

    def node_down(self, name: str) -> None:
        self.nodes[name] = dataclasses.replace(self.nodes[name], state=NodeState.DOWN,
                                               flags=frozenset({NodeFlag.NOT_RESPONDING}))
        for job in list(self.jobs.values()):
            if job.state is JobState.RUNNING and name in job.nodes:
                self._requeue(job.job_id, held=False)
        self._recount()

    def node_up(self, name: str) -> None:
        self.nodes[name] = dataclasses.replace(self.nodes[name], state=NodeState.IDLE, flags=frozenset())
        self.schedule()

    def finish(self, job_id: int) -> None:
        self.jobs[job_id] = dataclasses.replace(self.jobs[job_id], state=JobState.COMPLETED, nodes=())
        self._recount()

    # -- the Backend protocol ------------------------------------------------------------------
    def snapshot(self) -> ClusterState:
        self.schedule()
        return ClusterState(nodes=tuple(self.nodes.values()), jobs=tuple(self.jobs.values()), taken_at=self.now,
                            slurm_version="fake")

    def submit(self, description: SubmitDescription) -> int:
        spec = ElasticSpec.from_comment(description.comment) if description.comment else None
        return self.add_job(spec, nodes=description.nodes, gpus_per_node=description.gpus_per_node,
                            run=not description.hold)

    def hold(self, job_id: int) -> None:
        job = self._job("hold", job_id)
        if job.state is not JobState.PENDING:
            raise SlurmError(f"scontrol hold: job {job_id} is not pending")
        self.jobs[job_id] = dataclasses.replace(job, held=True, reason="JobHeldAdmin")

    def requeue_hold(self, job_id: int) -> None:
        job = self._job("requeue_hold", job_id)
        if job.state is not JobState.RUNNING:
            raise SlurmError(f"scontrol requeuehold: job {job_id} is not running")
        self._requeue(job_id, held=True)

    def set_resources(self, job_id: int, *, nodes: int, gpus_per_node: int, cpus_per_gpu: int,
                      mem_per_gpu_mb: int, start_now: bool = True) -> None:
        job = self._job("set_resources", job_id)
        if job.state is not JobState.PENDING:
            raise SlurmError(f"scontrol update: job {job_id} is no longer pending")
        self.jobs[job_id] = dataclasses.replace(job, num_nodes=nodes, gpus_per_node=gpus_per_node,
                                                cpus_per_node=cpus_per_gpu * gpus_per_node,
                                                mem_per_node_mb=mem_per_gpu_mb * gpus_per_node)
        if start_now:
            self.begin[job_id] = self.now

    def release(self, job_id: int) -> None:
        job = self._job("release", job_id)
        if not job.held:
            raise SlurmError(f"scontrol release: job {job_id} is not held")
        self.jobs[job_id] = dataclasses.replace(job, held=False,
                                                reason="BeginTime" if self.begin.get(job_id, 0) > self.now
                                                else "Priority")
        self.schedule()

    def signal(self, job_id: int, signal: str) -> None:
        job = self._job("signal", job_id)
        if job.state is not JobState.RUNNING:
            raise SlurmError(f"scancel: job {job_id} is not running")
        if self.ack and job.spec is not None and job.spec.ckpt_dir:
            path = shim.ack_path(job.spec.ckpt_dir, shim.job_key(job_id), job_id, job.restarts)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").close()

    def cancel(self, job_id: int) -> None:
        job = self._job("cancel", job_id)
        self.jobs[job_id] = dataclasses.replace(job, state=JobState.CANCELLED, nodes=(), held=False)
        self._recount()

    # -- the fake scheduler --------------------------------------------------------------------
    def schedule(self) -> None:
        for job in sorted(self.jobs.values(), key=lambda j: j.job_id):
            if job.state is not JobState.PENDING or job.held or self.begin.get(job.job_id, 0) > self.now:
                continue
            free = {n.name: n.gpus - n.gpus_alloc for n in self.nodes.values() if n.available}
            chosen = [name for name, f in sorted(free.items()) if f >= job.gpus_per_node][:job.num_nodes]
            if len(chosen) == job.num_nodes:
                self.jobs[job.job_id] = dataclasses.replace(job, state=JobState.RUNNING, nodes=tuple(chosen),
                                                            reason="None", start_time=self.now)
                self._recount()
            elif job.reason != "BeginTime":
                self.jobs[job.job_id] = dataclasses.replace(job, reason="Resources")

    def _requeue(self, job_id: int, *, held: bool) -> None:
        job = self.jobs[job_id]
        self.jobs[job_id] = dataclasses.replace(job, state=JobState.PENDING, nodes=(), restarts=job.restarts + 1,
                                                held=held, reason="JobHeldAdmin" if held else "BeginTime")
        self.begin[job_id] = self.now + 120.0
        self._recount()

    def _recount(self) -> None:
        used: dict[str, int] = {n: 0 for n in self.nodes}
        for job in self.jobs.values():
            if job.state is JobState.RUNNING:
                for n in job.nodes:
                    used[n] += job.gpus_per_node
        for name, node in self.nodes.items():
            g = used[name]
            state = node.state if node.state is NodeState.DOWN else (
                NodeState.IDLE if g == 0 else NodeState.ALLOCATED if g >= node.gpus else NodeState.MIXED)
            self.nodes[name] = dataclasses.replace(node, gpus_alloc=g, cpus_alloc=g, mem_alloc_mb=g * 1024,
                                                   state=state)

    def _job(self, verb: str, job_id: int) -> Job:
        self.calls.append((verb, job_id))
        if job_id not in self.jobs:
            raise UnknownJob(f"{verb}: Invalid job id {job_id}")
        if verb in self.fail and self.fail[verb](job_id):
            raise SlurmError(f"{verb}: injected failure for job {job_id}")
        return self.jobs[job_id]
