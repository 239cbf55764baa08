"""The allocation problem and its answer: plain data shared by the solver, the controller and the simulator.

Contract (the controller, the simulator and the benchmarks rely on it):

- `AllocationProblem(jobs, nodes, policy)` can be built from plain
  descriptions; `allocate/from_state.py`'s `problem_from_state(ClusterState,
  policy)` builds it from a Slurm snapshot (this module knows no snapshot).
- `slurm_elastic.allocate.solve(problem) -> Allocation`.
- Job keys are strings (Slurm job ids as text, or simulator job names).
- `Allocation.decisions[k].cause` is a machine-readable reason, `render_explanation`
  (allocate/explain.py) the text `admin rebalance --dry-run --explain` prints.

The formulation, the solve methods and their measured cost: docs/allocator.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, runtime_checkable

from slurm_elastic.allocate.commitments import Commitment
from slurm_elastic.errors import AllocationError
from slurm_elastic.settings import OBJECTIVE


@runtime_checkable
class ThroughputModel(Protocol):
    """Speed (samples/s, or any unit consistent per job) at `gpus` GPUs spread over `nodes` nodes."""

    def __call__(self, gpus: int, nodes: int = 1) -> float: ...


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """What one up node can give to elastic work (configured minus non-elastic use)."""

    name: str
    gpus: int
    cpus: int
    mem_mb: int


@dataclass(frozen=True, slots=True)
class JobRequest:
    """One elastic job as the allocator sees it.

    `current` maps node name -> GPUs the job holds there now (empty when it is
    not running); `restart_cost_s` is kappa_j, the seconds a resize costs it;
    `in_place_cost_s`, what a shrink costs that keeps its processes (it gives up
    whole nodes, never `batch_node`, its batch script's, and keeps the rest as
    they are); None: it has no such path, every change costs kappa_j.
    `allowed_gpus`, when given, restricts g_j further (e.g. powers of two);
    0 (not running) is always allowed.
    """

    key: str
    min_gpus: int
    max_gpus: int
    gpu_step: int = 1
    cpus_per_gpu: int = 1
    mem_per_gpu_mb: int = 1024
    weight: float = 1.0
    current: Mapping[str, int] = field(default_factory=dict)
    restart_cost_s: float = 30.0
    in_place_cost_s: float | None = None
    batch_node: str | None = None
    throughput: Callable[..., float] | Mapping[int, float] | None = None  # a model, or a GPUs -> speed table
    allowed_gpus: tuple[int, ...] | None = None
    # the nodes it may run on (its partition's; allocate/pools.py), None: any node of the problem
    allowed_nodes: frozenset[str] | None = None
    must_run: bool = False
    # why it must run, as a rank (allocate/commitments.py's Commitment): when the must-run jobs cannot all
    # run, the lowest ranks are given up first
    commitment: int = 0
    # The progress objective (Policy.objective "progress"; docs/allocator.md). `values`: the job's value
    # V_j(g) at its allowed counts, in weighted 1-GPU-seconds of progress per second (replaces throughput
    # and weight); `stay_fraction`: pi_j, the share of V_j(g0) any change of its placement loses (restart
    # seconds over the horizon); `floor_gpus`: its finish-time-fairness floor phi_j, held by a penalised
    # slack whose penalty per GPU short rises with `floor_priority` (rho_FTF_j: the most overdue kept first).
    values: tuple[tuple[int, float], ...] | None = None
    stay_fraction: float = 0.0
    floor_gpus: int = 0
    floor_priority: float = 0.0
    # Whose job it is, and the factor of `weight` (or of `values`) that its user's `--weight` put there:
    # that factor moves GPUs among the user's own jobs only (allocate/users.py).
    user: str = ""
    own_weight: float = 1.0
    # The factor of restart_cost_s and in_place_cost_s that its weights put there (control/requests' restart
    # charge): the equal-weight solve divides it out, or a claim would make a job cheap or dear to move there.
    charge_weight: float = 1.0
    # Where it stands in the neutral solve (allocate/users.py): the placement that solve gave it last
    # cycle, where its user's claims placed it otherwise (None: `current`).
    neutral_current: Mapping[str, int] | None = None

    def neutral(self) -> JobRequest:
        """This request as if its user had given every job the same weight."""
        own = self.own_weight
        values = None if self.values is None else tuple((g, v / own) for g, v in self.values)
        return dataclasses.replace(self, weight=self.weight / own, values=values, own_weight=1.0)

    @property
    def current_gpus(self) -> int:
        return sum(self.current.values())

    def candidate_gpus(self) -> tuple[int, ...]:
        """Every non-zero GPU count the job may take."""
        counts = range(self.min_gpus, self.max_gpus + 1, self.gpu_step)
        if self.allowed_gpus is not None:
            allowed = set(self.allowed_gpus)
            return tuple(g for g in counts if g in allowed)
        return tuple(counts)

    def validate(self) -> None:
        if not self.key:
            raise AllocationError("a job needs a non-empty key")
        for name in ("min_gpus", "max_gpus", "gpu_step"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise AllocationError(f"job {self.key}: {name} must be a positive integer, got {v!r}")
        if self.min_gpus > self.max_gpus:
            raise AllocationError(f"job {self.key}: min GPUs {self.min_gpus} exceeds max {self.max_gpus}")
        for name in ("cpus_per_gpu", "mem_per_gpu_mb"):
            v = getattr(self, name)
            if not _number(v) or v < 0:
                raise AllocationError(f"job {self.key}: {name} must be a non-negative number, got {v!r}")
        if not _number(self.weight) or self.weight <= 0:
            raise AllocationError(f"job {self.key}: weight must be a positive finite number, got {self.weight!r}")
        if not _number(self.own_weight) or self.own_weight <= 0:
            raise AllocationError(f"job {self.key}: own weight must be a positive finite number, got {self.own_weight!r}")
        if not _number(self.charge_weight) or self.charge_weight <= 0:
            raise AllocationError(f"job {self.key}: charge weight must be a positive finite number, "
                                  f"got {self.charge_weight!r}")
        if not _number(self.restart_cost_s) or self.restart_cost_s < 0:
            raise AllocationError(f"job {self.key}: restart cost must be >= 0 seconds, got {self.restart_cost_s!r}")
        if self.in_place_cost_s is not None and (not _number(self.in_place_cost_s) or self.in_place_cost_s < 0):
            raise AllocationError(f"job {self.key}: in-place cost must be >= 0 seconds, got {self.in_place_cost_s!r}")
        if self.batch_node is not None and not isinstance(self.batch_node, str):
            raise AllocationError(f"job {self.key}: batch node must be a node name, got {self.batch_node!r}")
        if not isinstance(self.current, Mapping) or any(
                not isinstance(g, int) or isinstance(g, bool) or g < 0 for g in self.current.values()):
            raise AllocationError(f"job {self.key}: current GPUs per node must be whole numbers >= 0, "
                                  f"got {self.current!r}")
        if (not isinstance(self.commitment, int) or isinstance(self.commitment, bool)
                or self.commitment not in set(Commitment)):
            raise AllocationError(f"job {self.key}: commitment must be one of "
                                  f"{', '.join(f'{c.value} ({c.name.lower()})' for c in Commitment)}, "
                                  f"got {self.commitment!r}")
        if self.allowed_gpus is not None and any(not isinstance(g, int) for g in self.allowed_gpus):
            raise AllocationError(f"job {self.key}: allowed GPU counts must be whole numbers, got {self.allowed_gpus!r}")
        if self.allowed_nodes is not None and (not isinstance(self.allowed_nodes, frozenset)
                                               or any(not isinstance(n, str) for n in self.allowed_nodes)):
            raise AllocationError(f"job {self.key}: allowed nodes must be a frozenset of node names, "
                                  f"got {self.allowed_nodes!r}")
        if self.throughput is not None and not (callable(self.throughput) or isinstance(self.throughput, Mapping)):
            raise AllocationError(f"job {self.key}: throughput must be a callable or a GPUs -> speed table")
        if self.values is not None and (not self.values or any(
                not isinstance(g, int) or isinstance(g, bool) or g < 1 or not _number(v) or v < 0
                for g, v in self.values)):
            raise AllocationError(f"job {self.key}: values must be (GPUs >= 1, value >= 0) pairs, got {self.values!r}")
        if not _number(self.stay_fraction) or not 0 <= self.stay_fraction <= 1:
            raise AllocationError(f"job {self.key}: stay fraction must be in [0, 1], got {self.stay_fraction!r}")
        if not isinstance(self.floor_gpus, int) or isinstance(self.floor_gpus, bool) or self.floor_gpus < 0:
            raise AllocationError(f"job {self.key}: floor GPUs must be a whole number >= 0, got {self.floor_gpus!r}")
        if not _number(self.floor_priority) or self.floor_priority < 0:
            raise AllocationError(f"job {self.key}: floor priority must be >= 0, got {self.floor_priority!r}")


RESTART_CHARGES = ("fixed", "per-gpu")


@dataclass(frozen=True, slots=True)
class Policy:
    """Weights of the objective terms and the solver's limits (see docs/allocator.md)."""

    alpha: float = 0.5        # L1 distance of allocated from demanded resource matrix
    beta: float = 0.002       # restart cost, per second of kappa_j (per GPU changed: restart_charge)
    gamma: float = 0.01       # per node a job spans
    # Where HiGHS stops. The normal stop is work (branch-and-bound nodes, simplex iterations): with one
    # thread and a fixed seed the same problem gets the same answer at any load. The wall-clock cap
    # (None: none) is a live controller's safety net; a solve it stops is not repeatable.
    time_limit_s: float | None = 10.0
    max_nodes: int | None = 1_000
    max_iterations: int | None = None
    random_seed: int = 0
    mip_rel_gap: float = 0.01
    allowed_shapes: tuple[int, ...] | None = None  # e.g. (1, 2, 4, 8) GPUs per job, or None for any
    whole_nodes_when_spanning: bool = True
    threads: int | None = None
    # two-stage only: accept the LP relaxation's rounded counts when HiGHS's LP bound already proves them
    # within mip_rel_gap (branch-and-bound could only confirm that); False always runs the MIP
    lp_certificate: bool = True
    # "legacy": weighted speed minus the L1 terms above; "progress": each job's value V_j(g) with its
    # restart priced as a stay bonus and its fairness floor as a penalised slack (docs/allocator.md)
    objective: str = OBJECTIVE.default
    # legacy objective, how a running job's restart is charged: "fixed": any change of its size or place
    # loses beta kappa_j gmax_j w_j s_j(g0)/s_j(gmax), the share of its value now a restart costs, however
    # many GPUs change; "per-gpu": beta kappa_j per GPU added or removed on a node (|x - x0|_1)
    restart_charge: str = "fixed"

    def validate(self) -> None:
        if self.objective not in OBJECTIVE.choices:
            raise AllocationError(f"policy objective must be one of {', '.join(OBJECTIVE.choices)}, "
                                  f"got {self.objective!r}")
        if self.restart_charge not in RESTART_CHARGES:
            raise AllocationError(f"policy restart_charge must be one of {', '.join(RESTART_CHARGES)}, "
                                  f"got {self.restart_charge!r}")
        for name in ("alpha", "beta", "gamma", "time_limit_s", "mip_rel_gap"):
            v = getattr(self, name)
            if name == "time_limit_s" and v is None:
                continue
            if not _number(v) or v < 0:
                raise AllocationError(f"policy {name} must be a non-negative finite number, got {v!r}")
        for name in ("max_nodes", "max_iterations"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise AllocationError(f"policy {name} must be a positive whole number or None, got {v!r}")
        if not isinstance(self.random_seed, int) or isinstance(self.random_seed, bool) or self.random_seed < 0:
            raise AllocationError(f"policy random_seed must be a whole number >= 0, got {self.random_seed!r}")


def _number(v: object) -> bool:
    """A finite real number (bools are not numbers here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True, slots=True)
class Unplaceable:
    """A job that cannot run at its minimum anywhere, and why."""

    key: str
    reason: str


@dataclass(frozen=True, slots=True)
class AllocationProblem:
    jobs: tuple[JobRequest, ...]
    nodes: tuple[NodeCapacity, ...]
    policy: Policy = Policy()
    unplaceable: tuple[Unplaceable, ...] = ()

    def validate(self) -> None:
        self.policy.validate()
        if not all(isinstance(j, JobRequest) for j in self.jobs):
            raise AllocationError("every job must be a JobRequest")
        if not all(isinstance(n, NodeCapacity) for n in self.nodes):
            raise AllocationError("every node must be a NodeCapacity")
        keys = [j.key for j in self.jobs]
        if len(set(keys)) != len(keys):
            raise AllocationError("job keys must be unique")
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise AllocationError("node names must be unique")
        for n in self.nodes:
            for r in ("gpus", "cpus", "mem_mb"):
                v = getattr(n, r)
                if not _number(v) or v < 0:
                    raise AllocationError(f"node {n.name}: {r} capacity must be >= 0, got {v!r}")
        for j in self.jobs:
            j.validate()


@dataclass(frozen=True, slots=True)
class JobDecision:
    """Why a job got what it got (for `--explain`)."""

    key: str
    gpus_before: int
    gpus_after: int
    reason: str
    # machine-readable cause: "max", "capacity", "restart-cost", "node-cost", "min-not-placeable",
    # "no-gain", "traded" (see allocate/explain.py)
    cause: str = ""


# What a status certifies about the FINAL answer (after packing, make-room, fill or a fallback), judged
# on its gap to a proven bound on the exact optimum: the one home of these names.
OPTIMAL = "optimal"            # final gap 0: no placement scores higher
WITHIN_GAP = "within-gap"      # 0 < final gap <= mip_rel_gap
ABOVE_GAP = "above-gap"        # further from the proven bound than mip_rel_gap, or no bound holds for it (bound NaN)
WORK_LIMIT = "work-limit-reached"
TIME_LIMIT = "time-limit-reached"
REPAIRED = "repaired"          # allocate/repair.py: untouched jobs kept, the rest solved; no bound on the whole


def weakest_status(statuses: list[str]) -> str:
    """What answers solved apart may claim together: optimal only if each is, within the gap if each is,
    else the first claim that is neither."""
    if all(s == OPTIMAL for s in statuses):
        return OPTIMAL
    return next((s for s in statuses if s not in (OPTIMAL, WITHIN_GAP)), WITHIN_GAP)


@dataclass(frozen=True, slots=True)
class Allocation:
    """The solver's answer.

    `gpus[key]` is g_j (0 = not running); `placement[key]` maps node name ->
    GPUs of the job there. `method` is the route: "milp", "lp-rounded" (the
    counts model's LP, rounded, proven within the gap by its bound:
    branch-and-bound skipped), "milp-work-limit" (HiGHS's incumbent at its
    node limit: repeatable), "milp-time-limit" (at the wall-clock cap: not
    repeatable) or "greedy" (no incumbent, or the warm start scored higher).
    `status` says what the final answer is certified to be against a proven
    bound (allocate/solver.py `_certified`, docs/allocator.md): "optimal"
    only at a final gap of 0, "within-gap" up to the gap asked for, never
    when `mip_gap`, the final gap after packing, is above it.
    """

    gpus: Mapping[str, int]
    placement: Mapping[str, Mapping[str, int]]
    status: str
    method: str
    objective: float
    mip_gap: float
    bound: float
    solve_s: float
    decisions: tuple[JobDecision, ...] = ()
    unplaceable: tuple[Unplaceable, ...] = ()
    notes: tuple[str, ...] = ()
    # job key -> what its request was decided from (set by the controller's request source)
    basis: Mapping[str, str] = field(default_factory=dict)
    # job key -> its placement in the neutral solve, where the allocation was solved by user (allocate/users.py)
    neutral: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
