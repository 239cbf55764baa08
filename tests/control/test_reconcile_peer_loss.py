"""The controller acts on a job's report of a lost node: that job restarts without it, and nothing else moves.

The in-memory Slurm is given the three calls a NodeExcludingBackend adds (as the CLI backend makes
them: NodeList=, ExcNodeList=, State=DRAIN); tests/control/test_peer_loss_live.py does it on Slurm.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.model import JobState, NodeFlag, NodeState
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.peer_loss import KILL_RETRY_S, PeerLossReader
from slurm_elastic.control.plan import Plan, PlanEntry
from slurm_elastic.control.protocol import IN_PLACE_NOTE, ProtocolSettings, RequeueProtocol
from slurm_elastic.control.reconcile import DRAINS_PER_USER_PER_HOUR, ControllerConfig, Reconciler
from slurm_elastic.errors import SlurmError
from slurm_elastic.spec import ElasticSpec
from slurm_elastic import jobfiles as shim


class ExcludingSlurm(InMemorySlurm):
    """The in-memory Slurm, plus shrinking a running job, a per-job exclude list and draining."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.excluded: dict[int, set[str]] = {}
        self.drained: dict[str, str] = {}

    def keep_nodes(self, job_id: int, nodes: tuple[str, ...]) -> None:
        job = self._job("keep_nodes", job_id)
        assert job.state is JobState.RUNNING and set(nodes) < set(job.nodes)
        self.jobs[job_id] = dataclasses.replace(job, nodes=tuple(nodes), num_nodes=len(nodes))
        self._recount()

    def exclude_nodes(self, job_id: int, nodes: tuple[str, ...], *, readmit: tuple[str, ...] = ()) -> None:
        self._job("exclude_nodes", job_id)
        self.excluded[job_id] = (self.excluded.get(job_id, set()) | set(nodes)) - set(readmit)

    def kill_wait_s(self) -> float:
        return 30.0

    def slurmd_timeout_s(self) -> float:
        return 10.0

    def drain(self, node: str, reason: str) -> None:
        self.drained[node] = reason
        self.nodes[node] = dataclasses.replace(self.nodes[node], flags=self.nodes[node].flags | {NodeFlag.DRAIN},
                                               reason=reason)

    def resume(self, node: str) -> None:
        self.calls.append(("resume", node))   # type: ignore[arg-type]
        self.nodes[node] = dataclasses.replace(self.nodes[node], flags=self.nodes[node].flags - {NodeFlag.DRAIN},
                                               reason="")

    def _fit(self, job, *args, **kwargs):
        # Slurm honours ExcNodeList when it places the job.
        hidden = {n: self.nodes.pop(n) for n in self.excluded.get(job.job_id, ()) if n in self.nodes}
        try:
            return super()._fit(job, *args, **kwargs)
        finally:
            self.nodes.update(hidden)


class Clock:
    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.time() + self.skipped

    def sleep(self, s: float) -> None:
        self.skipped += s


@pytest.fixture
def cluster(tmp_path: Path):
    slurm = ExcludingSlurm()
    ckpt = str(tmp_path / "ckpt")
    a = slurm.add_job(ElasticSpec(8, 8, gpu_step=4, ckpt_dir=ckpt), nodes=2, gpus_per_node=4, user="alice")
    b = slurm.add_job(ElasticSpec(4, 4, gpu_step=4, ckpt_dir=ckpt), nodes=1, gpus_per_node=4, user="bob")
    assert slurm.jobs[a].nodes == ("n1", "n2") and slurm.jobs[b].nodes == ("n3",)
    return slurm, a, b, tmp_path / "ckpt"


def _reconciler(slurm, tmp_path: Path, *, uid: int | None = None, clock: Clock | None = None,
                **config) -> tuple[Reconciler, Clock]:
    clock = clock or Clock()
    cfg = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=30, settle_timeout_s=1.0), node_confirm_s=0,
                           min_resize_interval_s=300, **config)
    rec = Reconciler(slurm, Journal(tmp_path / "j.sqlite"), cfg, clock=clock, sleep=clock.sleep)
    owner = os.getuid() if uid is None else uid
    rec.peer_losses = PeerLossReader(clock=clock, uid_of=lambda user: owner)
    return rec, clock


def _report(job_id: int, *, restart: int = 0, lost=("n2",), surviving=("n1",), commit: str = "done",
            world: int = 8, **changes) -> dict:
    body = shim.PeerLostReport(
        job_id=str(job_id), restart_count=restart, step_id=0, world_size=world, detected_by="heartbeat",
        detected_at=time.time(), lost=tuple(shim.LostRank(4 + i, n) for i, n in enumerate(lost)),
        lost_nodes=tuple(lost), surviving_nodes=tuple(surviving), agreed_step=41, commit=commit,
        committed_step=41 if commit == "done" else None, reason="test").to_json()
    body.update(changes)
    return body


def _write(ckpt: Path, job_id: int, body: dict | bytes, *, restart: int = 0, step: int = 0) -> Path:
    path = ckpt / str(job_id) / shim.peer_lost_file_name(job_id, restart, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body if isinstance(body, bytes) else json.dumps(body).encode())
    return path


def test_a_reported_lost_node_restarts_that_job_at_once_without_it(cluster, tmp_path):
    slurm, a, b, ckpt = cluster
    rec, clock = _reconciler(slurm, tmp_path)
    assert rec.cycle().plans == ()              # both at their targets, a just started (hysteresis 300 s)
    body = _report(a)
    _write(ckpt, a, body)
    report = rec.cycle()
    assert [p.job_id for p in report.plans] == [a]
    # The report's marks are journaled with the plan (the next incarnation replaces the job's files).
    marks = rec.journal.marks(report.outcomes[0].plan_id)
    assert marks["detected"] == body["detected_at"] and "committed" in marks
    plan = report.plans[0]
    assert plan.exclude == ("n2",) and plan.forced and "lost node n2" in plan.reason
    assert report.outcomes[0].status == "done" and report.outcomes[0].acked is True
    job = slurm.jobs[a]
    assert job.state is JobState.RUNNING and job.restarts == 1 and "n2" not in job.nodes
    assert slurm.excluded == {a: {"n2"}}
    # Neither signalled (its ranks had exited) nor kept waiting for an ACK; given up n2 before the requeue.
    verbs = [v for v, j in slurm.calls if j == a]
    assert "signal" not in verbs and verbs.index("keep_nodes") < verbs.index("requeue_hold")
    assert verbs.index("exclude_nodes") < verbs.index("release")
    # The other user's job is untouched, and no node is drained by default.
    assert slurm.jobs[b].restarts == 0 and slurm.jobs[b].nodes == ("n3",) and slurm.drained == {}
    # The report is about restart 0: the job, now at restart 1, is not restarted again.
    assert rec.cycle().plans == ()
    steps = rec.journal.steps(report.outcomes[0].plan_id)
    assert [s for s, _, _ in steps] == ["open", "signal", "ack", "hold", "resize", "release", "done"]
    # Released only once the old srun (its step spanned the dead node) gave up: KillWait + 2 s, and a second.
    assert clock.skipped >= 32.0   # (real time passes too while the cycle runs)
    assert rec.journal.plans(a, limit=1)[0].plan.exclude == ("n2",)


@pytest.mark.parametrize("marker", ["written", "symlink", "directory"])
def test_a_batch_script_that_stopped_the_old_srun_is_released_without_the_killwait_wait(cluster, tmp_path, marker):
    slurm, a, _, ckpt = cluster
    rec, clock = _reconciler(slurm, tmp_path)
    rec.cycle()
    _write(ckpt, a, _report(a))
    path = ckpt / str(a) / shim.launcher_stopped_file_name(a, 0, 0)
    if marker == "written":
        path.write_bytes(b"")
    elif marker == "symlink":      # only the job user's own regular file counts
        os.symlink(ckpt / str(a) / shim.peer_lost_file_name(a, 0, 0), path)
    else:
        path.mkdir()
    report = rec.cycle()
    assert [p.job_id for p in report.plans] == [a] and report.outcomes[0].status == "done"
    assert slurm.jobs[a].restarts == 1 and "n2" not in slurm.jobs[a].nodes
    if marker == "written":
        assert clock.skipped < 30.0    # the credential gap only, not KillWait + 3 s
    else:
        assert clock.skipped >= 33.0   # the marker's wait (3 s), then KillWait + 3 s


def test_a_job_waiting_out_an_old_srun_holds_back_no_other_jobs_release(tmp_path):
    """Two plans in one cycle: a lost node's job whose batch script said nothing of its old srun waits
    KillWait + 3 s before its release; the other job, shrunk in the same cycle, is released once its own
    credential gap is over, not after that wait."""
    slurm = ExcludingSlurm()
    ckpt = str(tmp_path / "ckpt")
    a = slurm.add_job(ElasticSpec(4, 8, gpu_step=4, ckpt_dir=ckpt), nodes=2, gpus_per_node=4, user="alice")
    b = slurm.add_job(ElasticSpec(4, 8, gpu_step=4, ckpt_dir=ckpt), nodes=2, gpus_per_node=4, user="bob")
    clock = Clock()
    released: dict[int, float] = {}
    requeued: dict[int, float] = {}
    for verb, seen in (("release", released), ("requeue_hold", requeued)):
        real = getattr(slurm, verb)

        def spy(job_id, _real=real, _seen=seen):
            _seen[job_id] = clock()
            return _real(job_id)
        setattr(slurm, verb, spy)
    proto = RequeueProtocol(slurm, Journal(tmp_path / "j.sqlite"),
                            ProtocolSettings(ack_timeout_s=0, settle_timeout_s=1.0), clock=clock, sleep=clock.sleep)
    lost = Plan(job_id=a, from_gpus=8, to_gpus=4, shape=RequestShape(1, 4, 1, 1024), entry=PlanEntry.RUNNING,
                reason="lost node n2", forced=True, user="alice", exclude=(slurm.jobs[a].nodes[1],))
    shrink = Plan(job_id=b, from_gpus=8, to_gpus=4, shape=RequestShape(1, 4, 1, 1024), entry=PlanEntry.RUNNING,
                  reason="shrink", user="bob")
    outcomes = proto.execute([lost, shrink], slurm.snapshot(), launcher_stopped=lambda job_id: "")
    assert [o.status for o in outcomes] == ["done", "done"]
    assert released[a] - requeued[a] >= 32.0           # KillWait (30 s) + 3 s for the old srun, from the hold
    assert released[b] < released[a]
    assert released[b] - requeued[b] < 30.0             # its own gap, not the other job's wait


def _crowded(tmp_path: Path):
    """Job a (4-8 GPUs) on n1+n2, every other GPU taken: losing n2, the survivors hold all a can get."""
    slurm = ExcludingSlurm()
    ckpt = str(tmp_path / "ckpt")
    a = slurm.add_job(ElasticSpec(4, 8, gpu_step=4, ckpt_dir=ckpt), nodes=2, gpus_per_node=4, user="alice")
    others = [slurm.add_job(ElasticSpec(4, 4, gpu_step=4, ckpt_dir=ckpt), nodes=1, gpus_per_node=4, user="bob")
              for _ in range(2)]
    assert slurm.jobs[a].nodes == ("n1", "n2")
    return slurm, a, others, tmp_path / "ckpt"


def _in_place(ckpt: Path, job_id: int, word: str = shim.RELAUNCHES_IN_PLACE) -> None:
    (ckpt / str(job_id) / shim.launcher_stopped_file_name(job_id, 0, 0)).write_text(word + "\n")


def _not_responding(slurm: ExcludingSlurm, node: str) -> None:
    slurm.nodes[node] = dataclasses.replace(slurm.nodes[node], flags=slurm.nodes[node].flags | {NodeFlag.NOT_RESPONDING})


def test_a_job_whose_lost_node_slurm_already_flags_not_responding_is_still_shrunk_in_place(tmp_path):
    """Slurm flags the killed node NOT_RESPONDING before the controller reads the job's report (seen in the demo:
    0.4 s after the kill): the job still gives that node up in place on its ranks' word, not left to Slurm's
    node failure (every cycle dropped its plan, and Slurm requeued it at the node timeout: a docs probe's demo
    run failed). A job on a flagged node its ranks did not report is still left to Slurm."""
    slurm, a, others, ckpt = _crowded(tmp_path)
    rec, clock = _reconciler(slurm, tmp_path)
    assert rec.cycle().plans == ()
    _not_responding(slurm, "n2")
    _write(ckpt, a, _report(a))
    _in_place(ckpt, a, shim.RANKS_KEPT)
    report = rec.cycle()
    assert [p.job_id for p in report.plans] == [a]
    job = slurm.jobs[a]
    assert job.state is JobState.RUNNING and job.nodes == ("n1",) and job.restarts == 0
    # bob's job on n3: Slurm flags n3, no report from it: Slurm's requeue, not a plan of ours
    _not_responding(slurm, slurm.jobs[others[0]].nodes[0])
    assert all(p.job_id != others[0] for p in rec.cycle().plans)


@pytest.mark.parametrize("word", [shim.RELAUNCHES_IN_PLACE, shim.RANKS_KEPT])
def test_a_job_whose_survivors_hold_all_it_can_get_is_shrunk_in_place_not_requeued(tmp_path, word):
    """"in-place": the batch script relaunches the ranks; "kept": the survivors went on in their processes."""
    slurm, a, others, ckpt = _crowded(tmp_path)
    rec, clock = _reconciler(slurm, tmp_path)
    assert rec.cycle().plans == ()
    _write(ckpt, a, _report(a))
    _in_place(ckpt, a, word)
    report = rec.cycle()
    assert [p.job_id for p in report.plans] == [a] and report.outcomes[0].status == "done"
    job = slurm.jobs[a]
    # Running on, on the survivor only: same incarnation (no requeue, no queue), the lost node excluded.
    assert job.state is JobState.RUNNING and job.nodes == ("n1",) and job.restarts == 0
    verbs = [v for v, j in slurm.calls if j == a]
    assert "keep_nodes" in verbs and "requeue_hold" not in verbs and "release" not in verbs
    assert slurm.excluded == {a: {"n2"}} and clock.skipped < 30.0
    steps = rec.journal.steps(report.outcomes[0].plan_id)
    assert any(s == "hold" and "in place" in n for s, _, n in steps)
    assert [n for s, _, n in steps if s in ("resize", "release")] == ["not taken: " + IN_PLACE_NOTE] * 2
    assert all(slurm.jobs[o].restarts == 0 for o in others)
    # The next cycles leave it alone: the report names a node the job no longer has.
    assert rec.cycle().plans == () and slurm.jobs[a].restarts == 0


class RefusingRunningExclusion(ExcludingSlurm):
    """As 22.05 without an accounting database: ExcNodeList on a running job is refused (docs/slurm-backends.md)."""

    def exclude_nodes(self, job_id: int, nodes: tuple[str, ...], *, readmit: tuple[str, ...] = ()) -> None:
        if self._job("exclude_nodes", job_id).state is JobState.RUNNING:
            raise SlurmError("scontrol update: Job update not available right now, the DB index is being set")
        super().exclude_nodes(job_id, nodes, readmit=readmit)


@pytest.mark.parametrize("slurm_class", [ExcludingSlurm, RefusingRunningExclusion])
def test_a_job_shrunk_in_place_off_a_lost_node_is_never_grown_back_onto_it(tmp_path, slurm_class):
    """Slurm counts the lost node up until SlurmdTimeout, its GPUs free once the job gave them up: past the
    hysteresis the job is not grown back there (requeued onto a dead node, or left pending behind its own
    ExcNodeList), and when another node frees it grows there, its lost node excluded at the requeue."""
    slurm = slurm_class()
    ckpt = tmp_path / "ckpt"
    a = slurm.add_job(ElasticSpec(4, 8, gpu_step=4, ckpt_dir=str(ckpt)), nodes=2, gpus_per_node=4, user="alice")
    others = [slurm.add_job(None, nodes=1, gpus_per_node=4, user="bob") for _ in range(2)]   # rigid
    assert slurm.jobs[a].nodes == ("n1", "n2")
    rec, clock = _reconciler(slurm, tmp_path)
    rec.cycle()
    _write(ckpt, a, _report(a))
    _in_place(ckpt, a)
    rec.cycle()
    assert slurm.jobs[a].nodes == ("n1",) and slurm.jobs[a].restarts == 0
    assert slurm.excluded.get(a, set()) == (set() if slurm_class is RefusingRunningExclusion else {"n2"})
    clock.skipped += 3600                     # past the hysteresis and the restart budget's hour
    assert rec.cycle().plans == () and slurm.jobs[a].nodes == ("n1",) and slurm.jobs[a].restarts == 0
    freed = slurm.jobs[others[0]].nodes
    slurm.finish(others[0])
    report = rec.cycle()
    assert [(p.job_id, p.to_gpus) for p in report.plans] == [(a, 8)] and report.outcomes[0].status == "done"
    job = slurm.jobs[a]
    assert job.state is JobState.RUNNING and job.restarts == 1 and set(job.nodes) == {"n1", *freed}
    assert slurm.excluded[a] == {"n2"}


@pytest.mark.parametrize("slurm_class", [ExcludingSlurm, RefusingRunningExclusion])
def test_a_lost_node_whose_slurmd_starts_again_is_the_jobs_again(tmp_path, slurm_class):
    """The node comes back before Slurm noticed it was gone (within SlurmdTimeout): its slurmd's new start
    time is the only sign. The job shrunk in place off it grows back there, its ExcNodeList without it."""
    clock = Clock()
    slurm = slurm_class(clock=clock)
    ckpt = tmp_path / "ckpt"
    a = slurm.add_job(ElasticSpec(4, 8, gpu_step=4, ckpt_dir=str(ckpt)), nodes=2, gpus_per_node=4, user="alice")
    for _ in range(2):
        slurm.add_job(None, nodes=1, gpus_per_node=4, user="bob")   # rigid jobs on n3, n4
    rec, _ = _reconciler(slurm, tmp_path, clock=clock)
    rec.cycle()
    _write(ckpt, a, _report(a))
    _in_place(ckpt, a)
    rec.cycle()
    assert slurm.jobs[a].nodes == ("n1",)
    clock.skipped += 3600                     # past the hysteresis and the restart budget's hour
    assert rec.cycle().plans == () and slurm.jobs[a].nodes == ("n1",)   # n2 still counts as lost
    if slurm_class is ExcludingSlurm:
        slurm.excluded[a] = {"n2", "n9"}       # set while it ran; n9: excluded at submission
    slurm.node_up("n2")                       # its slurmd starts again: Slurm never marked it DOWN
    # Not at once: a kill Slurm queued for n2 while it was gone (the given-up step's, J.0) may still come
    # and would hit the grown job's ranks there.
    report = rec.cycle()
    assert report.plans == () and slurm.jobs[a].nodes == ("n1",)
    assert "kept off n2 (back since 0 s; used again in 90 s" in report.waits[a], report.waits
    clock.skipped += KILL_RETRY_S
    report = rec.cycle()
    assert [(p.job_id, p.to_gpus) for p in report.plans] == [(a, 8)] and report.outcomes[0].status == "done"
    job = slurm.jobs[a]
    assert job.state is JobState.RUNNING and job.restarts == 1 and set(job.nodes) == {"n1", "n2"}
    assert "n2" not in slurm.excluded.get(a, set())
    if slurm_class is ExcludingSlurm:
        assert slurm.excluded[a] == {"n9"}    # only the node that came back left the list


def _kept_then_grown(tmp_path, word_at_grow: str | None = None) -> float:
    """A 4-8 GPU job whose ranks were kept through the loss of n2 (shrunk in place to n1), grown back once
    n2 returns (its batch script's marker then says `word_at_grow`, if given); the clock seconds the grow
    cycle took."""
    clock = Clock()
    slurm = ExcludingSlurm(clock=clock)
    ckpt = tmp_path / "ckpt"
    a = slurm.add_job(ElasticSpec(4, 8, gpu_step=4, ckpt_dir=str(ckpt)), nodes=2, gpus_per_node=4, user="alice")
    for _ in range(2):
        slurm.add_job(None, nodes=1, gpus_per_node=4, user="bob")
    rec, _ = _reconciler(slurm, tmp_path, clock=clock)
    rec.cycle()
    _write(ckpt, a, _report(a))
    _in_place(ckpt, a, shim.RANKS_KEPT)
    rec.cycle()
    assert slurm.jobs[a].nodes == ("n1",) and slurm.jobs[a].restarts == 0
    clock.skipped += 3600
    slurm.node_up("n2")
    clock.skipped += KILL_RETRY_S             # no kill queued while n2 was gone can come now
    if word_at_grow is not None:
        _in_place(ckpt, a, word_at_grow)
    before = clock.skipped
    report = rec.cycle()
    assert [(p.job_id, p.to_gpus) for p in report.plans] == [(a, 8)] and report.outcomes[0].status == "done"
    assert slurm.jobs[a].restarts == 1 and set(slurm.jobs[a].nodes) == {"n1", "n2"}
    return clock.skipped - before


def test_a_job_whose_ranks_were_kept_waits_for_the_old_srun_when_it_is_grown_later(tmp_path):
    """The kept ranks' srun still waits for the lost node's tasks: a later requeue (here the grow once the
    node is back) releases the job only after that srun has given up (KillWait + 3 s), not at once."""
    assert _kept_then_grown(tmp_path) >= 30.0     # KillWait + 3 s, less what the cycle itself took


def test_a_job_whose_kept_ranks_ended_their_srun_is_grown_later_without_the_killwait_wait(tmp_path):
    """The kept ranks said they ended (exited-<rank>) and the batch script stopped their srun and said so
    ("stopped" over "kept"): nothing is left to cancel J.0, so the grow releases the job at once."""
    assert _kept_then_grown(tmp_path, "stopped") < 30.0


class BatchHostSlurm(ExcludingSlurm):
    """Slurm's batch host: never taken from a running job (keep_nodes refuses it), and a node that died is
    set DOWN, its jobs requeued by Slurm, only once SlurmdTimeout has passed. Every requeue we issue while
    a job's dead batch host still holds it is recorded: Slurm 22.05 restarts such a job without its GPUs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dead: dict[str, float] = {}
        self.requeued_on_dead_host: list[int] = []

    def _mark_down(self) -> None:
        for name, at in self.dead.items():
            if self.now - at >= self.slurmd_timeout_s() and self.nodes[name].state is not NodeState.DOWN:
                self.node_down(name)

    def snapshot(self):
        self._mark_down()
        state = super().snapshot()
        # A running job held by `scontrol hold` reads as not held, as Slurm shows it (slurm_values.job_held).
        jobs = tuple(dataclasses.replace(j, batch_host=j.nodes[0], held=False)
                     if j.state is JobState.RUNNING and j.nodes else j for j in state.jobs)
        return dataclasses.replace(state, jobs=jobs)

    def keep_nodes(self, job_id: int, nodes: tuple[str, ...]) -> None:
        if self._job("keep_nodes", job_id).nodes[0] not in nodes:
            raise SlurmError(f"Invalid node name specified for job {job_id}")
        super().keep_nodes(job_id, nodes)

    def requeue_hold(self, job_id: int) -> None:
        if self._job("requeue_hold", job_id).nodes[0] in self.dead:
            self.requeued_on_dead_host.append(job_id)
        super().requeue_hold(job_id)


def _running_on_two_nodes(tmp_path) -> tuple[BatchHostSlurm, int, Reconciler, Clock]:
    """A 4-8 GPU job running on n1 (its batch host) and n2, after a first cycle of its controller."""
    clock = Clock()
    slurm = BatchHostSlurm(clock=clock)
    a = slurm.add_job(ElasticSpec(4, 8, gpu_step=4, ckpt_dir=str(tmp_path / "ckpt")), nodes=2, gpus_per_node=4,
                      user="alice")
    assert slurm.jobs[a].nodes == ("n1", "n2")
    rec, _ = _reconciler(slurm, tmp_path, clock=clock)
    rec.cycle()
    return slurm, a, rec, clock


def _lose_batch_host(slurm: BatchHostSlurm, job_id: int, ckpt: Path) -> None:
    """n1's slurmd is gone (Slurm not told yet) and the job's survivors on n2 report it."""
    slurm.dead["n1"] = slurm.now
    _write(ckpt, job_id, _report(job_id, lost=("n1",), surviving=("n2",)))


def _cycles_until_recovered(rec: Reconciler, clock: Clock, *, every_s: float = 2.0, most: int = 200) -> list:
    """Cycle every `every_s` (the clock skipped ahead) until a recovered plan is no longer waiting; the reports."""
    reports = []
    for _ in range(most):
        clock.sleep(every_s)
        reports.append(rec.cycle())
        if reports[-1].recovered and reports[-1].recovered[0].status != "waiting":
            return reports
    raise AssertionError("the plan never finished")


def test_a_job_whose_batch_host_is_lost_is_requeued_by_slurm_not_by_us(tmp_path):
    """Slurm never takes the batch host from a running job, and a job we requeue while its dead batch host
    holds it restarts without its GPUs (22.05.8; the GPUs of its new node stay counted as used): the job
    is held instead, Slurm requeues it when it marks the node DOWN, and the plan goes on from there, in
    the first cycle after it (no cycle waits for it)."""
    slurm, a, rec, clock = _running_on_two_nodes(tmp_path)
    _lose_batch_host(slurm, a, tmp_path / "ckpt")
    before = clock.skipped
    report = rec.cycle()
    assert [(p.job_id, p.to_gpus) for p in report.plans] == [(a, 4)] and report.outcomes[0].status == "waiting"
    assert clock.skipped - before < 5.0 and slurm.jobs[a].held and rec.journal.open_plans()
    reports = _cycles_until_recovered(rec, clock)
    assert [o.status for o in reports[-1].recovered] == ["done"] and not rec.journal.open_plans()
    assert all(r.cycle_s < 5.0 for r in reports) and clock.skipped - before < slurm.slurmd_timeout_s() + 30
    assert slurm.requeued_on_dead_host == []
    assert slurm.nodes["n1"].state is NodeState.DOWN                  # the plan waited for Slurm's own requeue
    job = slurm.jobs[a]
    assert job.state is JobState.RUNNING and "n1" not in job.nodes and job.restarts == 1 and not job.held


def test_a_report_naming_a_batch_host_that_is_alive_holds_up_no_cycle_and_no_other_job(tmp_path):
    """A job's report names its own batch host lost, which answers Slurm all along (a lie, or a network
    split between the ranks only): the job is held for Slurm's requeue that never comes, the cycles go on
    at their pace meanwhile, another user's job is resized in them, and once Slurm's wait is over the
    controller requeues the job itself."""
    slurm, a, rec, clock = _running_on_two_nodes(tmp_path)
    # bob's job asks 3 nodes, 2 are free: it waits for the controller to start it smaller
    b = slurm.add_job(ElasticSpec(4, 12, gpu_step=4, ckpt_dir=str(tmp_path / "ckpt")), nodes=3, gpus_per_node=4,
                      user="bob", run=False)
    _write(tmp_path / "ckpt", a, _report(a, lost=("n1",), surviving=("n2",)))   # n1 is not dead
    before = clock.skipped
    report = rec.cycle()
    assert {o.job_id: o.status for o in report.outcomes} == {a: "waiting", b: "done"}
    assert clock.skipped - before < 5.0 and slurm.jobs[b].state is JobState.RUNNING
    reports = _cycles_until_recovered(rec, clock, every_s=10.0)
    assert all(r.cycle_s < 5.0 and r.allocation is not None for r in reports)   # each cycle decided, at its pace
    # one plan for alice's job, never opened again while it waited (duplicates requeued its next incarnation)
    assert [len([p for p in r.plans if p.job_id == a]) for r in reports] == [0] * len(reports)
    assert len(rec.journal.plans(a)) == 1
    assert "held for Slurm's own requeue" in reports[0].waits[a], reports[0].waits
    assert [o.status for o in reports[-1].recovered] == ["done"]
    waited = clock.skipped - before
    assert slurm.slurmd_timeout_s() * 4 / 3 + 15 <= waited < slurm.slurmd_timeout_s() * 4 / 3 + 15 + 30
    job = slurm.jobs[a]
    assert job.restarts == 1 and job.state is JobState.RUNNING and not job.held


def test_a_controller_that_dies_while_a_lost_batch_host_holds_the_job_waits_for_slurm_on_recovery(tmp_path):
    """Restarted after the hold, the controller still does not requeue the job while its dead batch host
    holds it, nor resize it running: it waits for Slurm's own requeue, then finishes the plan."""
    from slurm_elastic.control.protocol import RequeueProtocol

    class Crash(BaseException):   # as a SIGKILL: nothing of the protocol runs after it
        pass

    def crash() -> None:
        raise Crash

    slurm, a, rec, clock = _running_on_two_nodes(tmp_path)
    rec.protocol = RequeueProtocol(slurm, rec.journal, rec.config.protocol, clock=clock, sleep=clock.sleep,
                                   crash_after="hold", crash=crash)
    _lose_batch_host(slurm, a, tmp_path / "ckpt")
    with pytest.raises(Crash):
        rec.cycle()
    assert slurm.jobs[a].state is JobState.RUNNING and slurm.jobs[a].held and rec.journal.open_plans()
    rec2, _ = _reconciler(slurm, tmp_path, clock=clock)     # a new controller, the same journal
    assert [o.status for o in rec2.cycle().recovered] == ["waiting"] and rec2.journal.open_plans()
    report = _cycles_until_recovered(rec2, clock)[-1]
    assert [o.status for o in report.recovered] == ["done"] and not rec2.journal.open_plans()
    assert slurm.requeued_on_dead_host == [] and slurm.nodes["n1"].state is NodeState.DOWN
    job = slurm.jobs[a]
    assert job.state is JobState.RUNNING and job.nodes == ("n2",) and job.restarts == 1 and not job.held


def test_a_shrink_in_place_needs_the_scripts_word_and_room_enough(cluster, tmp_path):
    # The script only stopped its srun (no "in-place"): the requeue path, as before.
    slurm, a, others, ckpt = _crowded(tmp_path / "quiet")
    rec, _ = _reconciler(slurm, tmp_path / "quiet")
    rec.cycle()
    _write(ckpt, a, _report(a))
    (ckpt / str(a) / shim.launcher_stopped_file_name(a, 0, 0)).write_bytes(b"")
    rec.cycle()
    assert slurm.jobs[a].restarts == 1 and "requeue_hold" in [v for v, j in slurm.calls if j == a]
    # The plan wants more than the survivors hold (a job of 8-8 with room elsewhere): growth requeues.
    slurm, a, _, ckpt = cluster
    rec, _ = _reconciler(slurm, tmp_path / "room")
    rec.cycle()
    _write(ckpt, a, _report(a))
    _in_place(ckpt, a)
    report = rec.cycle()
    assert report.plans[0].to_gpus == 8 and slurm.jobs[a].restarts == 1 and "n2" not in slurm.jobs[a].nodes


def test_a_job_whose_kept_ranks_need_more_than_the_survivors_is_requeued_after_the_killwait_wait(cluster, tmp_path):
    """"kept": the step's srun still runs (on the survivors, its lost node unanswered), so a requeue waits
    KillWait as when the script said nothing: the old srun's last cancel must not reach the next step."""
    slurm, a, _, ckpt = cluster
    rec, clock = _reconciler(slurm, tmp_path)
    rec.cycle()
    _write(ckpt, a, _report(a))
    _in_place(ckpt, a, shim.RANKS_KEPT)
    report = rec.cycle()
    assert report.plans[0].to_gpus == 8 and slurm.jobs[a].restarts == 1 and "n2" not in slurm.jobs[a].nodes
    assert clock.skipped >= 30.0     # KillWait + 3 s, less what the cycle itself took


def test_a_controller_that_dies_after_a_shrink_in_place_does_not_requeue_the_job_on_recovery(tmp_path):
    from slurm_elastic.control.protocol import RequeueProtocol

    class Crash(BaseException):   # as a SIGKILL: nothing of the protocol runs after it
        pass

    def crash() -> None:
        raise Crash

    slurm, a, _, ckpt = _crowded(tmp_path)
    rec, clock = _reconciler(slurm, tmp_path)
    rec.cycle()
    rec.protocol = RequeueProtocol(slurm, rec.journal, rec.config.protocol, clock=clock, sleep=clock.sleep,
                                   crash_after="hold", crash=crash)
    _write(ckpt, a, _report(a))
    _in_place(ckpt, a)
    with pytest.raises(Crash):
        rec.cycle()
    assert slurm.jobs[a].nodes == ("n1",) and rec.journal.open_plans()
    rec2, _ = _reconciler(slurm, tmp_path)     # a new controller, the same journal
    report = rec2.cycle()
    assert [o.status for o in report.recovered] == ["done"] and not rec2.journal.open_plans()
    assert slurm.jobs[a].state is JobState.RUNNING and slurm.jobs[a].restarts == 0
    assert "requeue_hold" not in [v for v, j in slurm.calls if j == a]


def test_a_pending_commit_is_waited_for_then_acted_on_anyway(cluster, tmp_path):
    slurm, a, _, ckpt = cluster
    rec, clock = _reconciler(slurm, tmp_path)
    rec.cycle()
    path = _write(ckpt, a, _report(a, commit="pending"))
    report = rec.cycle()
    assert report.plans == () and "waiting for its just-in-time commit" in report.waits[a]
    path.write_text(json.dumps(_report(a, commit="done")))
    assert [p.job_id for p in rec.cycle().plans] == [a]

    # A committer that died with its commit pending does not keep the job waiting for good.
    slurm2 = ExcludingSlurm()
    a2 = slurm2.add_job(ElasticSpec(8, 8, gpu_step=4, ckpt_dir=str(ckpt)), nodes=2, gpus_per_node=4)
    rec2, clock2 = _reconciler(slurm2, tmp_path / "second")
    _write(ckpt, a2, _report(a2, commit="pending"))
    assert rec2.cycle().plans == ()
    clock2.skipped += 31
    assert [p.job_id for p in rec2.cycle().plans] == [a2]


@pytest.mark.parametrize("hostile", [
    "symlink", "other owner", "too big", "not json", "wrong format", "foreign node", "old restart",
    "other job", "every node", "fifo"])
def test_a_report_the_job_cannot_vouch_for_is_ignored(cluster, tmp_path, hostile):
    slurm, a, b, ckpt = cluster
    rec, _ = _reconciler(slurm, tmp_path, uid=os.getuid() + 1 if hostile == "other owner" else None)
    rec.cycle()
    good = _report(a)
    path = ckpt / str(a) / shim.peer_lost_file_name(a, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    if hostile == "symlink":
        target = _write(ckpt, b, good)          # a valid-looking file elsewhere
        os.symlink(target, path)
    elif hostile == "fifo":
        os.mkfifo(path)
    elif hostile == "too big":
        _write(ckpt, a, _report(a, reason="x" * 70000))
    elif hostile == "not json":
        _write(ckpt, a, b"{not json")
    elif hostile == "wrong format":
        _write(ckpt, a, {**good, "format": "something-else"})
    elif hostile == "foreign node":           # a node of bob's job: a's word cannot reach it
        _write(ckpt, a, _report(a, lost=("n3",)))
    elif hostile == "old restart":
        _write(ckpt, a, _report(a, restart=1), restart=0)
    elif hostile == "other job":
        _write(ckpt, a, _report(b))
    elif hostile == "every node":
        _write(ckpt, a, _report(a, lost=("n1", "n2"), surviving=()))
    else:
        _write(ckpt, a, good)
    report = rec.cycle()
    assert report.plans == () and report.peer_losses == {}
    assert slurm.jobs[a].restarts == 0 and slurm.jobs[b].restarts == 0 and slurm.excluded == {}


@pytest.mark.parametrize("body", ["foreign nodes", "other job and its nodes"])
def test_a_report_naming_nodes_the_job_does_not_run_on_is_dropped_with_one_log_line(cluster, tmp_path, caplog,
                                                                                  body):
    slurm, a, b, ckpt = cluster
    rec, _ = _reconciler(slurm, tmp_path)
    rec.cycle()
    path = _write(ckpt, a, _report(a, lost=("n3",)) if body == "foreign nodes" else _report(b, lost=("n3",)))
    for _ in range(3):
        report = rec.cycle()
        assert report.plans == () and report.peer_losses == {}
    said = [r for r in caplog.records if str(path) in r.getMessage()]
    assert len(said) == 1 and "ignored" in said[0].getMessage() and said[0].levelname == "WARNING"


def test_a_report_reader_that_raises_for_one_job_costs_only_that_job_its_report(tmp_path, monkeypatch, caplog):
    slurm = ExcludingSlurm(nodes=6)     # room for c to restart without n4
    ckpt = tmp_path / "ckpt"
    a = slurm.add_job(ElasticSpec(8, 8, gpu_step=4, ckpt_dir=str(ckpt)), nodes=2, gpus_per_node=4)
    c = slurm.add_job(ElasticSpec(8, 8, gpu_step=4, ckpt_dir=str(ckpt)), nodes=2, gpus_per_node=4)
    rec, _ = _reconciler(slurm, tmp_path)
    rec.cycle()
    _write(ckpt, a, _report(a, lost=("n2",), surviving=("n1",)))
    _write(ckpt, c, _report(c, lost=("n4",), surviving=("n3",)))
    from slurm_elastic.control import peer_loss
    real = peer_loss.read_report

    def deep(path, **kw):
        if f"{os.sep}{a}{os.sep}" in path:
            raise RecursionError("maximum recursion depth exceeded")
        return real(path, **kw)

    monkeypatch.setattr(peer_loss, "read_report", deep)
    report = rec.cycle()
    assert set(report.peer_losses) == {c}
    assert slurm.jobs[c].restarts == 1 and "n4" not in slurm.jobs[c].nodes
    assert slurm.jobs[a].restarts == 0
    assert sum(f"job {a}" in r.getMessage() and "RecursionError" in r.getMessage() for r in caplog.records) == 1


def test_drain_on_peer_loss_is_off_by_default_bounded_per_user_and_never_in_user_mode(tmp_path):
    ckpt = tmp_path / "ckpt"

    def run(**config) -> ExcludingSlurm:
        slurm = ExcludingSlurm(nodes=10)
        ids = [slurm.add_job(ElasticSpec(8, 8, gpu_step=4, ckpt_dir=str(ckpt)), nodes=2, gpus_per_node=4,
                             user="alice") for _ in range(3)]
        d = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
        rec, _ = _reconciler(slurm, d, **config)
        rec.cycle()
        before = {}
        for job_id in ids:
            job = slurm.jobs[job_id]
            first, second = job.nodes
            before[job_id] = (job.restarts, second)
            _write(ckpt, job_id, _report(job_id, restart=job.restarts, lost=(second,), surviving=(first,)),
                   restart=job.restarts)
        rec.cycle()
        for job_id, (restarts, lost) in before.items():    # every job restarted without its node
            assert slurm.jobs[job_id].restarts == restarts + 1 and lost not in slurm.jobs[job_id].nodes
        return slurm

    assert run().drained == {}
    drained = run(drain_on_peer_loss=True).drained
    assert len(drained) == DRAINS_PER_USER_PER_HOUR
    assert all("reported its ranks here lost" in r and "(alice)" in r for r in drained.values())
    assert run(drain_on_peer_loss=True, user="alice").drained == {}


def _drained_on_a_report(tmp_path: Path, **config) -> tuple[ExcludingSlurm, Reconciler, Clock, str]:
    slurm = ExcludingSlurm(nodes=6)
    ckpt = tmp_path / "ckpt"
    a = slurm.add_job(ElasticSpec(8, 8, gpu_step=4, ckpt_dir=str(ckpt)), nodes=2, gpus_per_node=4, user="alice")
    rec, clock = _reconciler(slurm, tmp_path, drain_on_peer_loss=True, **config)
    rec.cycle()
    _write(ckpt, a, _report(a))
    assert rec.cycle().drained == ("n2",)
    return slurm, rec, clock, "n2"


def test_a_drain_on_a_report_is_resumed_when_it_expires_and_shown_until_then(tmp_path):
    slurm, rec, clock, node = _drained_on_a_report(tmp_path, drain_expiry_s=600)
    [drain] = rec.journal.drains()
    assert drain.node == node and drain.user == "alice" and drain.until == pytest.approx(drain.at + 600)
    clock.skipped += 599
    assert rec.cycle().resumed == () and NodeFlag.DRAIN in slurm.nodes[node].flags
    clock.skipped += 2
    assert rec.cycle().resumed == (node,)
    assert NodeFlag.DRAIN not in slurm.nodes[node].flags and rec.journal.drains() == []
    [ended] = rec.journal.drains(active=False)
    assert ended.end_note == "expired; resumed" and ended.ended_at is not None
    assert rec.cycle().resumed == ()                          # once


def test_an_expired_drain_that_is_no_longer_ours_is_left_as_it_is(tmp_path):
    slurm, rec, clock, node = _drained_on_a_report(tmp_path, drain_expiry_s=600)
    slurm.drain(node, "admin: bad DIMM")                      # an admin drained it again, for a reason of theirs
    clock.skipped += 601
    assert rec.cycle().resumed == ()
    assert NodeFlag.DRAIN in slurm.nodes[node].flags and ("resume", node) not in slurm.calls
    assert rec.journal.drains() == []


def test_drains_expire_in_a_daemon_restarted_without_drain_on_peer_loss(tmp_path):
    slurm, rec, clock, node = _drained_on_a_report(tmp_path)
    [drain] = rec.journal.drains()
    assert drain.until == pytest.approx(drain.at + 3600)       # the default: an hour
    rec.journal.close()
    again, later = _reconciler(slurm, tmp_path)               # the same journal, the flag off
    later.skipped = clock.skipped + 3601
    assert again.cycle().resumed == (node,)


def test_a_backend_that_cannot_exclude_nodes_never_acts_on_reports(tmp_path):
    slurm = InMemorySlurm()
    ckpt = tmp_path / "ckpt"
    a = slurm.add_job(ElasticSpec(8, 8, gpu_step=4, ckpt_dir=str(ckpt)), nodes=2, gpus_per_node=4)
    rec, _ = _reconciler(slurm, tmp_path)
    rec.cycle()
    _write(ckpt, a, _report(a))
    assert rec.cycle().plans == ()


def _mark(path: Path, at: float, text: str = "{}") -> None:
    """A job file written at `at` (its mtime is the mark phases.py reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (at, at))


def test_the_phases_of_a_peer_loss_restart_come_from_the_marks_already_written(tmp_path):
    from slurm_elastic.cluster.model import Job
    from slurm_elastic.control.phases import last_restart
    from slurm_elastic.control.plan import Plan, PlanEntry

    ckpt = tmp_path / "ckpt"
    t = 1_800_000_000.0
    job = Job(job_id=7, user="alice", name="j", state=JobState.RUNNING, nodes=("n1", "n3"), num_nodes=2,
              gpus_per_node=1, restarts=1, start_time=t + 12, spec=ElasticSpec(2, 2, ckpt_dir=str(ckpt)))
    journal = Journal(tmp_path / "j.sqlite")
    plan = Plan(job_id=7, from_gpus=2, to_gpus=2, shape=RequestShape(2, 1, 1, 1),
                entry=PlanEntry.RUNNING, reason="lost", forced=True, user="alice", exclude=("n2",))
    pid = journal.open_plan(plan, restarts=0, now=t + 4)
    for step, at in (("signal", t + 4.1), ("ack", t + 4.2), ("hold", t + 5), ("resize", t + 6), ("release", t + 8)):
        journal.record(pid, step, now=at)
    journal.finish(pid, "done", now=t + 8)

    jd = ckpt / "7"
    body = _report(7, lost=("n2",), surviving=("n1",), world=2, detected_at=t + 0.5)
    body["lost"] = [{"rank": 1, "node": "n2"}]
    _mark(jd / shim.peer_lost_file_name(7, 0, 0), t + 3, json.dumps(body))
    _mark(jd / shim.run_dir_name(7, 0, 0) / shim.status_file_name(0), t + 1.5)
    _mark(jd / shim.GEOMETRY_FILE, t + 20)
    row = {"step": 42, "time": t + 25, "gpus": 2, "nodes": 2, "steps_per_s": 1.0, "samples_per_s": 48.0}
    old = {**row, "step": 40, "time": t - 5}
    _mark(jd / shim.METRICS_FILE, t + 25, json.dumps(old) + "\n" + json.dumps(row) + "\n")
    phases = last_restart(job, journal, owner_uid=os.getuid())
    assert phases is not None and phases.kind == "peer loss"
    assert phases.phases() == [("detected -> ranks stopped", 1.0), ("ranks stopped -> checkpoint committed", 1.5),
                               ("committed -> requeued", 2.0), ("requeued -> relaunched", 3.0),
                               ("relaunched -> running", 4.0), ("running -> ranks attached", 8.0),
                               ("ranks attached -> first step", 5.0)]
    assert phases.total_s() == 24.5
    # Another user's file in the job's directory is no mark of the job's.
    foreign = last_restart(job, journal, owner_uid=os.getuid() + 1)
    assert foreign is not None and foreign.detected is None and foreign.first_step is None
    # Requeued by Slurm once more since (no plan of ours): that incarnation's start is not this restart's (a
    # fault probe saw "relaunched -> running 383.9s" for a restart of about 8 s).
    later = dataclasses.replace(job, restarts=2, start_time=t + 400)
    phases = last_restart(later, journal, owner_uid=os.getuid())
    assert phases is not None and phases.running is None and phases.first_step is None
    assert all(name != "relaunched -> running" for name, _ in phases.phases())
    # Slurm's start time is whole seconds: one less than a second before the release is the release
    phases = last_restart(dataclasses.replace(job, start_time=t + 7.9), journal, owner_uid=os.getuid())
    assert phases is not None and dict(phases.phases())["relaunched -> running"] == 0.0


def test_a_first_step_is_not_guessed_when_the_rows_since_the_restart_outgrew_the_tail_read(tmp_path):
    from slurm_elastic.control.phases import METRICS_TAIL_BYTES, first_row_after

    path = tmp_path / "metrics.jsonl"
    row = {"step": 1, "time": 100.0, "gpus": 2, "nodes": 2, "steps_per_s": 1.0, "samples_per_s": 48.0}
    lines = [json.dumps({**row, "step": i, "time": 100.0 + i}) for i in range(10)]
    path.write_text("\n".join(lines) + "\n")
    assert first_row_after(str(path), 104.5, owner_uid=os.getuid()) == 105.0
    many = [json.dumps({**row, "step": i, "time": 100.0 + i}) for i in range(METRICS_TAIL_BYTES // 50)]
    path.write_text("\n".join(many) + "\n")
    assert first_row_after(str(path), 104.5, owner_uid=os.getuid()) is None    # row 105 is not in the tail
    assert first_row_after(str(path), 100.0 + len(many) - 3.5, owner_uid=os.getuid()) == 100.0 + len(many) - 3


def test_the_phases_of_a_loss_whose_survivors_kept_their_processes_end_at_their_first_step(tmp_path):
    """The survivors re-formed the group before the daemon's shrink: the path is commit -> re-formed -> first
    step (regroup.json's mtime, the first metrics row after it); the shrink is not on it."""
    from slurm_elastic.cluster.model import Job
    from slurm_elastic.control.phases import last_restart
    from slurm_elastic.control.plan import Plan, PlanEntry

    ckpt = tmp_path / "ckpt"
    t = 1_800_000_000.0
    job = Job(job_id=7, user="alice", name="j", state=JobState.RUNNING, nodes=("n1",), num_nodes=1,
              gpus_per_node=1, restarts=0, start_time=t - 100, spec=ElasticSpec(1, 2, ckpt_dir=str(ckpt)))
    journal = Journal(tmp_path / "j.sqlite")
    plan = Plan(job_id=7, from_gpus=2, to_gpus=1, shape=RequestShape(1, 1, 1, 1),
                entry=PlanEntry.RUNNING, reason="lost", forced=True, user="alice", exclude=("n2",))
    pid = journal.open_plan(plan, restarts=0, now=t + 8)
    journal.record(pid, "hold", IN_PLACE_NOTE, now=t + 9)
    journal.finish(pid, "done", now=t + 9.5)

    jd = ckpt / "7"
    body = _report(7, lost=("n2",), surviving=("n1",), world=2, detected_at=t + 0.5)
    body["lost"] = [{"rank": 1, "node": "n2"}]
    _mark(jd / shim.peer_lost_file_name(7, 0, 0), t + 5.5, json.dumps(body))
    run = jd / shim.run_dir_name(7, 0, 0)
    _mark(run / shim.status_file_name(0), t + 0.6)
    row = {"step": 42, "time": t + 6.5, "gpus": 1, "nodes": 1, "steps_per_s": 1.0, "samples_per_s": 48.0}
    old = {**row, "step": 40, "time": t - 5, "gpus": 2, "nodes": 2}
    _mark(jd / shim.METRICS_FILE, t + 6.5, json.dumps(old) + "\n" + json.dumps(row) + "\n")
    _mark(run / shim.REGROUP_FILE, t + 5.6, json.dumps({"go": False}))
    assert last_restart(job, journal, owner_uid=os.getuid()).kind == "peer loss, in place"   # said no: relaunched
    _mark(run / shim.REGROUP_FILE, t + 5.6, json.dumps({"go": True, "survivors": [0]}))
    phases = last_restart(job, journal, owner_uid=os.getuid())
    assert phases is not None and phases.kind == "peer loss, ranks kept"
    assert phases.phases() == [("detected -> ranks stopped", 0.1), ("ranks stopped -> checkpoint committed", 4.9),
                               ("committed -> group re-formed", 0.1), ("group re-formed -> first step", 0.9)]
    assert phases.total_s() == 6.0


def test_a_node_another_job_started_on_meanwhile_is_not_drained_on_a_report(tmp_path, caplog):
    """The drain comes after the reporting job's requeue, seconds after the report was read. Found by an
    adversarial probe: Slurm had started bob's job on the node alice's report named meanwhile, the drain
    landed under it, and the controller then moved bob's job off the drained node."""
    slurm = ExcludingSlurm(nodes=3)
    ckpt = tmp_path / "ckpt"
    a = slurm.add_job(ElasticSpec(8, 8, gpu_step=4, ckpt_dir=str(ckpt)), nodes=2, gpus_per_node=4, user="alice")
    assert slurm.jobs[a].nodes == ("n1", "n2")
    rec, _ = _reconciler(slurm, tmp_path, drain_on_peer_loss=True)
    rec.cycle()
    _write(ckpt, a, _report(a))                           # n2 lost, n1 alive
    bob: list[int] = []
    execute = rec.protocol.execute

    def and_then_bob_starts(*args, **kwargs):
        out = execute(*args, **kwargs)
        bob.append(slurm.add_job(None, nodes=1, gpus_per_node=4, user="bob"))   # only n2 is free now
        return out

    rec.protocol.execute = and_then_bob_starts            # type: ignore[method-assign]
    report = rec.cycle()
    assert slurm.jobs[a].restarts == 1 and "n2" not in slurm.jobs[a].nodes
    assert slurm.jobs[bob[0]].nodes == ("n2",) and slurm.jobs[bob[0]].state is JobState.RUNNING
    assert report.drained == () and NodeFlag.DRAIN not in slurm.nodes["n2"].flags
    assert any(f"not draining n2 on its report: job {bob[0]} runs there now" in r.getMessage()
               for r in caplog.records)
