"""The job's word on a lost node: its peer-lost report, read as its user's data and used for that job only.

The training shim's survivors write `<job dir>/peer-lost-<job id>-<restart>-<step>.json`
(jobfiles/peer_lost.py, PeerLostReport) within seconds of losing a peer, long before Slurm marks a
silent node DOWN (SlurmdTimeout, often 300 s). The controller believes such a report only as far
as it concerns the job that wrote it:

- the file is opened without following links or blocking, must be a regular file owned by the
  job's user and at most MAX_REPORT_BYTES, and every field is validated (PeerLostReport.parse);
- it must name this job and its current incarnation (Slurm's restart count), so an old report
  never restarts the job again;
- its lost nodes must be nodes the job runs on now, and not all of them (the survivors wrote it);
- only the first STEPS_PROBED srun steps of an incarnation are looked at (one open each, no
  directory listing, so a huge job directory costs nothing).

What follows from a report is only that the job restarts without those nodes (ExcNodeList for
that job); draining a node on a job's word is the admin's choice (`admin daemon
--drain-on-peer-loss`), bounded per user.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from slurm_elastic.cluster.model import ClusterState, Job, JobState
from slurm_elastic.jobfiles import LauncherStopped, read_record, read_user_file
from slurm_elastic import jobfiles as shim

log = logging.getLogger(__name__)

MAX_REPORT_BYTES = 64 * 1024   # a report is well under 1 KiB per lost rank; more is not the shim's
STEPS_PROBED = 8               # srun steps per incarnation looked at (the templates run one)
SETTLED = ("done", "failed", "none")
# what PeerLoss.launcher_stopped() says besides ""
STOPPED, IN_PLACE, KEPT = "stopped", shim.RELAUNCHES_IN_PLACE, shim.RANKS_KEPT


@dataclass(frozen=True, slots=True)
class PeerLoss:
    """A validated report of one job's current incarnation, with when this controller first saw it."""

    job_id: int
    user: str
    restarts: int
    step_id: int
    lost_nodes: tuple[str, ...]
    surviving_nodes: tuple[str, ...]   # the job's nodes not reported lost (from Slurm, not the report)
    commit: str                        # pending | done | failed | none
    committed_step: int | None
    detected_at: float                 # the job's clock: shown, never used to decide
    seen_at: float                     # the controller's clock
    path: str
    stopped_at: float | None = None    # the last survivor's status file (it stopped stepping); shown only
    committed_at: float | None = None  # the report replaced with commit "done"; shown only
    launcher_marker: str = ""          # where the batch script says it stopped the step's srun
    owner_uid: int | None = None

    def launcher_stopped(self) -> str:
        """What the batch script said about this step's srun (jobfiles/names.py, launcher-stopped-J-R-S):
        "" nothing (it may still run: the release waits KillWait), STOPPED (SIGKILLed: no cancel of it can
        reach the next incarnation), IN_PLACE (stopped, and the script relaunches the ranks if the
        running job is shrunk instead of requeued) or KEPT (the survivors went on in their processes: the
        script goes on in place, its srun still running). Read when asked: the script writes it moments
        after the report settles."""
        if not self.launcher_marker or self.owner_uid is None:
            return ""
        return _launcher_said(self.launcher_marker, self.owner_uid)

    def marks(self) -> dict[str, float]:
        """The restart's marks this report gives (control/phases.py)."""
        out = {"detected": self.detected_at, "stopped": self.stopped_at, "committed": self.committed_at}
        return {k: v for k, v in out.items() if v is not None}

    @property
    def settled(self) -> bool:
        """The survivors' just-in-time commit is over: requeuing cannot cut it short."""
        return self.commit in SETTLED

    def describe(self) -> str:
        what = {"done": f"committed step {self.committed_step}", "failed": "its commit failed",
                "none": "nothing to commit (no full replica)", "pending": "commit pending"}[self.commit]
        return f"its ranks lost {','.join(self.lost_nodes)} (step {self.step_id}; {what})"


def read_report(path: str, *, owner_uid: int, max_bytes: int = MAX_REPORT_BYTES
                ) -> tuple[shim.PeerLostReport | None, str]:
    """The report at `path` if it can be believed as the job user's file, and a problem ("" when none or absent)."""
    return read_record(path, shim.PeerLostReport.from_value, owner_uid=owner_uid, max_bytes=max_bytes,
                       what="a report")


def check_against_job(report: shim.PeerLostReport, job: Job) -> str:
    """Why the report does not speak for this job's current incarnation ("" when it does)."""
    if report.job_id != str(job.job_id):
        return f"names job {report.job_id}"
    if report.restart_count != job.restarts:
        return f"is about restart {report.restart_count}, the job is at restart {job.restarts}"
    if not report.lost_nodes:
        return "names no lost node"
    foreign = sorted(set(report.lost_nodes) - set(job.nodes))
    if foreign:
        return f"names nodes the job does not run on ({','.join(foreign)})"
    if set(job.nodes) <= set(report.lost_nodes):
        return "says every node of the job was lost (its survivors wrote it)"
    return ""


class PeerLossReader:
    """Finds each running elastic job's report for its current incarnation, once per cycle."""

    def __init__(self, *, clock: Callable[[], float] = time.time, uid_of: Callable[[str], int | None] | None = None,
                 steps_probed: int = STEPS_PROBED) -> None:
        self._clock = clock
        self._uid_of = uid_of or _uid_of
        self._steps = steps_probed
        self._seen: dict[tuple[int, int, int], float] = {}
        self._said: dict[str, str] = {}

    def losses(self, state: ClusterState) -> dict[int, PeerLoss]:
        """Job id -> the loss its ranks reported for the incarnation running now (jobs of `state` only)."""
        out: dict[int, PeerLoss] = {}
        live: set[tuple[int, int, int]] = set()
        for job in state.elastic_jobs:
            try:
                loss = self._loss(job, live)
            except Exception as exc:
                # The files are the job user's input: whatever reading them raises costs this job its
                # report this cycle, never the cycle.
                self._say(f"job {job.job_id}", f"job {job.job_id}: its peer-lost reports could not be read "
                          f"({exc!r:.200}); ignored")
                continue
            if loss is not None:
                out[job.job_id] = loss
        self._seen = {k: v for k, v in self._seen.items() if k in live}
        return out

    def _loss(self, job: Job, live: set[tuple[int, int, int]]) -> PeerLoss | None:
        """The loss `job`'s ranks reported for its current incarnation (its key added to `live`), or None."""
        if job.state is not JobState.RUNNING or len(job.nodes) < 2:
            return None   # a single-node job has no other node to restart on without the lost one
        found = self._job_files(job)
        if found is None:
            return None
        directory, uid = found
        for step in range(self._steps):
            path = os.path.join(directory, shim.peer_lost_file_name(job.job_id, job.restarts, step))
            report, problem = read_report(path, owner_uid=uid)
            given_up = False
            if report is not None:
                problem = check_against_job(report, job)
                if problem and report.job_id == str(job.job_id) and report.restart_count == job.restarts \
                        and not set(report.lost_nodes) & set(job.nodes):
                    # A loss whose nodes a shrink in place already gave up (after a lost node, or the nodes a
                    # rebalance took), or nodes the job never ran on: nothing to act on, and said once.
                    problem = f"names only nodes the job does not run on now ({','.join(report.lost_nodes)})"
                    given_up = set(report.surviving_nodes) == set(job.nodes)   # it runs on exactly the survivors
            if problem:
                self._say(path, f"job {job.job_id}: peer-lost report {path} {problem}; ignored",
                          level=logging.INFO if given_up else logging.WARNING)
                continue
            if report is None:
                continue
            key = (job.job_id, job.restarts, step)
            live.add(key)
            seen = self._seen.setdefault(key, self._clock())
            run_dir = os.path.join(directory, shim.run_dir_name(job.job_id, job.restarts, step))
            stopped = [owned_mtime(os.path.join(run_dir, shim.status_file_name(r)), uid)
                       for r in range(min(report.world_size, 4096))]
            return PeerLoss(
                job_id=job.job_id, user=job.user, restarts=job.restarts, step_id=step,
                lost_nodes=tuple(sorted(set(report.lost_nodes))),
                surviving_nodes=tuple(n for n in job.nodes if n not in report.lost_nodes),
                commit=report.commit, committed_step=report.committed_step,
                detected_at=report.detected_at, seen_at=seen, path=path,
                stopped_at=max((m for m in stopped if m is not None), default=None),
                committed_at=owned_mtime(path, uid) if report.commit == "done" else None,
                launcher_marker=os.path.join(directory,
                                             shim.launcher_stopped_file_name(job.job_id, job.restarts, step)),
                owner_uid=uid)   # the first step with a report: the incarnation is over either way
        return None

    def srun_left_running(self, job: Job) -> bool:
        """Whether the batch script of `job`'s current incarnation said its ranks went on in their processes
        after a lost peer (launcher-stopped marker "kept"): the srun of that step still waits for the lost
        node's tasks, whatever the peer-lost report says now (its nodes given up, it is no longer acted on)."""
        found = self._job_files(job)
        if found is None:
            return False
        directory, uid = found
        return any(_launcher_said(os.path.join(directory, shim.launcher_stopped_file_name(
            job.job_id, job.restarts, step)), uid) == KEPT for step in range(self._steps))

    def _job_files(self, job: Job) -> tuple[str, int] | None:
        """The job's directory and its owner's uid, or None where its files cannot be read as its user's
        (no checkpoint directory, an owner unknown here: the files are not read)."""
        spec = job.spec
        uid = job.user_id if job.user_id is not None else self._uid_of(job.user)
        if spec is None or not spec.ckpt_dir or uid is None:
            return None
        try:
            return shim.job_dir(spec.ckpt_dir, shim.job_key(job.job_id)), uid
        except ValueError:
            return None

    def _say(self, path: str, line: str, level: int = logging.WARNING) -> None:
        if self._said.get(path) != line:      # once per problem, not every cycle
            log.log(level, "%s", line)
            self._said[path] = line


def _launcher_said(marker: str, owner_uid: int) -> str:
    """A launcher-stopped marker read as its user's file: KEPT, IN_PLACE, STOPPED, or "" (none, or unreadable)."""
    try:
        data = read_user_file(marker, owner_uid=owner_uid, max_bytes=64, what="a marker")
    except ValueError:
        return ""
    if data is None:
        return ""
    said = LauncherStopped.parse_bytes(data)
    return KEPT if said.srun_running else IN_PLACE if said.in_place else STOPPED


KILL_RETRY_S = 90.0
"""How long a node that came back may still deliver a kill Slurm queued for it while it was gone: slurmctld
retries an undelivered RPC about once a minute (agent_retry, RPC_RETRY_INTERVAL 60 s), and the attempt
itself takes up to MessageTimeout (10 s by default); the rest is margin. The kill names the job's id and
step, which the job's next incarnation uses again (seen converting a real script on 22.05: the job grown
back onto the node that returned had its ranks there killed 31-53 s after their launch, by the kill of
the step it had been given up from; one run hung in its rendezvous and ended FAILED)."""


def still_lost(reported: Mapping[str, float], state: ClusterState) -> frozenset[str]:
    """Of the nodes a job's ranks reported lost ({node: when}), those it must still stay off: all but the
    ones whose slurmd started since (the node came back: rebooted, or its slurmd restarted) at least
    KILL_RETRY_S before `state` was taken. Slurm may never have marked such a node DOWN (it came back
    within SlurmdTimeout), so its state says nothing; a node Slurm does not say the start time of stays
    lost."""
    started = {n.name: n.slurmd_started_at for n in state.nodes}
    return frozenset(node for node, at in reported.items()
                     if (since := started.get(node)) is None or since <= at or state.taken_at - since < KILL_RETRY_S)


def readmission(reported: Mapping[str, float], state: ClusterState) -> dict[str, str]:
    """For each node in `still_lost`, when the job may use it again, in words."""
    started = {n.name: n.slurmd_started_at for n in state.nodes}
    out = {}
    for node in sorted(still_lost(reported, state)):
        since = started.get(node)
        if since is not None and since > reported[node]:
            out[node] = (f"{node} (back since {state.taken_at - since:.0f} s; used again in "
                         f"{KILL_RETRY_S - (state.taken_at - since):.0f} s, once a kill Slurm queued for it "
                         f"while it was gone can no longer come)")
        else:
            out[node] = f"{node} (its ranks reported it lost; used again once its slurmd starts again)"
    return out


def ready(losses: Mapping[int, PeerLoss], now: float, pending_timeout_s: float) -> dict[int, PeerLoss]:
    """The losses to act on now: the commit is over, or has been pending longer than `pending_timeout_s`
    (a committer that died with its commit pending must not keep the job waiting for good)."""
    return {j: loss for j, loss in losses.items() if loss.settled or now - loss.seen_at >= pending_timeout_s}


def owned_mtime(path: str, owner_uid: int) -> float | None:
    """The mtime of the job user's own regular file at `path` (a link is not followed), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != owner_uid:
        return None
    return st.st_mtime


def _uid_of(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except (KeyError, TypeError):
        return None
