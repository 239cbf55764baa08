"""The shipped controller as the simulator's policy: the real Reconciler over the in-memory Slurm, on virtual time.

At every scheduling point the engine's view is mirrored into an
`InMemorySlurm` (nodes that failed or came back, arrivals submitted as the
wrapper submits them, finished jobs ended), each running job's "shim" appends
the row the training shim writes to its `metrics.jsonl` (step, declared total,
GPUs, nodes, steps/s at its placement), and one `Reconciler.cycle()` runs:
the default request source reads those files (sim/shim.py writes them: for
Pollux jobs also the batch and gradient noise; an adaptive job also its
`batch.json`), the allocator solves, the
requeue protocol signals, holds, updates and releases, the journal records
every step, and hysteresis and the restart budget apply. Each running job
says its ranks go on in their processes (keeps-ranks-J-R, the templates'
default), so a shrink to some of its own nodes is made in place as on a live
cluster (Decision.in_place: the engine charges its in-place stall, not the
restart overhead). Whatever
Slurm then runs is the placement handed back to the engine. Nothing sleeps: the
protocol's waits advance the virtual clock.

Rigid jobs (a fixed size: min = max GPUs) are plain Slurm jobs the
controller does not own, submitted at their size with their run time as
the time limit; the in-memory Slurm starts them by priority with backfill,
and the controller sees them pending beside its elastic jobs.

The controller's settings are the shipped defaults (ControllerConfig()),
except the solver's limits: work only (the policy's branch-and-bound node
limit), one thread and no wall-clock cap, so two runs of a trace give the
same answer at every scheduling point whatever else the machine is doing.
"""

from __future__ import annotations

import getpass
import logging
import math
import os
import tempfile
import time
from typing import Callable

from slurm_elastic.allocate.problem import Policy
from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.model import JobState
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.plan import Plan
from slurm_elastic.control.reconcile import Allocator, ControllerConfig, Reconciler
from slurm_elastic.control.requests import RequestSource
from slurm_elastic.sim.engine import RestartModel
from slurm_elastic.sim.jobs import SimJob, packed_placement
from slurm_elastic.sim.policy import ClusterView, Decision, JobView
from slurm_elastic.sim.shim import SimulatedShim, write_batch_range
from slurm_elastic.spec import ElasticSpec
from slurm_elastic import jobfiles as shim

log = logging.getLogger(__name__)

SIM_CONFIG = ControllerConfig(policy=Policy(time_limit_s=None, threads=1))


class ClockedJournal(Journal):
    """The controller's journal stamped with the simulation's clock (the protocol passes no time itself)."""

    def __init__(self, path: str, clock: Callable[[], float]) -> None:
        super().__init__(path)
        self._sim_clock = clock

    def open_plan(self, plan: Plan, *, restarts: int, now: float | None = None) -> int:
        return super().open_plan(plan, restarts=restarts, now=self._sim_clock() if now is None else now)

    def record(self, plan_id: int, step: str, note: str = "", now: float | None = None) -> None:
        super().record(plan_id, step, note, now=self._sim_clock() if now is None else now)

    def finish(self, plan_id: int, status: str, note: str = "", now: float | None = None) -> None:
        super().finish(plan_id, status, note, now=self._sim_clock() if now is None else now)


class VirtualClock:
    """The engine's time plus whatever the protocol slept through inside one scheduling point."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.0)


class ControllerPolicy:
    """The shipped Reconciler behind the simulator's policy interface (see the module docstring).

    `max_scale` bounds the range a user declares: a job asks for
    `[min, min(max, ceil(max_scale x requested))]` GPUs (None: the trace's max).
    `allocator` replaces the L1 MILP (the allocator seam), `requests` the
    request source; both default to what the daemon runs. `keep_ranks`: the
    jobs say their ranks go on in their processes, as under the templates'
    default, so a shrink to some of a job's own nodes (never its batch host)
    is made in place (docs/simulator.md, "Restarts"); off, every resize
    requeues, as for a script run without the templates' runner.
    """

    name = "controller"

    def __init__(self, config: ControllerConfig = SIM_CONFIG, *, max_scale: float | None = 2.0,
                 allocator: Allocator | None = None, requests: RequestSource | None = None,
                 workdir: str | None = None, keep_ranks: bool = True) -> None:
        self.config = config
        self.max_scale = max_scale
        self.keep_ranks = keep_ranks
        self.clock = VirtualClock()
        self._tmp = tempfile.TemporaryDirectory(prefix="se-sim-") if workdir is None else None
        root = workdir or self._tmp.name  # type: ignore[union-attr]
        self.ckpt_root = os.path.join(root, "ckpt")
        os.makedirs(self.ckpt_root, mode=0o700, exist_ok=True)
        self.slurm = InMemorySlurm(nodes=0, clock=self.clock)
        # In memory: the journal's durability is for crashes, and a simulation that crashes starts over.
        self.journal = ClockedJournal(":memory:", self.clock)
        self.reconciler = Reconciler(self.slurm, self.journal, config, clock=self.clock, sleep=self.clock.sleep,
                                     requests=requests, allocator=allocator)
        self._ids: dict[str, int] = {}
        self._keys: dict[int, str] = {}
        self._shims: dict[str, SimulatedShim] = {}
        self._user = getpass.getuser()
        self._node_names: set[str] = set()
        self.cycles = 0
        self.solve_s = 0.0

    def close(self) -> None:
        self.journal.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    # -- the SchedulingPolicy interface --------------------------------------------------------
    def decide(self, view: ClusterView) -> Decision:
        self.clock.t = max(self.clock.t, view.now)
        self._sync_nodes(view)
        active = {jv.key for jv in view.jobs}
        for key, job_id in list(self._ids.items()):
            if key not in active:
                if not self.slurm.jobs[job_id].state.finished:
                    self.slurm.finish(job_id)                   # the training loop reached its end
                del self._ids[key]
                self._shims.pop(key, None)
        gpn = view.gpus_per_node
        for jv in view.jobs:
            if jv.key not in self._ids:
                self._submit(jv.job, gpn)
            elif jv.placement and jv.key in self._shims:
                self._write_metrics(jv, view.now)
        before = self._running_incarnations()
        if self.keep_ranks:
            self._say_ranks_kept()
        t0 = time.perf_counter()
        report = self.reconciler.cycle()
        self.solve_s += time.perf_counter() - t0
        self.cycles += 1
        placements: dict[str, dict[str, int]] = {}
        in_place = set()
        for key, job_id in self._ids.items():
            job = self.slurm.jobs[job_id]
            if job.state is JobState.RUNNING:
                placements[key] = {n: job.gpus_per_node for n in job.nodes}
                restarts, nodes = before.get(key, (-1, ()))
                if job.restarts == restarts and set(job.nodes) < set(nodes):
                    in_place.add(key)      # given up nodes without a requeue: its ranks went on
        notes = tuple(p.describe() for p in report.plans)
        return Decision(placements, notes, report.cycle_s,
                        {"method": report.allocation.method if report.allocation else "",
                         "objective": report.allocation.objective if report.allocation else math.nan},
                        in_place=frozenset(in_place))

    def _running_incarnations(self) -> dict[str, tuple[int, tuple[str, ...]]]:
        """Each running elastic job's restart count and nodes."""
        return {key: (job.restarts, job.nodes) for key, job_id in self._ids.items()
                if (job := self.slurm.jobs[job_id]).state is JobState.RUNNING and job.spec is not None}

    def _say_ranks_kept(self) -> None:
        """Each running elastic job's batch script's word that its ranks go on in their processes when
        nodes are taken (keeps-ranks-J-R, as the templates write it; the engine charges the in-place
        stall only once a job's start is over, when the templates have written it)."""
        for job_id in self._ids.values():
            job = self.slurm.jobs[job_id]
            if job.state is not JobState.RUNNING or job.spec is None:
                continue
            marker = os.path.join(shim.job_dir(self.ckpt_root, str(job_id)),
                                  shim.keeps_ranks_file_name(job_id, job.restarts))
            if not os.path.exists(marker):
                with open(marker, "wb", opener=lambda p, f: os.open(p, f, 0o600)):
                    pass

    # -- the world around the controller --------------------------------------------------------
    def _sync_nodes(self, view: ClusterView) -> None:
        up = {n.name: n for n in view.nodes}
        for name, node in up.items():
            if name not in self.slurm.nodes:
                self.slurm.add_node(name, gpus=node.gpus, cpus=node.cpus, mem_mb=node.mem_mb)
            elif not self.slurm.nodes[name].available:
                self.slurm.node_up(name)
        for name, node in self.slurm.nodes.items():
            if name not in up and node.available:
                self.slurm.node_down(name)

    def _submit(self, job: SimJob, gpn: int) -> None:
        if not job.elastic:
            self._submit_rigid(job, gpn)
            return
        hi = job.max_gpus if self.max_scale is None else max(
            job.min_gpus, min(job.max_gpus, math.ceil(self.max_scale * job.requested_gpus)))
        spec = ElasticSpec(job.min_gpus, hi, cpus_per_gpu=job.cpus_per_gpu, mem_per_gpu_mb=job.mem_per_gpu_mb,
                           weight=job.weight, ckpt_dir=self.ckpt_root)
        shape = packed_placement(job.requested_gpus, gpn)
        # The wrapper submits at the requested size, as whole nodes when it spans.
        nodes, per_node = (1, job.requested_gpus) if len(shape) == 1 else (len(shape), max(shape))
        if nodes * per_node != job.requested_gpus:
            nodes, per_node = 1, min(job.requested_gpus, gpn)
        job_id = self.slurm.add_job(spec, nodes=nodes, gpus_per_node=per_node, user=self._user, name=job.key)
        self._ids[job.key] = job_id
        self._keys[job_id] = job.key
        os.makedirs(shim.job_dir(self.ckpt_root, str(job_id)), mode=0o700, exist_ok=True)
        self._shims[job.key] = SimulatedShim(self.ckpt_root, str(job_id), job)
        write_batch_range(self.ckpt_root, str(job_id), job)

    def _submit_rigid(self, job: SimJob, gpn: int) -> None:
        """A rigid job is a plain Slurm job the controller does not own, with its run time as its time limit."""
        nodes = next(n for n in range(-(-job.requested_gpus // gpn), job.requested_gpus + 1)
                     if job.requested_gpus % n == 0)
        shape = (job.requested_gpus // nodes,) * nodes
        overhead = RestartModel().overhead_s if job.restart_overhead_s is None else job.restart_overhead_s
        job_id = self.slurm.add_job(None, nodes=nodes, gpus_per_node=shape[0], user=self._user, name=job.key,
                                    cpus_per_gpu=job.cpus_per_gpu, mem_per_gpu_mb=job.mem_per_gpu_mb,
                                    time_limit_s=job.runtime_at(shape) + overhead)
        self._ids[job.key] = job_id
        self._keys[job_id] = job.key

    def _write_metrics(self, jv: JobView, now: float) -> None:
        """The row the training shim appends, once the job has stepped since its last row."""
        per_node = tuple(sorted((g for g in jv.placement.values() if g > 0), reverse=True))
        self._shims[jv.key].report(per_node, jv.job.work - jv.remaining, now, jv.segment, jv.in_place)
