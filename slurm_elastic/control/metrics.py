"""Prometheus metrics of the controller (prometheus_client, one registry per controller)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from slurm_elastic.errors import ElasticError

if TYPE_CHECKING:
    from slurm_elastic.control.metrics_http import BoundedServer
    from slurm_elastic.control.reconcile import CycleReport

log = logging.getLogger(__name__)

# Metrics describe every user's jobs: exposed beyond the host only when the admin says so.
DEFAULT_METRICS_ADDR = "127.0.0.1"


class ControllerMetrics:
    """Cycle and solve time, MIP gap, plans, restarts per job, GPUs allocated vs free, node events, GPUs given
    back to pending rigid jobs."""

    def __init__(self) -> None:
        # Imported here: prometheus_client is the 'daemon' extra, and the CLI must start without it.
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.cycle_seconds = Histogram("slurm_elastic_cycle_seconds", "Reconcile cycle duration",
                                       registry=r, buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.solve_seconds = Histogram("slurm_elastic_solve_seconds", "Allocation solve duration",
                                       registry=r, buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30))
        self.mip_gap = Gauge("slurm_elastic_mip_gap", "Relative MIP gap of the last solve", registry=r)
        self.plans = Counter("slurm_elastic_plans_total", "Resize plans by outcome", ["outcome"], registry=r)
        self.restarts = Counter("slurm_elastic_job_restarts_total", "Restarts the controller caused",
                                ["job_id"], registry=r)
        self.gpus = Gauge("slurm_elastic_gpus", "GPUs by kind (total on up nodes, allocated to elastic "
                          "jobs, free)", ["kind"], registry=r)
        self.node_events = Counter("slurm_elastic_node_events_total", "Nodes lost or gained", ["kind"],
                                   registry=r)
        self.elastic_jobs = Gauge("slurm_elastic_jobs", "Elastic jobs by state", ["state"], registry=r)
        self.cycle_errors = Counter("slurm_elastic_cycle_errors_total", "Cycles that failed", registry=r)
        self.rigid_gpus = Gauge("slurm_elastic_rigid_gpus_given_back", "GPUs elastic jobs give back to pending "
                                "rigid jobs this cycle", registry=r)
        self.rigid_jobs = Gauge("slurm_elastic_rigid_jobs", "Pending rigid jobs elastic jobs give GPUs back to "
                                "(given) or not (waiting: protected minimums, or no fit)", ["status"], registry=r)

    def observe(self, report: CycleReport) -> None:
        self.cycle_seconds.observe(report.cycle_s)
        if report.allocation is not None:
            self.solve_seconds.observe(report.allocation.solve_s)
            self.mip_gap.set(report.allocation.mip_gap)
        held_only = {p.job_id for p in report.plans if p.keeps_queued}   # not resizes (control/plan.py)
        for outcome in report.outcomes:
            if outcome.job_id not in held_only:
                self.plans.labels(outcome.status).inc()
        for plan in report.plans:
            if plan.entry.value == "running" and not report.dry_run:
                self.restarts.labels(str(plan.job_id)).inc()
        if report.rigid is not None:
            self.rigid_gpus.set(sum(r.gpus_reclaimed for r in report.rigid.reserved))
            self.rigid_jobs.labels("given").set(sum(r.gpus_reclaimed > 0 for r in report.rigid.reserved))
            self.rigid_jobs.labels("waiting").set(len(report.rigid.waiting))
        self.gpus.labels("total").set(report.gpus_total)
        self.gpus.labels("allocated").set(report.gpus_elastic)
        self.gpus.labels("free").set(report.gpus_free)
        for kind, count in (("lost", len(report.nodes_lost)), ("gained", len(report.nodes_gained))):
            if count:
                self.node_events.labels(kind).inc(count)
        counts: dict[str, int] = {}
        for state in report.job_states.values():
            counts[state] = counts.get(state, 0) + 1
        for state in ("RUNNING", "PENDING"):
            self.elastic_jobs.labels(state).set(counts.get(state, 0))

    def serve(self, port: int, addr: str = DEFAULT_METRICS_ADDR) -> "BoundedServer":
        """Serve /metrics on addr:port (control/metrics_http.py); loopback unless the admin names another address."""
        from slurm_elastic.control import metrics_http

        try:
            server = metrics_http.serve(self.registry, port, addr)
        except (OSError, ValueError) as exc:   # socket.gaierror is an OSError
            raise ElasticError(f"cannot serve metrics on {addr}:{port}: {exc}") from None
        log.info("metrics on http://%s:%d/metrics", addr, port)
        return server
