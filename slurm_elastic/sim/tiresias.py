"""Tiresias (NSDI'19): discretised two-dimensional least-attained-service, preemptive, fixed job sizes."""

from __future__ import annotations

from slurm_elastic.sim.policy import ClusterView, Decision, FreeResources, JobView

# The Pollux simulator's setting: one threshold at 16 GPU-hours, no starvation promotion.
DEFAULT_THRESHOLDS_GPU_S = (3600.0 * 16,)


class TiresiasPolicy:
    """Jobs sit in queues by attained service (GPUs x time held); lower queues first, FIFO inside a queue.

    At each scheduling point the queues are walked in priority order and a
    job is admitted when its requested GPUs still fit in the cluster's
    total; jobs that are not admitted are preempted. Admitted running jobs
    keep their placement; newly admitted ones get consolidated placements.
    `starvation_ratio` > 0 promotes a job back to the first queue after it
    waited `ratio x` the time it last ran (Tiresias' STARVELIMIT; off by
    default, as in the Pollux artifact).
    """

    name = "tiresias"

    def __init__(self, thresholds_gpu_s: tuple[float, ...] = DEFAULT_THRESHOLDS_GPU_S,
                 starvation_ratio: float = 0.0) -> None:
        self.thresholds = tuple(sorted(thresholds_gpu_s))
        self.starvation_ratio = starvation_ratio
        self._promoted_at: dict[str, float] = {}  # key -> attained service when last promoted
        self._waiting_since: dict[str, float] = {}
        self._ran_for: dict[str, float] = {}
        self._last_now = 0.0

    def queue_of(self, jv: JobView) -> int:
        service = jv.attained_gpu_s - self._promoted_at.get(jv.key, 0.0)
        return sum(service >= t for t in self.thresholds)

    def decide(self, view: ClusterView) -> Decision:
        jobs = {j.key: j.job for j in view.jobs}
        notes: list[str] = []
        self._track_starvation(view, notes)
        order = sorted(view.jobs, key=lambda j: (self.queue_of(j), j.job.submit_s, j.key))
        capacity = sum(n.gpus for n in view.nodes)
        admitted: list[JobView] = []
        for jv in order:
            if jv.job.requested_gpus <= capacity:
                admitted.append(jv)
                capacity -= jv.job.requested_gpus
        keep = {j.key: dict(j.placement) for j in admitted if j.placement}
        free = FreeResources.of(view.nodes, keep, jobs)
        placements: dict[str, dict[str, int]] = dict(keep)
        for jv in view.jobs:
            if jv.placement and jv.key not in keep:
                notes.append(f"preempt {jv.key} (queue {self.queue_of(jv)})")
        for jv in admitted:
            if jv.key in keep:
                continue
            placement = free.place(jv.job, jv.job.requested_gpus)
            if placement is None:
                continue  # GPUs counted free but CPUs/memory do not fit; it waits
            placements[jv.key] = placement
            notes.append(f"start {jv.key} ({jv.job.requested_gpus} GPUs, queue {self.queue_of(jv)})")
        return Decision(placements, tuple(notes))

    def _track_starvation(self, view: ClusterView, notes: list[str]) -> None:
        if self.starvation_ratio <= 0:
            return
        for jv in view.jobs:
            if jv.placement:
                self._waiting_since.pop(jv.key, None)
                self._ran_for[jv.key] = jv.executed_s
                continue
            since = self._waiting_since.setdefault(jv.key, view.now)
            ran = self._ran_for.get(jv.key, 0.0)
            if ran > 0 and self.queue_of(jv) > 0 and view.now - since >= self.starvation_ratio * ran:
                self._promoted_at[jv.key] = jv.attained_gpu_s
                self._waiting_since[jv.key] = view.now
                notes.append(f"promote {jv.key} to queue 0 (starved {view.now - since:.0f} s)")
