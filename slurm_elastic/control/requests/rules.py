"""The request rules: named units, applied in the one order RULES declares, that turn one job's
Measurement into its request (speed model, allowed counts, weight, must-run, restart charge).

Each rule is a class with a `name` and `apply(ctx) -> ctx` over a frozen JobContext; what it adds to the
job's explanation (`rebalance --explain`) ends in its name in brackets, so the explanation says which unit
decided. A new rule is one class and one line in RULES; the order is the order they apply, and it
matters (the share floor bounds what the speed frontier allowed; starvation raises the weight the
remaining-work rule set; the restart charge uses the final weight).

The rules, stated:

- speed (`SpeedModel`): the measured model (steps/s per GPU and node count, with its rule for sizes never
  run: a GPU past the largest size measured adds at most what the last measured one did) or, until a row
  exists, the default model (linear, a penalty per extra node). An adaptive-batch job (batch.json and
  rows with batch and gradient noise) is allocated by goodput at the best batch for each size
  (`allocate.throughput.GoodputThroughput`); remaining time is always from steps/s at the batch measured.
- geometry (`BatchGeometry`): only sizes the job's global batch splits over; a job whose ranks exited 87
  at its size is re-planned at once.
- asked-size (`AskedSize`): the size Slurm saw a job submitted at, until run there, is credited linear from
  the nearest smaller size measured, not what a fit through the other sizes predicts.
- speed-frontier (`SpeedFrontier`): a size measured no faster than a smaller one is not allowed, where
  faster means each added GPU gains at least `min_marginal_gain` of what a GPU gives at the smaller size.
- measure-first (`MeasureFirst`): a job just started keeps its size until its first rows exist
  (`measure_first_s`), at the placeable counts nearest it when its size is no shape Slurm is given.
- share-floor (`ShareFloor`, `FloorHolds`): a running job is not taken below min(the size it asked for,
  its fair share, the size it holds), rounded down to a size it can take, nor to zero, while it runs.
  The size it asked for is the GPUs it was submitted at, as the source first saw it pending (a job the
  controller started below its request still asked for its request); for a job first seen running, the
  GPU count of its metrics file's first row (a file whose beginning was not read gives no floor). Its
  fair share (`source.fair_shares`) is the GPUs elastic work can use / the number of elastic jobs that
  want GPUs: no weight, as the floor is part of the equal-weight solve (allocate/users.py). Why:
  remaining-time weights alone make a long job lose every trade against each shorter arrival, so over
  its life it was shrunk and grown back again and
  again, each a restart (workload 1 before the floor: yolov3 on 2.2 GPUs of the 4 it asked for, 27.7
  restarts per job, 1.77x its Tiresias JCT; with it: 3.6 GPUs, 5 restarts, 1.14x).
- restart-cost (`RestartCost`): the median of the job's last five measured restarts, else the default.
- remaining-work (`RemainingWork`): w = clamp(H / remaining s): shortest remaining time first is what
  minimises average completion time.
- starvation (`Starvation`): a job that has waited without GPUs for `starve_after_s` must run.
- restart-charge (`RestartCharge`): beta x kappa per GPU changed is the share of the throughput term a
  restart loses over a size held for the hysteresis, at the job's weight but never below the neutral 1.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol, Sequence

from slurm_elastic.allocate.commitments import Commitment
from slurm_elastic.allocate.problem import Policy
from slurm_elastic.allocate.shapes import spanning_widths
from slurm_elastic.allocate.throughput import GoodputThroughput, LinearThroughput, MeasuredThroughput, speed_frontier
from slurm_elastic.cluster.model import Job, JobState
from slurm_elastic.control.requests.measuring import Measurement
from slurm_elastic.control.requests.settings import RequestSettings
from slurm_elastic.goodput import efficiency

SpeedModelType = MeasuredThroughput | LinearThroughput | GoodputThroughput


@dataclass(frozen=True, slots=True)
class JobContext:
    """One job's request as the rules build it: what they are given, then what each has decided so far."""

    job: Job
    now: float
    policy: Policy
    settings: RequestSettings
    measured: Measurement
    node_sizes: frozenset[int]
    share: int                                # its fair share of the GPUs elastic work can use
    own_weight: float                         # its weight among its user's jobs (source.own_weights)
    waiting_s: float                          # how long it has waited without GPUs
    yielding: bool = False                    # GPUs go back to a rigid job this cycle: no rule keeps a size
    submitted: int | None = None              # the GPUs Slurm showed it pending at (None: not seen pending)
    model: SpeedModelType | None = None       # what the allocator maximises (steps/s or goodput)
    steps_model: MeasuredThroughput | LinearThroughput | None = None   # steps/s, for remaining time
    counts: tuple[int, ...] = ()              # the sizes its spec and its batch allow
    fits: tuple[int, ...] = ()                # the sizes its global batch splits over (geometry.json)
    bad_geometry: str = ""                    # why its ranks cannot run at its current size ("" = they can)
    allowed: tuple[int, ...] | None = None    # the counts it may be given (None: every count)
    wait: str = ""                            # why it is kept at its size now ("" = it is not)
    floor: int = 0
    restart_s: float = 0.0                    # seconds one relaunch costs it
    in_place_s: float = 0.0                   # seconds a resize costs it that keeps its processes
    weight: float = 1.0                       # multiplies the user's own weight
    must_run: bool = False
    commitment: Commitment = Commitment.NONE
    restart_charge_s: float = 0.0             # kappa: what the solver charges per GPU changed
    charge_weight: float = 1.0                # the factor of the charges its weights put there
    in_place_charge_s: float = 0.0            # the same for a shrink that keeps its processes
    notes: tuple[str, ...] = ()               # the explanation, each part ending in its rule's name

    @property
    def asked(self) -> int | None:
        """The GPUs it asked for, for its share floor: Slurm's word (`submitted`), else, for a job first seen
        running, its metrics file's first row (None: neither)."""
        return self.submitted if self.submitted is not None else self.measured.metrics.first_gpus

    @property
    def biggest(self) -> int:
        return max(self.node_sizes, default=1)

    def nodes_for(self, gpus: int) -> int:
        return max(1, math.ceil(gpus / self.biggest))

    def placeable(self, gpus: int) -> bool:
        return gpus <= self.biggest or bool(spanning_widths(gpus, self.node_sizes,
                                                            self.policy.whole_nodes_when_spanning))

    def seconds_left(self, gpus: int) -> float | None:
        """The seconds its remaining work takes at `gpus` GPUs (None: no declared total, or no speed there).

        Its rows count steps at the batch it last ran at. At a fixed batch that is steps left / steps/s.
        An adaptive job's steps/s differ with the batch each size ran at (a small batch: many short
        steps), so its work left is counted in its goodput model's unit, samples of its base batch
        (steps left x the newest row's batch x that batch's statistical efficiency), over its goodput at
        `gpus`: whichever size and batch it runs at now, the same work is left.
        """
        m, model = self.measured.metrics, self.model
        if m.total_steps is None or m.step is None or self.steps_model is None or gpus <= 0:
            return None
        steps = max(m.total_steps - m.step, 0)
        if isinstance(model, GoodputThroughput) and m.batch is not None:
            work, rate = steps * m.batch * efficiency(m.batch, model.base_batch, model.noise), model
        else:
            work, rate = float(steps), self.steps_model
        speed = float(rate(gpus, self.nodes_for(gpus)))
        return work / speed if speed > 0 and math.isfinite(speed) else None

    @property
    def measured_speed(self) -> bool:
        """Its speed is measured and measured speeds are used."""
        return self.measured.metrics.model is not None and self.settings.measured_speed

    def with_(self, rule: Rule, *notes: str, **changes: object) -> JobContext:
        """This context with `changes`, and `notes` added to the explanation, each tagged with `rule`'s name."""
        if notes:
            changes["notes"] = self.notes + tuple(f"{n} [{rule.name}]" for n in notes)
        return dataclasses.replace(self, **changes)


class Rule(Protocol):
    name: ClassVar[str]

    def apply(self, ctx: JobContext) -> JobContext: ...


class SpeedModel:
    name = "speed"

    def apply(self, ctx: JobContext) -> JobContext:
        s, m = ctx.settings, ctx.measured.metrics
        if not ctx.measured_speed:
            return ctx.with_(self, f"speed not measured yet: default model (linear, {s.prior.node_penalty:.0%} "
                                   f"per extra node)" + (f"; metrics file ignored: {m.problem}" if m.problem else ""),
                             model=s.prior, steps_model=s.prior)
        assert m.model is not None
        pts = ", ".join(f"{g}:{v:.3g}" for g, v in m.speeds)
        notes = [f"speed measured ({m.rows} rows; GPUs:steps/s {pts})"]
        model: SpeedModelType = m.model
        batch, problem = ctx.measured.batch, ctx.measured.batch_problem
        if problem:
            notes.append(f"batch.json ignored ({problem}): plain speed")
        elif batch is not None and (m.samples is None or m.noise is None):
            notes.append("adaptive batch, but its rows carry no batch and gradient noise yet: plain speed")
        elif batch is not None:
            assert m.samples is not None and m.noise is not None
            model = GoodputThroughput(m.samples, m.local_batch_at, batch.min, batch.max, batch.base, m.noise)
        return ctx.with_(self, *notes, model=model, steps_model=m.model)


class BatchGeometry:
    name = "geometry"

    def apply(self, ctx: JobContext) -> JobContext:
        spec, job, geometry = ctx.job.spec, ctx.job, ctx.measured.geometry
        assert spec is not None
        counts = tuple(range(spec.min_gpus, spec.max_gpus + 1, spec.gpu_step))
        if geometry is None:
            return ctx.with_(self, counts=counts)
        # Only sizes the job's global batch splits over: any other size ends its ranks with exit 87.
        fits = tuple(g for g in counts if g in geometry.valid_world_sizes)
        valid = ", ".join(map(str, geometry.valid_world_sizes[:12]))
        notes = []
        bad = ""
        if job.state is JobState.RUNNING and job.gpus == geometry.world_size and geometry.stuck:
            bad = (f"bad geometry: its batch cannot be split over {job.gpus} GPUs (exit 87; valid "
                   f"{valid}): re-planned at once")
            notes.append(bad)
        if not fits:
            notes.append(f"no size in {spec.min_gpus}-{spec.max_gpus} splits its batch (valid {valid})")
        return ctx.with_(self, *notes, counts=fits or counts, fits=fits, bad_geometry=bad)


class AskedSize:
    """The size a job asked for (the GPUs Slurm showed it pending at) is worth one try: until measured
    there, it is credited linear from the nearest smaller size measured (on as many nodes), not what a fit
    over other sizes predicts. A fit through an unlucky size (3 GPUs that split the batch badly) otherwise
    kept a job below its request for good, beside idle GPUs: the size that would show the fit wrong was
    never run."""

    name = "asked-size"

    def apply(self, ctx: JobContext) -> JobContext:
        # Slurm's word only: a job first seen running "asked" for its first row's size, which its own file says
        asked = ctx.submitted
        if not (ctx.measured_speed and asked is not None and isinstance(ctx.model, MeasuredThroughput)
                and ctx.model is ctx.steps_model and ctx.model.predicted is not None):
            return ctx
        ran = {p.gpus for p in ctx.model.predicted.measured}
        if asked in ran or asked < min(ran):
            return ctx
        predicted = dataclasses.replace(ctx.model.predicted, optimistic=frozenset({asked}))
        model = dataclasses.replace(ctx.model, predicted=predicted)
        return ctx.with_(self, f"asked {asked} GPUs, never run there: credited linear from the nearest size "
                               f"measured until it is", model=model, steps_model=model)


class SpeedFrontier:
    name = "speed-frontier"

    def apply(self, ctx: JobContext) -> JobContext:
        s = ctx.settings
        allowed = None
        notes = []
        if ctx.measured_speed:
            assert ctx.model is not None
            allowed = speed_frontier(ctx.counts, ctx.model, ctx.nodes_for, ctx.placeable, s.min_marginal_gain)
            if allowed and max(allowed) < max((g for g in ctx.counts if ctx.placeable(g)), default=0):
                notes.append(f"allowed up to {max(allowed)} GPUs: no larger count is faster in its measured speed "
                             f"model (by {s.min_marginal_gain:.0%} of an average GPU's speed per GPU added)")
        if allowed is None and ctx.fits:
            allowed = ctx.fits
        return ctx.with_(self, *notes, allowed=allowed)


class MeasureFirst:
    name = "measure-first"

    def apply(self, ctx: JobContext) -> JobContext:
        s, job = ctx.settings, ctx.job
        started = job.start_time if job.start_time is not None else ctx.now
        if not (s.measured_speed and ctx.measured.metrics.model is None and job.state is JobState.RUNNING
                and ctx.measured.metrics.problem == "" and not ctx.bad_geometry
                and ctx.now - started < s.measure_first_s and not ctx.yielding):
            return ctx
        # A job that has just started keeps its size until its first rows exist, so every job is measured
        # at the size it asked for before it is moved. A size the shape rule cannot place (6 GPUs as 2 x 3
        # on 4-GPU nodes) cannot be kept: pinned to it, the job had no placeable count and went back to the
        # queue at its minimum (1 GPU, on an empty cluster), and was measured there. So it is kept at the
        # placeable counts nearest its size instead.
        keep = nearest_placeable(job.gpus, ctx.counts, ctx.placeable)
        if not keep:
            return ctx
        at = (f"{job.gpus} GPUs" if keep == (job.gpus,) else
              f"{' or '.join(map(str, keep))} GPUs ({job.gpus} is no shape Slurm is given here)")
        wait = (f"kept at {at} until measured (started {ctx.now - started:.0f}s ago, "
                f"{s.measure_first_s - (ctx.now - started):.0f}s left)")
        return ctx.with_(self, wait, allowed=keep, wait=wait)


class ShareFloor:
    name = "share-floor"

    def apply(self, ctx: JobContext) -> JobContext:
        job, asked = ctx.job, ctx.asked
        if not (ctx.settings.share_floor and job.state is JobState.RUNNING and not ctx.bad_geometry
                and asked is not None and job.gpus > 0 and not ctx.wait and not ctx.yielding):
            return ctx
        floor = min(asked, ctx.share, job.gpus)
        pool = tuple(ctx.allowed if ctx.allowed is not None else ctx.counts)
        # The floor is the largest size it can take at or under that bound, not the next one above:
        # rounded up (a share of 5 on a 4-GPU step is 8), the floors of two jobs took all 16 GPUs and
        # left the third its share of nothing. Rounded down, the floors never sum past what is usable.
        floor = max((g for g in pool if g <= floor and ctx.placeable(g)), default=floor)
        keep = tuple(g for g in pool if g >= floor)
        if floor < 1 or not keep:
            return ctx
        return ctx.with_(self, f"kept at >= {floor} GPUs while it runs: min(asked {asked}, fair share "
                               f"{ctx.share}, holds {job.gpus})", allowed=keep, floor=floor)


class GoodputNote:
    """Says, for an adaptive job, the batch and goodput at each size it may take (decides nothing)."""

    name = "goodput"

    def apply(self, ctx: JobContext) -> JobContext:
        model = ctx.model
        if not isinstance(model, GoodputThroughput):
            return ctx
        shown = ", ".join(f"{g}:{model.batch_for(g, ctx.nodes_for(g))[0]}@{model(g, ctx.nodes_for(g)):.3g}"
                          for g in (ctx.allowed or ctx.counts) if ctx.placeable(g))
        return ctx.with_(self, f"goodput at the best batch (GPUs:batch@goodput {shown}; noise scale "
                               f"{model.noise.noise_scale:.3g}, base batch {model.base_batch})")


class RestartCost:
    name = "restart-cost"

    def apply(self, ctx: JobContext) -> JobContext:
        # Per path: a shrink that keeps the processes costs a few seconds, a relaunch tens; one median over
        # both charged a grow (always a relaunch) as if it were cheap.
        m, s = ctx.measured.metrics, ctx.settings
        restart, in_place = m.restart_cost_s, m.in_place_cost_s
        said = (f"restart {restart:.0f}s measured ({len(m.restart_costs_s)} relaunches)" if restart is not None
                else f"restart {s.default_restart_cost_s:.0f}s (default; no relaunch measured)")
        restart = restart if restart is not None else s.default_restart_cost_s
        if in_place is None:
            in_place = min(s.default_in_place_cost_s, restart)
            said += f", in place {in_place:.0f}s (default)"
        else:
            in_place = min(in_place, restart)      # the relaunch path is always there instead
            said += f", in place {in_place:.1f}s measured ({len(m.in_place_costs_s)})"
        return ctx.with_(self, said, restart_s=restart, in_place_s=in_place)


class RemainingWork:
    name = "remaining-work"

    def apply(self, ctx: JobContext) -> JobContext:
        s, m = ctx.settings, ctx.measured.metrics
        left = [t for g in (ctx.allowed or ctx.counts) if ctx.placeable(g)
                for t in (ctx.seconds_left(g),) if t is not None]
        if m.total_steps is None or m.step is None or not left:
            return ctx.with_(self, "remaining work unknown (no total_steps)", weight=1.0)
        left_s = min(left)
        lo, hi = s.weight_range
        weight = quantised(min(hi, max(lo, (s.weight_horizon_s / max(left_s, 1e-9)) ** s.weight_exponent)),
                           s.weight_quantum)
        return ctx.with_(self, f"{m.total_steps - m.step} of {m.total_steps} steps left, ~{left_s:.0f}s at its best",
                         weight=weight)


class Starvation:
    name = "starvation"

    def apply(self, ctx: JobContext) -> JobContext:
        if ctx.waiting_s < ctx.settings.starve_after_s:
            return ctx
        return ctx.with_(self, f"waited {ctx.waiting_s:.0f}s without GPUs: must run", must_run=True,
                         commitment=Commitment.STARVING, weight=max(ctx.weight, 1.0))


class FloorHolds:
    """The share floor holds against zero too (the solver gives it up, in rank order, only if nothing fits)."""

    name = "share-floor"

    def apply(self, ctx: JobContext) -> JobContext:
        if ctx.floor < 1:
            return ctx
        return ctx.with_(self, must_run=True, commitment=Commitment.SHARE_FLOOR)


class RestartCharge:
    name = "restart-charge"

    def apply(self, ctx: JobContext) -> JobContext:
        s, spec, policy = ctx.settings, ctx.job.spec, ctx.policy
        assert spec is not None
        # beta * kappa per GPU changed = the share of the throughput term a restart of `restart` seconds
        # loses over a size held `hold_s` (linear approximation), at this job's weight but never below the
        # neutral 1: scaled by a small remaining-time weight, restarts of long jobs were nearly free and
        # they were resized again and again (yolov3: 27 restarts each on workload 1).
        total_w = ctx.own_weight * ctx.weight
        charge_w = ctx.own_weight * max(ctx.weight, 1.0)
        # The hold is at least measure_first_s: a restarted job keeps its new size until it has measured
        # there, and a charge spread over a hysteresis of 0 s would be infinite (no resize, ever).
        hold = max(s.hold_s if s.charge_horizon_s is None else s.charge_horizon_s, s.measure_first_s)
        per_second = charge_w / (policy.beta * hold * spec.max_gpus) if policy.beta > 0 else 1.0
        own = f" (--weight {spec.weight:g}: {ctx.own_weight:.3g} among its user's jobs)" if spec.weight != 1 else ""
        return ctx.with_(self, f"weight {total_w:.3g}{own}", charge_weight=charge_w,
                         restart_charge_s=ctx.restart_s * per_second, in_place_charge_s=ctx.in_place_s * per_second)


# The order they apply in (see the module docstring for why it matters).
RULES: tuple[Rule, ...] = (
    SpeedModel(),
    BatchGeometry(),
    AskedSize(),
    SpeedFrontier(),
    MeasureFirst(),
    ShareFloor(),
    GoodputNote(),
    RestartCost(),
    RemainingWork(),
    Starvation(),
    FloorHolds(),
    RestartCharge(),
)


def apply_rules(ctx: JobContext, rules: Sequence[Rule] = RULES) -> JobContext:
    """`ctx` after every rule in order."""
    for rule in rules:
        ctx = rule.apply(ctx)
    return ctx


def nearest_placeable(gpus: int, counts: Sequence[int], placeable: Callable[[int], bool]) -> tuple[int, ...]:
    """`gpus` when it is an allowed count the shape rule can place; else the nearest such counts below and
    above it (either may be missing); () when no allowed count is placeable."""
    ok = [c for c in counts if placeable(c)]
    if gpus in ok:
        return (gpus,)
    below = [c for c in ok if c < gpus]
    above = [c for c in ok if c > gpus]
    return tuple(([max(below)] if below else []) + ([min(above)] if above else []))


def quantised(weight: float, quantum: float) -> float:
    """The weight in steps of 2^quantum (19 % at 1/4), so that it changes only when the remaining time does
    by that much; a quantum of 0 (as shipped: the ablation found the steps did not pay) leaves it exact."""
    if quantum <= 0:
        return weight
    return 2.0 ** (round(math.log2(weight) / quantum) * quantum)
