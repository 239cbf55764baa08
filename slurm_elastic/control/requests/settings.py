"""The request source's settings: how measurements become requests (each default written here once)."""

from __future__ import annotations

from dataclasses import dataclass

from slurm_elastic.allocate.from_state import DEFAULT_RESTART_COST_S
from slurm_elastic.allocate.throughput import LinearThroughput
from slurm_elastic.settings import HYSTERESIS, OBJECTIVE, SPEED

# Less time that did no steps between two metrics rows is clock noise, not a restart (the metrics tail keeps
# only the intervals above it, so that a job's restarts are not pushed out by its ordinary rows).
RESTART_MIN_S = 2.0
DEFAULT_IN_PLACE_COST_S = 5.0


@dataclass(frozen=True, slots=True)
class RequestSettings:
    """How measurements become requests (the defaults are written here once)."""

    default_restart_cost_s: float = DEFAULT_RESTART_COST_S
    # a resize whose ranks go on in their processes, until the job has measured one (docs/controller.md)
    default_in_place_cost_s: float = DEFAULT_IN_PLACE_COST_S
    weight_horizon_s: float = 3600.0          # remaining H seconds => weight 1
    weight_range: tuple[float, float] = (0.05, 20.0)
    weight_exponent: float = 1.0              # w = clamp((H / remaining)^e): below 1 the span narrows (ablation)
    weight_quantum: float = 0.0               # >0: weights in steps of 2^quantum (rules.quantised; for the ablation)
    hold_s: float = HYSTERESIS.default        # a new size is kept at least this long (the controller's hysteresis)
    charge_horizon_s: float | None = None     # the restart charge spread over this long (None: the hold; ablation)
    starve_after_s: float = 1800.0            # waiting longer without GPUs => must run
    share_floor: bool = True                  # a running job keeps min(asked, fair share, current) (rules.ShareFloor)
    max_restart_cost_s: float = 600.0         # a longer gap between rows was a wait in the queue, not a restart
    measure_first_s: float = 300.0            # a job just started keeps its size this long unless measured
    restart_min_s: float = RESTART_MIN_S      # less lost time between two rows is noise, not a restart
    metrics_max_bytes: int = 1 << 20          # only the file's last MiB is read
    geometry_max_bytes: int = 1 << 14         # geometry.json is a few hundred bytes; more is not the shim's
    batch_max_bytes: int = 1 << 12            # batch.json is three numbers
    min_marginal_gain: float = 0.05           # a GPU gaining less than 5 % of an average one's speed is noise
    prior: LinearThroughput = LinearThroughput()
    # Sizes never run are predicted by the job's fitted step-time model (allocate.stepmodel); False: the
    # capped extrapolation of MeasuredThroughput (kept for the ablation).
    predict_unmeasured: bool = True
    explore_discount: float = 0.0             # eta: a predicted gain beyond the largest size measured counts (1 - eta);
                                              # 0: in full (docs/simulator.md: the ablation found 0.25 did not pay)
    # False: speed from the prior even when rows exist - for GPUs that are not real (the demo's fake GPUs
    # share a few CPU cores, so more "GPUs" measure slower); restart cost and remaining work stay measured.
    measured_speed: bool = SPEED.default == "measured"
    objective: str = OBJECTIVE.default        # "legacy": the rule chain (rules.py); "progress": progress.py
    ftf_target: float = 2.0                   # progress: a job is at risk past this x its fair-share finish time
