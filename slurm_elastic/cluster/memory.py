"""An in-memory Slurm behind the Backend protocol, on an injected clock: the simulator's and the tests' cluster.

It models what the controller's requeue protocol meets on a live cluster
(each checked on 22.05-24.11, see docs/slurm-backends.md and DESIGN.md):

- `requeuehold` does not make a job pending at once: it passes through
  COMPLETING (still holding its nodes) for `completing_s`, and an update made
  meanwhile is silently dropped; when the requeue completes, BeginTime is set
  to now + 120 s (batch_requeue_fini), whatever StartTime was given before.
- an update of a pending job with StartTime=now clears that BeginTime;
- hold / update (pending only) / release, with Slurm's refusals; a running
  job shrunk to some of its nodes (never without its batch host) runs on;
- a node that fails requeues the jobs on it (NODE_FAIL with --requeue: not
  held, BeginTime + 120 s, restart count + 1); a node that returns takes work;
- a released, eligible job starts after `start_latency_s` (the scheduler's
  pass) on the first nodes (by name) of its partition that fit, as Slurm's
  main and backfill schedulers together do: in priority order (a job's
  `priority`, higher first; by default submission order, as
  priority/basic numbers jobs); the highest-priority job that cannot start
  gets a reservation (the nodes it will get and the earliest time it fits,
  from running jobs' time limits; never, if they have none); a lower job
  starts only if it does not delay that: it ends (by its time limit) before
  the reservation's time, or fits on nodes outside it;
- with `release_lowers_priority`, priority/basic's release: a released job
  gets the lowest priority of all (seen on 22.05.8). Off by default: the
  controller gives a released job its own priority back at once
  (`set_priority`), and what remains on a live Slurm, a scheduler pass
  between the two commands, this Slurm would overstate (it schedules at
  every call);
- the training shim's acknowledgement: a signalled job writes its ACK file
  beside its checkpoints, as the shim does after its checkpoint commits.

Time is `clock()` (default: a manual clock at `now`, which tests advance).
Nothing here sleeps: the simulator drives it on a virtual clock.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from slurm_elastic.cluster.backend import SubmitDescription
from slurm_elastic.cluster.backfill import Reservation, first_fit, free_now, reserve
from slurm_elastic.cluster.model import ClusterState, Job, JobState, Node, NodeFlag, NodeState, queue_order
from slurm_elastic.cluster.partitions import PartitionTimes
from slurm_elastic.cluster.reservations import AdvanceReservation, blocking
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.errors import SlurmError, UnknownJob
from slurm_elastic.spec import ElasticSpec
from slurm_elastic import jobfiles as shim

REQUEUE_BEGIN_DELAY_S = 120.0
"""Slurm's BeginTime after a requeue (unless an update sets StartTime=now)."""

FIRST_PRIORITY = 4294901759
"""priority/basic's first job's priority; each later submission gets one less (as squeue shows them)."""


class InMemorySlurm:
    """A Slurm cluster in memory (see the module docstring for what it models)."""

    name = "memory"

    def __init__(self, nodes: int = 4, gpus_per_node: int = 4, *, cpus_per_node: int = 32,
                 mem_per_node_mb: int = 64000, ack: bool = True, clock: Callable[[], float] | None = None,
                 completing_s: float = 0.0, start_latency_s: float = 0.0, node_prefix: str = "n",
                 release_lowers_priority: bool = False) -> None:
        self._manual_now = 1_000_000.0
        self.release_lowers_priority = release_lowers_priority
        self._clock = clock
        self.nodes: dict[str, Node] = {
            f"{node_prefix}{i}": Node(name=f"{node_prefix}{i}", state=NodeState.IDLE, cpus=cpus_per_node,
                                      mem_mb=mem_per_node_mb, gpus=gpus_per_node, partitions=("gpu",))
            for i in range(1, nodes + 1)}
        self.jobs: dict[int, Job] = {}
        # partition -> (DefaultTime, MaxTime) in seconds (None: none / unlimited); "gpu" is the default partition
        self.partition_limits: dict[str, tuple[int | None, int | None]] = {}
        self.begin: dict[int, float] = {}          # job id -> earliest start (BeginTime)
        self.eligible_since: dict[int, float] = {}  # job id -> when it became startable (start latency)
        self.completing_until: dict[int, float] = {}
        self.ack = ack
        self.completing_s = completing_s
        self.start_latency_s = start_latency_s
        self.calls: list[tuple[str, int]] = []
        self.fail: dict[str, Callable[[int], bool]] = {}   # verb -> predicate(job_id): raise SlurmError
        self.on_start: Callable[[Job], None] | None = None  # the simulator's hook: a job began running
        self.on_stop: Callable[[Job, str], None] | None = None  # (job, why: requeue | node-fail | finish | cancel)
        self._next = 100
        self.reservation: Reservation | None = None  # the last scheduling pass's, for tests and the simulator
        self.advance_reservations: list[AdvanceReservation] = []   # an admin's (scontrol create reservation)

    # -- time ----------------------------------------------------------------------------------
    @property
    def now(self) -> float:
        return self._clock() if self._clock is not None else self._manual_now

    @now.setter
    def now(self, value: float) -> None:
        if self._clock is not None:
            raise AttributeError("this InMemorySlurm runs on an injected clock; advance that clock instead")
        self._manual_now = float(value)

    # -- set-up and the world outside Slurm --------------------------------------------------
    def add_node(self, name: str, *, gpus: int, cpus: int, mem_mb: int,
                 partitions: tuple[str, ...] = ("gpu",)) -> None:
        self.nodes[name] = Node(name=name, state=NodeState.IDLE, cpus=cpus, mem_mb=mem_mb, gpus=gpus,
                                partitions=partitions)

    def add_job(self, spec: ElasticSpec | None, *, nodes: int, gpus_per_node: int, user: str = "alice",
                run: bool = True, comment: str | None = None, spec_error: str | None = None,
                name: str | None = None, held: bool = False, priority: int | None = None,
                time_limit_s: float | None = None, partition: str = "gpu", cpus_per_gpu: int | None = None,
                mem_per_gpu_mb: int | None = None, reservation: str = "") -> int:
        """Submit a job (`spec` None: a rigid job); `priority` None takes priority/basic's submission order."""
        self._next += 1
        job_id = self._next
        text = comment if comment is not None else (spec.to_comment() if spec else "")
        cpg = cpus_per_gpu if cpus_per_gpu is not None else (spec.cpus_per_gpu if spec else 1)
        mpg = mem_per_gpu_mb if mem_per_gpu_mb is not None else (spec.mem_per_gpu_mb if spec else 1024)
        if priority is None:
            priority = FIRST_PRIORITY - (job_id - 101)
        job = Job(job_id=job_id, user=user, name=name or f"job{job_id}", state=JobState.PENDING,
                  reason="JobHeldUser" if held else "Priority", num_nodes=nodes, gpus_per_node=gpus_per_node,
                  cpus_per_node=cpg * gpus_per_node, mem_per_node_mb=mpg * gpus_per_node, cpus_per_gpu=cpg,
                  mem_per_gpu_mb=mpg, requeue=True, comment=text, spec=spec, spec_error=spec_error,
                  partition=partition, held=held, submit_time=self.now, priority=priority,
                  time_limit_s=time_limit_s, reservation=reservation)
        self.jobs[job_id] = job
        if run:
            self.schedule()
        return job_id

    def node_down(self, name: str) -> None:
        """The node stops responding: Slurm marks it DOWN and requeues the jobs on it (NODE_FAIL, --requeue)."""
        self.nodes[name] = dataclasses.replace(self.nodes[name], state=NodeState.DOWN,
                                               flags=frozenset({NodeFlag.NOT_RESPONDING}))
        for job in list(self.jobs.values()):
            if job.state.active and name in job.nodes:
                self._stopped(job, "node-fail")
                self._to_pending(job.job_id, held=job.held, restarted=job.state is JobState.RUNNING)
        self._recount()

    def node_up(self, name: str) -> None:
        """The node's slurmd starts (again): it serves, whether or not Slurm had noticed it was gone."""
        self.nodes[name] = dataclasses.replace(self.nodes[name], state=NodeState.IDLE, flags=frozenset(),
                                               slurmd_started_at=self.now)
        self._recount()
        self.schedule()

    def finish(self, job_id: int, state: JobState = JobState.COMPLETED, *, signal: int | None = None) -> None:
        """The job's batch script ended (the training finished, or failed; `signal`: killed by it)."""
        job = self.jobs[job_id]
        if job.state is JobState.RUNNING:
            self._stopped(job, "finish")
        self.jobs[job_id] = dataclasses.replace(job, state=state, nodes=(), held=False, end_time=self.now,
                                                exit_signal=signal)
        self._recount()
        self.schedule()

    # -- the Backend protocol ------------------------------------------------------------------
    def snapshot(self) -> ClusterState:
        self.schedule()
        return ClusterState(nodes=tuple(self.nodes.values()), jobs=tuple(self.jobs.values()), taken_at=self.now,
                            slurm_version="memory")

    def reservations(self) -> tuple[AdvanceReservation, ...]:
        return tuple(self.advance_reservations)

    def partition_times(self) -> tuple[PartitionTimes, ...]:
        names = dict.fromkeys(p for n in self.nodes.values() for p in n.partitions) | dict.fromkeys(self.partition_limits)
        return tuple(PartitionTimes(name, *self.partition_limits.get(name, (None, None)), is_default=name == "gpu")
                     for name in names)

    def submit(self, description: SubmitDescription) -> int:
        spec = ElasticSpec.from_comment(description.comment) if description.comment else None
        return self.add_job(spec, nodes=description.shape.nodes, gpus_per_node=description.shape.gpus_per_node,
                            run=not description.hold, held=description.hold, name=description.job_name)

    def hold(self, job_id: int) -> None:
        job = self._job("hold", job_id)
        if job.state is JobState.RUNNING:
            # Slurm takes it (priority 0, seen live on 22.05): the job runs on and carries the hold into its
            # next requeue, where it waits for a release
            self.jobs[job_id] = dataclasses.replace(job, held=True)
            return
        if job.state is not JobState.PENDING:
            raise SlurmError(f"scontrol hold: job {job_id} is not pending")
        self.jobs[job_id] = dataclasses.replace(job, held=True, reason="JobHeldAdmin")

    def requeue_hold(self, job_id: int) -> None:
        job = self._job("requeue_hold", job_id)
        if job.state is not JobState.RUNNING:
            raise SlurmError(f"scontrol requeuehold: job {job_id} is not running")
        self._stopped(job, "requeue")
        # The batch step is being killed: COMPLETING on its nodes until the requeue is done.
        self.jobs[job_id] = dataclasses.replace(job, state=JobState.COMPLETING, held=True, reason="JobHeldAdmin",
                                                restarts=job.restarts + 1)
        self.completing_until[job_id] = self.now + self.completing_s
        self._settle_completing()

    def requeue(self, job_id: int) -> None:
        job = self._job("requeue", job_id)
        if job.state.finished:
            self.jobs[job_id] = dataclasses.replace(job, end_time=None, exit_signal=None)
            self._to_pending(job_id, held=False, restarted=True)
            return
        if job.state is not JobState.RUNNING:
            raise SlurmError(f"scontrol requeue: job {job_id} is neither running nor finished")
        self._stopped(job, "requeue")
        self.jobs[job_id] = dataclasses.replace(job, state=JobState.COMPLETING, restarts=job.restarts + 1)
        self.completing_until[job_id] = self.now + self.completing_s
        self._settle_completing()

    def keep_nodes(self, job_id: int, nodes: tuple[str, ...]) -> None:
        """A running job gives up its other nodes and runs on (`scontrol update NodeList=`); Slurm refuses
        to take its batch host (its first node) or to add a node."""
        job = self._job("keep_nodes", job_id)
        if job.state is not JobState.RUNNING:
            raise SlurmError(f"scontrol update: job {job_id} is not running")
        if not set(nodes) < set(job.nodes) or job.first_node not in nodes:
            raise SlurmError(f"scontrol update: Invalid node name specified for job {job_id}")
        kept = tuple(n for n in job.nodes if n in nodes)
        self.jobs[job_id] = dataclasses.replace(job, nodes=kept, num_nodes=len(kept))
        self._recount()

    def set_resources(self, job_id: int, shape: RequestShape, *, start_now: bool = True,
                      nodes: tuple[str, ...] | None = None) -> None:
        job = self._job("set_resources", job_id)
        if job.state is JobState.COMPLETING:
            return  # Slurm 22.05 accepts it and drops it: the protocol must check (see RequeueProtocol._resize)
        if job.state is not JobState.PENDING:
            raise SlurmError(f"scontrol update: job {job_id} is no longer pending")
        self.jobs[job_id] = dataclasses.replace(job, num_nodes=shape.nodes, gpus_per_node=shape.gpus_per_node,
                                                cpus_per_gpu=shape.cpus_per_gpu, mem_per_gpu_mb=shape.mem_per_gpu_mb,
                                                cpus_per_node=shape.cpus_per_gpu * shape.gpus_per_node,
                                                mem_per_node_mb=shape.mem_per_gpu_mb * shape.gpus_per_node,
                                                required_nodes=job.required_nodes if nodes is None else tuple(nodes))
        if start_now:
            self.begin[job_id] = self.now

    def release(self, job_id: int) -> None:
        job = self._job("release", job_id)
        if job.state is JobState.RUNNING:
            # Slurm takes it: it clears a hold the job would carry into its next requeue
            self.jobs[job_id] = dataclasses.replace(job, held=False)
            return
        if not job.held:
            raise SlurmError(f"scontrol release: job {job_id} is not held")
        waiting = self.begin.get(job_id, 0) > self.now
        priority = job.priority
        if self.release_lowers_priority:
            priority = min((j.priority for j in self.jobs.values() if j.priority), default=FIRST_PRIORITY) - 1
        self.jobs[job_id] = dataclasses.replace(job, held=False, priority=priority,
                                                reason="BeginTime" if waiting else "Priority")
        self.schedule()

    def set_priority(self, job_id: int, priority: int) -> None:
        job = self._job("set_priority", job_id)
        if job.state.finished:
            raise SlurmError(f"scontrol update: job {job_id} has ended")
        self.jobs[job_id] = dataclasses.replace(job, priority=int(priority))
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
        if job.state is JobState.RUNNING:
            self._stopped(job, "cancel")
        self.jobs[job_id] = dataclasses.replace(job, state=JobState.CANCELLED, nodes=(), held=False)
        self._recount()

    # -- the scheduler ---------------------------------------------------------------------------
    def schedule(self) -> None:
        """Finish requeues whose COMPLETING is over, then start eligible jobs by priority, with backfill."""
        self._settle_completing()
        now = self.now
        self.reservation = None
        eligible = []
        for job in self.jobs.values():
            if job.state is not JobState.PENDING or job.held or self.begin.get(job.job_id, 0) > now:
                self.eligible_since.pop(job.job_id, None)
                continue
            since = self.eligible_since.setdefault(job.job_id, now)
            if now - since >= self.start_latency_s:
                eligible.append(job)
        windows = {r.name: r for r in self.advance_reservations}
        for job in sorted(eligible, key=queue_order):
            window = windows.get(job.reservation) if job.reservation else None
            if job.reservation and (window is None or not window.active):
                # Slurm starts a job in a reservation only inside its window: after it, never
                self.jobs[job.job_id] = dataclasses.replace(job, reason="Reservation")
                continue
            # Backfill: a later job may not delay the reserved one.
            held_back = self.reservation.holds_back(job, now) if self.reservation is not None else frozenset()
            # an active reservation's nodes are its jobs' alone, and its jobs run nowhere else; a job outside
            # a reservation starts on its nodes only if its time limit ends before the window opens
            held_back |= frozenset(blocking(windows, job.reservation, now, job.time_limit_s, slack_s=0.0))
            if window is not None:
                held_back |= frozenset(self.nodes) - frozenset(window.nodes)
            chosen = self._fit(job, held_back)
            if chosen is not None:
                started = dataclasses.replace(job, state=JobState.RUNNING, nodes=tuple(chosen), reason="None",
                                              start_time=now)
                self.jobs[job.job_id] = started
                self.eligible_since.pop(job.job_id, None)
                self._recount()
                if self.on_start is not None:
                    self.on_start(started)
                continue
            if self.reservation is None:
                self.reservation = self._reserve(job)
            if job.reason != "BeginTime":
                reason = "Resources" if self.reservation.job_id == job.job_id else "Priority"
                self.jobs[job.job_id] = dataclasses.replace(job, reason=reason)

    def next_event_s(self) -> float | None:
        """When something changes by itself (a requeue completes, BeginTime passes, a start latency ends)."""
        times = list(self.completing_until.values())
        for job in self.jobs.values():
            if job.state is JobState.PENDING and not job.held:
                begin = self.begin.get(job.job_id, 0.0)
                times.append(max(begin, self.eligible_since.get(job.job_id, begin) + self.start_latency_s))
        later = [t for t in times if t > self.now]
        return min(later) if later else None

    def _fit(self, job: Job, held_back: frozenset[str] = frozenset()) -> list[str] | None:
        """Where `job` starts now, outside `held_back` (a seam: a test's Slurm honours ExcNodeList here)."""
        return first_fit(job, free_now(self.nodes.values()), held_back)

    def _reserve(self, job: Job) -> Reservation:
        ending = [(self.completing_until.get(j.job_id, j.expected_end) if j.state is JobState.COMPLETING
                   else j.expected_end, j) for j in self.jobs.values() if j.state.active]
        return reserve(job, free_now(self.nodes.values()), ending)

    def _settle_completing(self) -> None:
        for job_id, until in list(self.completing_until.items()):
            if until <= self.now:
                del self.completing_until[job_id]
                job = self.jobs[job_id]
                if job.state is JobState.COMPLETING:
                    self._to_pending(job_id, held=job.held, restarted=False)
        self._recount()

    def _to_pending(self, job_id: int, *, held: bool, restarted: bool) -> None:
        """The requeue is complete: pending again, BeginTime = now + 120 s (batch_requeue_fini)."""
        job = self.jobs[job_id]
        self.jobs[job_id] = dataclasses.replace(job, state=JobState.PENDING, nodes=(),
                                                restarts=job.restarts + (1 if restarted else 0), held=held,
                                                reason="JobHeldAdmin" if held else "BeginTime", start_time=None)
        self.begin[job_id] = self.now + REQUEUE_BEGIN_DELAY_S

    def _stopped(self, job: Job, why: str) -> None:
        if self.on_stop is not None:
            self.on_stop(job, why)

    def _recount(self) -> None:
        used: dict[str, tuple[int, int, int]] = {n: (0, 0, 0) for n in self.nodes}
        for job in self.jobs.values():
            if job.state.active:
                for n in job.nodes:
                    g, c, m = used[n]
                    used[n] = (g + job.gpus_per_node, c + job.cpus_per_node, m + job.mem_per_node_mb)
        for name, node in self.nodes.items():
            g, c, m = used[name]
            state = node.state if node.state is NodeState.DOWN else (
                NodeState.IDLE if g == 0 and c == 0 else
                NodeState.ALLOCATED if g >= node.gpus and node.gpus else NodeState.MIXED)
            self.nodes[name] = dataclasses.replace(node, gpus_alloc=g, cpus_alloc=c, mem_alloc_mb=m, state=state)

    def _job(self, verb: str, job_id: int) -> Job:
        self.calls.append((verb, job_id))
        if job_id not in self.jobs:
            raise UnknownJob(f"{verb}: Invalid job id {job_id}")
        if verb in self.fail and self.fail[verb](job_id):
            raise SlurmError(f"{verb}: injected failure for job {job_id}")
        self._settle_completing()
        return self.jobs[job_id]
