"""Optimus (EuroSys'18) with an oracle speed model: elastic GPU counts by greedy marginal gain, fixed batch."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from slurm_elastic.sim.jobs import packed_placement
from slurm_elastic.sim.policy import ClusterView, Decision, FreeResources, JobView


@runtime_checkable
class OptimusOracle(Protocol):
    """What the original's Optimus+Oracle knows of a job, where it differs from the truth the engine runs.

    The Pollux artifact's Optimus counts the iterations left in whole epochs
    of the validation trace (not statistical progress) and predicts step
    times with its own rules (sim/pollux.py PolluxSpeed); a speed model that
    offers these is scheduled by them, any other by its true remaining time.
    """

    def oracle_remaining(self, done: float) -> float: ...

    def oracle_step_time(self, gpus: int, gpus_per_node: int) -> float: ...


class OptimusPolicy:
    """Every job gets its minimum (one GPU for Pollux jobs; in submission order while GPUs last); each further GPU goes to the
    job whose remaining time shrinks most by it: remaining work x (step time at g - step time at g+1).

    As in the Pollux artifact's Optimus+Oracle: the speed at a GPU count is
    the true one (packed placement), the batch stays fixed, a job's maximum
    is its own bound (for Pollux jobs batch // smallest per-GPU batch), and a
    job whose count is unchanged keeps its placement.
    """

    name = "optimus"

    def decide(self, view: ClusterView) -> Decision:
        gpn = view.gpus_per_node
        jobs = {j.key: j.job for j in view.jobs}
        left = sum(n.gpus for n in view.nodes)
        count: dict[str, int] = {}
        for jv in view.jobs:
            count[jv.key] = jv.job.min_gpus if left >= jv.job.min_gpus else 0
            left -= count[jv.key]
        gain = {jv.key: self._gain(jv, count[jv.key], gpn) for jv in view.jobs}
        views = {jv.key: jv for jv in view.jobs}
        while left > 0 and gain and max(gain.values()) > 0:
            key = max(gain, key=lambda k: (gain[k], -views[k].job.submit_s))
            count[key] += 1
            left -= 1
            gain[key] = self._gain(views[key], count[key], gpn)
        keep = {jv.key: dict(jv.placement) for jv in view.jobs if jv.placement and jv.gpus == count[jv.key]}
        free = FreeResources.of(view.nodes, keep, jobs)
        placements: dict[str, dict[str, int]] = dict(keep)
        notes = []
        for jv in sorted(view.jobs, key=lambda j: (count[j.key], j.job.submit_s)):
            g = count[jv.key]
            if jv.key in keep or g == 0:
                continue
            placement = free.place(jv.job, g)
            if placement is None:
                continue
            placements[jv.key] = placement
            notes.append(f"{jv.key}: {jv.gpus} -> {g} GPUs")
        return Decision(placements, tuple(notes))

    @staticmethod
    def _gain(jv: JobView, g: int, gpn: int) -> float:
        if g == 0 or g + 1 > jv.job.max_gpus:
            return 0.0
        oracle = jv.job.speed
        if isinstance(oracle, OptimusOracle):
            left = oracle.oracle_remaining(jv.job.work - jv.remaining)
            return (oracle.oracle_step_time(g, gpn) - oracle.oracle_step_time(g + 1, gpn)) * left
        now_s = jv.remaining_s(packed_placement(g, gpn))
        more_s = jv.remaining_s(packed_placement(g + 1, gpn))
        return now_s - more_s
