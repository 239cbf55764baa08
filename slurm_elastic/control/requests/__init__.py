"""The request source, split by responsibility: `measuring` reads what each job measured into a typed
Measurement, `rules` turns it into a JobRequest by named rules in one declared order (RULES), and
`source` (MeasuredRequests) runs both each cycle and returns one Requests record. The names other
packages use are re-exported here."""

from __future__ import annotations

from slurm_elastic.control.requests.measuring import (BATCH_FILE, JobMeasurements, Measurement, MetricsTail, measure,
                                                      owner_uid, read_batch_range, read_job_geometry,
                                                      read_job_metrics, validate_row)
from slurm_elastic.control.requests.rules import RULES, JobContext, Rule, nearest_placeable, quantised
from slurm_elastic.control.requests.settings import RequestSettings
from slurm_elastic.control.requests.source import (MeasuredRequests, ProgressRequests, Requests, RequestSource,
                                                   default_request_source,
                                                   fair_shares, with_basis)

__all__ = ["BATCH_FILE", "JobContext", "JobMeasurements", "MeasuredRequests", "Measurement", "MetricsTail",
           "ProgressRequests",
           "RULES", "RequestSettings", "RequestSource", "Requests", "Rule", "default_request_source",
           "fair_shares", "measure", "nearest_placeable", "owner_uid", "quantised", "read_batch_range", "read_job_geometry",
           "read_job_metrics", "validate_row", "with_basis"]
