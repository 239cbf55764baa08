"""The job/controller contract: the names and typed records a job and the controller exchange (stdlib only).

The shim, the simulated shim, the controller, the in-memory Slurm and the
CLI all take these from here; nothing here imports torch, numpy or the solver.
"""

from __future__ import annotations

from slurm_elastic.jobfiles.metrics import MetricsCursor, MetricsRead, MetricsRow, parse_row, read_metrics
from slurm_elastic.jobfiles.names import (BATCH_ENV, BATCH_FILE, CKPT_DIR_ENV, DECISION_FILE, DEFAULT_SIGNAL, END_CAUSES,
                                          GEOMETRY_EXIT_CODE, GEOMETRY_FILE, JOB_KEY_ENV, KEEPS_RANKS_PREFIX, LATEST_FILE,
                                          LAUNCHER_STOPPED_PREFIX, LOST_FILE, MANIFEST_FILE, METRICS_FILE,
                                          PEER_LOST_EXIT_CODE, PEER_LOST_PREFIX, RANKS_KEPT, REGROUP_FILE, RELAUNCHES_IN_PLACE,
                                          RENDEZVOUS_FILE, REQUEUE_EXIT_CODE, RUN_DIR_PREFIX, SIGNAL_ENV,
                                          STEP_DIR_PREFIX, ack_file_name, ack_path, batch_path, end_cause_file_name, exited_file_name,
                                          geometry_path,
                                          heartbeat_file_name, job_dir, job_key, keeps_ranks_file_name, launcher_stopped_file_name,
                                          metrics_path, parse_peer_lost_file_name, parse_run_dir_name,
                                          parse_step_dir_name, peer_lost_file_name, ready_file_name, run_dir_name, signal_name,
                                          status_file_name, step_dir_name, valid_node_name)
from slurm_elastic.jobfiles.peer_lost import (COMMIT_STATES, DETECTORS, PEER_LOST_FORMAT, LostRank,
                                              PeerLostReport)
from slurm_elastic.jobfiles.reading import load_json, read_record, read_user_file
from slurm_elastic.jobfiles.records import (ACK_MAX_BYTES, BATCH_MAX_BYTES, END_CAUSE_MAX_BYTES, GEOMETRY_MAX_BYTES,
                                            HEARTBEAT_MAX_BYTES, Ack, BatchRange, Geometry, Heartbeat, LauncherStopped,
                                            parse_end_cause, read_end_cause)

__all__ = [name for name in dir() if not name.startswith("_") and name != "annotations"]
