"""The numeric form of an AllocationProblem: capacity and demand arrays, candidate counts, throughput hulls, and the objective.

Every solver path (exact MILP, counts + packing, greedy, the brute force in
the tests) scores a placement with `Instance.objective`, so "better" means the
same thing everywhere.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from slurm_elastic.allocate import commitments
from slurm_elastic.allocate import throughput as tp
from slurm_elastic.allocate.objective import JobObjective
from slurm_elastic.allocate.problem import AllocationProblem, JobRequest, Unplaceable
from slurm_elastic.allocate.shapes import placement_is_valid_shape, spanning_widths
from slurm_elastic.errors import AllocationError

RESOURCES = ("gpu", "cpu", "mem")
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class JobTerms:
    """Per-job constants of the objective."""

    candidates: tuple[int, ...]        # allowed non-zero counts that some shape can place on the empty cluster
    hull: tuple[tuple[float, float], ...]
    norm: float                        # hull value at max GPUs (s_j(gmax_j))
    kappa: float                       # restart cost (0 for a job not running, or displaced: it restarts anyway)
    objective: JobObjective            # the job's objective coefficients (allocate/objective.py)
    spans: bool                        # some candidate needs >= 2 nodes
    allowed: tuple[int, ...] = ()      # every count the job and policy allow, placeable or not


class Instance:
    """Arrays over jobs j, nodes n, resources r (gpu, cpu, mem)."""

    def __init__(self, problem: AllocationProblem, *, validated: bool = False) -> None:
        if not validated:            # solve() has just checked it: twice costs 0.2 s at 10,000 jobs
            problem.validate()
        self.problem = problem
        self.policy = problem.policy
        self.jobs: tuple[JobRequest, ...] = problem.jobs
        self.nodes = problem.nodes
        self.node_names = tuple(n.name for n in self.nodes)
        self.node_index = {n: i for i, n in enumerate(self.node_names)}
        self.job_index = {j.key: i for i, j in enumerate(self.jobs)}
        self.cap = np.array([[n.gpus, n.cpus, n.mem_mb] for n in self.nodes], dtype=float).reshape(-1, 3)
        self.rho = np.array([[1.0, j.cpus_per_gpu, j.mem_per_gpu_mb] for j in self.jobs], dtype=float).reshape(-1, 3)
        self.total = self.cap.sum(axis=0) if len(self.nodes) else np.zeros(3)
        self.node_sizes = {int(g) for g in self.cap[:, 0] if g > 0}
        self.max_node_gpus = max(self.node_sizes, default=0)
        self.whole = self.policy.whole_nodes_when_spanning
        # x0: the current allocation matrix (GPUs on nodes the problem does not know are lost anyway).
        self.current: list[dict[int, int]] = []
        for j in self.jobs:
            row = {self.node_index[n]: int(g) for n, g in j.current.items() if g > 0 and n in self.node_index}
            self.current.append(row)
        # the node each running job's batch script runs on (an in-place shrink keeps it), None: unknown
        self.batch: list[int | None] = [self.node_index.get(j.batch_node) if j.batch_node is not None else None
                                        for j in self.jobs]
        # keyed by a job's resources per GPU, which few jobs differ in: memory O(kinds x nodes), not jobs x nodes
        self._per_node: dict[tuple[float, float, float], np.ndarray] = {}
        self._single_max: dict[int, float] = {}
        self._span_nodes: dict[int, dict[int, int]] = {}
        self.terms: list[JobTerms] = []
        unplaceable = {u.key: u for u in problem.unplaceable}
        for i, j in enumerate(self.jobs):
            terms, why = self._job_terms(i, j)
            self.terms.append(terms)
            if not terms.candidates and j.key not in unplaceable:
                unplaceable[j.key] = Unplaceable(j.key, why)
        self.unplaceable = tuple(unplaceable.values())
        if self.policy.objective == "progress":
            self._price_floors()

    def _price_floors(self) -> None:
        """Each floor GPU's penalty: M_f x floor priority, M_f = 10 x the most any GPU of any job is worth, so
        one floor GPU outweighs any progress, and floors are relaxed lowest priority first when they cannot
        all hold (a slack, never a dropped row: the problem stays feasible)."""
        # in each job's own units: V_j as given, or (no values) its weighted, normalised speed
        per_gpu = [v / g * (1.0 if j.values is not None else float(j.weight) / t.norm)
                   for j, t in zip(self.jobs, self.terms) for g, v in t.hull if g > 0]
        unit = 10.0 * max(per_gpu, default=1.0)
        unit = unit if unit > 0 else 1.0
        for i, j in enumerate(self.jobs):
            t = self.terms[i]
            if t.objective.floor > 0:
                price = unit * max(float(j.floor_priority), 1.0)
                self.terms[i] = dataclasses.replace(t, objective=dataclasses.replace(t.objective, per_short_gpu=price))

    # -- commitments -----------------------------------------------------------------------
    def commitment_ranks(self) -> list[int]:
        """Each job's must-run rank (0: need not run, or cannot be placed at all)."""
        return [commitments.rank(j.must_run, j.commitment) if self.terms[i].candidates else 0
                for i, j in enumerate(self.jobs)]

    def min_demand(self) -> np.ndarray:
        """Resources (gpu, cpu, mem) of each job at its smallest placeable count (0 when none)."""
        smallest = np.array([t.candidates[0] if t.candidates else 0 for t in self.terms], dtype=float)
        return self.rho * smallest[:, None]

    def usable(self) -> np.ndarray:
        """Aggregate capacity of the nodes with GPUs (CPUs or memory on a GPU-less node serve no job)."""
        return self.cap[self.cap[:, 0] > 0].sum(axis=0) if len(self.nodes) else np.zeros(3)

    def give_up(self, indices: Sequence[int]) -> None:
        """Drop the must-run requirement of these jobs (their terms do not depend on it)."""
        drop = set(indices)
        self.jobs = tuple(dataclasses.replace(j, must_run=False, commitment=0) if i in drop else j
                          for i, j in enumerate(self.jobs))

    # -- construction -------------------------------------------------------------------
    def _job_terms(self, i: int, job: JobRequest) -> tuple[JobTerms, str]:
        allowed = job.candidate_gpus()
        if self.policy.allowed_shapes is not None:
            shapes = set(self.policy.allowed_shapes)
            allowed = tuple(g for g in allowed if g in shapes)
        # counts above the cluster's GPUs can never be placed: a 1-100000 range costs no more than 1-Cap
        feasible = tuple(g for g in allowed if g <= self.total[0] and self._fits_empty(i, g))
        why = ""
        if not allowed:
            why = (f"no allowed GPU count in {job.min_gpus}-{job.max_gpus} (step {job.gpu_step}"
                   f"{', allowed ' + str(self.policy.allowed_shapes) if self.policy.allowed_shapes else ''})")
        elif not feasible:
            why = self._why_not_placeable(i, allowed[0])
        progress = self.policy.objective == "progress"
        if progress and job.values is not None:
            # V_j at its allowed counts, already weighted and in the objective's units: no normaliser
            hull = tp.concave_hull((g, v) for g, v in job.values if g in allowed)
            norm = 1.0
            weight = 1.0
        else:
            model = job.throughput if job.throughput is not None else tp.LinearThroughput()
            if isinstance(model, Mapping):
                model = tp.table_throughput(model)      # a profile table given as is
            points = sorted({g for g in allowed if g <= self.total[0]} | {job.max_gpus})
            hull = tp.curve(model, points, self.nodes_for, job.key)
            norm = tp.evaluate_curve(hull, job.max_gpus)
            if norm <= 0:
                raise AllocationError(f"job {job.key}: throughput at its max of {job.max_gpus} GPUs must be > 0")
            weight = float(job.weight)
        running = job.current_gpus > 0 and not self.displaced(i)
        spans = any(spanning_widths(g, self.node_sizes, self.whole) for g in feasible) and len(self.nodes) > 1
        if progress:
            # The restart is priced in the objective's own units: a change keeps (1 - pi) of the new value,
            # staying keeps all of the current one. A job that must restart anyway (a node it is on is gone
            # or too small now) has nothing to keep: the restart is not the solver's choice.
            pi = float(job.stay_fraction)
            g0 = job.current_gpus
            stay = pi * weight * tp.evaluate_curve(hull, g0) / norm if running and g0 in feasible else 0.0
            objective = JobObjective(weight * (1.0 - pi), norm, job.max_gpus, 0.0, 0.0, self.policy.gamma,
                                     stay=stay, floor=min(job.floor_gpus, feasible[-1] if feasible else 0))
            return JobTerms(feasible, hull, norm, 0.0, objective, spans, allowed), why
        kappa = float(job.restart_cost_s) if running else 0.0
        objective = JobObjective.of(self.policy, weight=weight, norm=norm, gmax=job.max_gpus,
                                    per_gpu_resources=self.rho[i], total=self.total, kappa=kappa)
        if self.policy.restart_charge == "fixed":
            # A restart costs the whole job its progress for a while, whether one GPU changes or all: the
            # charge is one stay bonus, what changing all gmax GPUs cost per GPU, scaled by the value of its
            # speed now (weight included: the lost seconds are worth what this job's progress is worth; a
            # job of small weight, most of its work ahead, would otherwise never recover a restart's cost
            # by growing, even on an idle cluster).
            g0 = job.current_gpus
            per_s = self.policy.beta * job.max_gpus * weight * tp.evaluate_curve(hull, g0) / norm if g0 else 0.0
            stay = per_s * kappa if kappa > 0 and g0 in feasible else 0.0
            # A shrink that keeps the processes pays only its own seconds. So does one a job cannot avoid
            # (a node of its holds less now: a rigid job's reservation): the relaunch it spares is the same.
            full, in_place = float(job.restart_cost_s), job.in_place_cost_s
            known = len(self.current[i]) == sum(1 for g in job.current.values() if g > 0)
            kept = (per_s * (full - in_place) if in_place is not None and in_place < full and known
                    and self.batch[i] in self.current[i] else 0.0)
            objective = dataclasses.replace(objective, per_moved_gpu=0.0, stay=stay, in_place=kept)
        return JobTerms(feasible, hull, norm, kappa, objective, spans, allowed), why

    def displaced(self, i: int) -> bool:
        """Job i cannot stay where it is whatever the others do (its node is down, unknown or too small now)."""
        job = self.jobs[i]
        held = {n: g for n, g in job.current.items() if g > 0}
        if any(n not in self.node_index for n in held):
            return True
        per = self.max_per_node(i)
        return any(per[self.node_index[n]] < g for n, g in held.items())

    def nodes_for(self, gpus: int) -> int:
        """Nodes a count needs at the least (throughput models see this node count)."""
        if gpus <= 0:
            return 0
        if self.max_node_gpus <= 0:
            return 1
        return max(1, math.ceil(gpus / self.max_node_gpus))

    def hosts(self, i: int, n: int) -> bool:
        """Node n can hold at least one GPU of job i."""
        return bool(self.max_per_node(i)[n] >= 1)

    def max_per_node(self, i: int) -> np.ndarray:
        """GPUs of job i each node could hold alone, over all three resources."""
        rho = self.rho[i]
        key = (float(rho[0]), float(rho[1]), float(rho[2]))
        cached = self._per_node.get(key)
        if cached is None:
            cols = [np.floor(self.cap[:, r] / rho[r] + 1e-9) for r in range(3) if rho[r] > 0]
            cached = np.minimum.reduce(cols) if cols else self.cap[:, 0].copy()
            cached.flags.writeable = False    # shared by every job of these resources per GPU
            self._per_node[key] = cached
        return cached

    def _fits_empty(self, i: int, g: int) -> bool:
        per = self.max_per_node(i)
        if not len(per):
            return False
        single = self._single_max.get(i)
        if single is None:
            single = self._single_max[i] = float(per.max())
        if g <= single:
            return True
        counts = self._span_nodes.setdefault(i, {})
        for w in spanning_widths(g, self.node_sizes, self.whole):
            if w not in counts:
                ok = per >= w
                if self.whole:
                    ok &= self.cap[:, 0] == w
                counts[w] = int(ok.sum())
            if counts[w] >= g // w:
                return True
        return False

    def _why_not_placeable(self, i: int, g: int) -> str:
        job = self.jobs[i]
        if not len(self.nodes) or not np.any(self.cap[:, 0] > 0):
            return f"min {g} GPUs not placeable: the cluster has no free GPUs for elastic work"
        need = g * self.rho[i]
        short = []
        for r, name, unit in ((0, "GPUs", ""), (1, "CPUs", ""), (2, "memory", " MB")):
            best = self.cap[:, r].max()
            if best < need[r] - _EPS:
                short.append(f"{name} {need[r]:.0f}{unit} > largest free {best:.0f}{unit}")
        detail = "; ".join(short) if short else "no node has all resources at once and no spanning shape fits"
        return (f"min {g} GPUs not placeable (job {job.key} needs {need[0]:.0f} GPUs, {need[1]:.0f} CPUs, "
                f"{need[2]:.0f} MB on one node or equal whole nodes): {detail}")

    # -- scoring ---------------------------------------------------------------------------
    def throughput_value(self, i: int, g: int) -> float:
        t = self.terms[i]
        return t.objective.speed_value(tp.evaluate_curve(t.hull, g))

    def job_objective(self, i: int, row: Mapping[int, int]) -> float:
        """Job i's share of the objective when it holds row[n] GPUs on node n (JobObjective.value)."""
        t = self.terms[i]
        g = sum(row.values())
        speed = tp.evaluate_curve(t.hull, g) if g > 0 else 0.0
        moved = 0
        if t.kappa > 0:
            cur = self.current[i]
            moved = sum(abs(row.get(n, 0) - cur.get(n, 0)) for n in set(row) | set(cur))
        stays = t.objective.stay > 0 and self.stays(i, row)
        in_place = t.objective.in_place > 0 and self.in_place(i, row)
        return t.objective.value(g, speed, moved, sum(1 for v in row.values() if v > 0), stays, in_place)

    def stays(self, i: int, row: Mapping[int, int]) -> bool:
        """Row is exactly where job i runs now (and it runs)."""
        return bool(self.current[i]) and {n: v for n, v in row.items() if v > 0} == self.current[i]

    def in_place(self, i: int, row: Mapping[int, int]) -> bool:
        """Row shrinks job i to some of the nodes it holds, each as it is, its batch node among them: what
        a running job can give up keeping its processes (control/plan.py `nodes_kept`)."""
        cur, b = self.current[i], self.batch[i]
        used = {n: v for n, v in row.items() if v > 0}
        return (b is not None and b in used and sum(used.values()) < sum(cur.values())
                and all(cur.get(n) == v for n, v in used.items()))

    def preferred(self, i: int) -> dict[int, int]:
        """Job i's current row with its batch node first: where a shrink keeps its nodes, it keeps that one."""
        cur, b = self.current[i], self.batch[i]
        return {b: cur[b], **cur} if b in cur else cur

    def stays_off_shape(self, i: int) -> bool:
        """Job i runs at a placement the shape rule would not choose now (Slurm placed it, or other jobs
        moved around a spanning one), at an allowed count, on nodes that can still host it: staying is an
        answer for it all the same, since staying asks Slurm for nothing."""
        cur = self.current[i]
        if not cur or sum(cur.values()) not in self.terms[i].candidates:
            return False
        named = {self.node_names[n]: v for n, v in cur.items()}
        node_gpus = {self.node_names[n]: int(self.cap[n, 0]) for n in cur}
        if placement_is_valid_shape(named, node_gpus, self.whole):
            return False
        per = self.max_per_node(i)
        return all(per[n] >= v for n, v in cur.items())

    def objective(self, placement: Sequence[Mapping[int, int]]) -> float:
        return float(sum(self.job_objective(i, row) for i, row in enumerate(placement)))

    # -- checking --------------------------------------------------------------------------
    def violations(self, placement: Sequence[Mapping[int, int]]) -> list[str]:
        """Every broken rule of a placement (empty when it is valid)."""
        out: list[str] = []
        used = np.zeros_like(self.cap)
        node_gpus = {self.node_names[n]: int(self.cap[n, 0]) for n in range(len(self.nodes))}
        for i, row in enumerate(placement):
            g = sum(row.values())
            if g and g not in self.terms[i].candidates:
                out.append(f"job {self.jobs[i].key}: {g} GPUs is not an allowed count")
            named = {self.node_names[n]: v for n, v in row.items()}
            if not placement_is_valid_shape(named, node_gpus, self.whole) and not self.stays(i, row):
                out.append(f"job {self.jobs[i].key}: {named} is not a Slurm shape")
            for n, v in row.items():
                if v < 0:
                    out.append(f"job {self.jobs[i].key}: negative GPUs on {self.node_names[n]}")
                used[n] += v * self.rho[i]
        over = used > self.cap + 1e-6
        for n, r in zip(*np.nonzero(over)):
            out.append(f"node {self.node_names[n]}: {RESOURCES[r]} {used[n, r]:.0f} > capacity {self.cap[n, r]:.0f}")
        return out
