"""Slurm's default: FIFO by submission with EASY backfill, each job at its requested GPUs until it ends."""

from __future__ import annotations

from slurm_elastic.sim.jobs import packed_placement
from slurm_elastic.sim.policy import ClusterView, Decision, FreeResources, JobView


class StaticPolicy:
    """Non-preemptive FIFO; the first job that does not fit gets a reservation (the "shadow time").

    Later jobs start early only if they fit now and either end before the
    shadow time or use only GPUs the reserved job will not need (EASY
    backfill). Run times are known exactly (the best case for backfill: real
    Slurm sees user time limits). A job killed by a node failure goes back
    to the queue in its submission place, as Slurm's requeue keeps its age.
    """

    name = "static"

    def decide(self, view: ClusterView) -> Decision:
        jobs = {j.key: j.job for j in view.jobs}
        running = {j.key: dict(j.placement) for j in view.jobs if j.placement}
        free = FreeResources.of(view.nodes, running, jobs)
        placements: dict[str, dict[str, int]] = dict(running)
        notes: list[str] = []
        shadow: float | None = None
        spare = 0
        gpn = view.gpus_per_node
        for jv in view.jobs:
            if jv.placement:
                continue
            want = jv.job.requested_gpus
            if shadow is None:
                placement = free.place(jv.job, want, best_fit=True)
                if placement is not None:
                    placements[jv.key] = placement
                    notes.append(f"start {jv.key} ({want} GPUs, FIFO)")
                    continue
                shadow, spare = _reservation(view, jv, free.total_usable(jv.job), gpn)
                notes.append(f"reserve for {jv.key} ({want} GPUs) at t={shadow:.0f}")
                continue
            if free.total_usable(jv.job) < want:
                continue
            ends = view.now + jv.remaining_s(packed_placement(want, gpn))
            if ends <= shadow or want <= spare:
                placement = free.place(jv.job, want, best_fit=True)
                if placement is None:
                    continue
                placements[jv.key] = placement
                if ends > shadow:
                    spare -= want
                notes.append(f"backfill {jv.key} ({want} GPUs)")
        return Decision(placements, tuple(notes))


def _reservation(view: ClusterView, head: JobView, free_now: int, gpn: int) -> tuple[float, int]:
    """When enough running jobs will have ended for `head`, and the GPUs left over then."""
    want = head.job.requested_gpus
    ends = sorted((view.now + j.remaining_s(tuple(sorted(j.placement.values(), reverse=True))), j.gpus)
                  for j in view.jobs if j.placement)
    available = free_now
    for end, gpus in ends:
        available += gpus
        if available >= want:
            return end, available - want
    # Not even an empty cluster holds it now (nodes are down): nothing may jump the queue by size.
    return float("inf"), 0
