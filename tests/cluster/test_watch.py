"""The node loss/gain watcher on constructed snapshots (level-triggered, grace, requeues, finishes)."""

from __future__ import annotations

from dataclasses import replace

from slurm_elastic.cluster.model import ClusterState, Job, JobState, Node, NodeFlag, NodeState
from slurm_elastic.cluster.watch import (JobFinished, JobRequeuedBySlurm, NodeGained, NodeLost, Watcher,
                                         strigger_args, write_wake_program, WakeFile)
from slurm_elastic.spec import ElasticSpec

SPEC = ElasticSpec(1, 8)


def node(name: str, state: NodeState = NodeState.IDLE, *flags: NodeFlag) -> Node:
    return Node(name, state, frozenset(flags), cpus=8, mem_mb=16000, gpus=4)


def job(jid: int, state: JobState, nodes: tuple[str, ...] = (), restarts: int = 0, reason: str = "",
        held: bool = False, spec: ElasticSpec | None = SPEC) -> Job:
    return Job(jid, "u", "j", state, reason=reason, nodes=nodes, num_nodes=max(len(nodes), 1), gpus_per_node=2,
               restarts=restarts, requeue=True, held=held, spec=spec)


def snap(t: float, nodes: list[Node], jobs: list[Job] = ()) -> ClusterState:
    return ClusterState(tuple(nodes), tuple(jobs), taken_at=t)


UP = [node("n1", NodeState.MIXED), node("n2", NodeState.MIXED), node("n3"), node("n4")]


def test_down_node_then_requeue_then_resume() -> None:
    w = Watcher(grace_s=5)
    running = job(1, JobState.RUNNING, ("n1", "n2"))
    assert w.observe(snap(0, UP, [running])) == []
    down = [UP[0], node("n2", NodeState.DOWN, NodeFlag.NOT_RESPONDING), *UP[2:]]
    requeued = job(1, JobState.PENDING, restarts=1, reason="BeginTime")
    events = w.observe(snap(30, down, [requeued]))
    assert NodeLost("n2", "down", "", 30) in events
    assert JobRequeuedBySlurm(1, 1, ("n1", "n2"), ("n2",), 30) in events
    assert w.observe(snap(31, down, [requeued])) == []           # reported once
    events = w.observe(snap(40, UP, [job(1, JobState.RUNNING, ("n1",), restarts=1)]))
    assert events == [NodeGained("n2", "resumed", 40)]


def test_not_responding_counts_only_after_the_grace() -> None:
    w = Watcher(grace_s=5)
    w.observe(snap(0, UP))
    blip = [node("n1", NodeState.MIXED, NodeFlag.NOT_RESPONDING), *UP[1:]]
    assert w.suspected_losses(snap(1, blip)) == set()
    assert w.observe(snap(1, blip)) == []
    assert w.observe(snap(1.5, UP)) == []                         # a sub-second blip: nothing
    assert w.observe(snap(10, blip)) == []                        # the clock restarts
    assert w.suspected_losses(snap(16, blip)) == {"n1"}
    assert w.observe(snap(16, blip)) == [NodeLost("n1", "not-responding", "", 16)]


def test_level_triggered_fresh_watcher_sees_what_is_lost_now() -> None:
    w = Watcher()
    state = snap(100, [UP[0], node("n2", NodeState.IDLE, NodeFlag.DRAIN), node("n3", NodeState.DOWN),
                       node("n4", NodeState.MIXED, NodeFlag.DRAIN)],
                 [job(5, JobState.PENDING, restarts=2, reason="BeginTime"), job(6, JobState.COMPLETED)])
    events = w.observe(state)
    assert set(events) == {NodeLost("n2", "drained", "", 100), NodeLost("n3", "down", "", 100),
                           NodeLost("n4", "draining", "", 100), JobRequeuedBySlurm(5, 2, (), (), 100),
                           JobFinished(6, JobState.COMPLETED, 100)}
    assert set(w.lost) == {"n2", "n3", "n4"}


def test_missed_polls_lose_nothing() -> None:
    w = Watcher()
    w.observe(snap(0, UP, [job(1, JobState.RUNNING, ("n3",))]))
    # n3 went down, the job was requeued, and ran again elsewhere; all between two polls.
    later = snap(90, [*UP[:2], node("n3", NodeState.DOWN), UP[3]], [job(1, JobState.RUNNING, ("n4",), restarts=1)])
    assert w.observe(later) == [NodeLost("n3", "down", "", 90)]


def test_new_and_removed_nodes() -> None:
    w = Watcher()
    w.observe(snap(0, UP))
    assert w.observe(snap(5, [*UP, node("n5")])) == [NodeGained("n5", "new", 5)]
    assert w.observe(snap(10, UP)) == [NodeLost("n5", "removed", "", 10)]


def test_controller_requeue_is_not_reported_as_slurms() -> None:
    w = Watcher()
    w.observe(snap(0, UP, [job(1, JobState.RUNNING, ("n1",))]))
    assert w.observe(snap(1, UP, [job(1, JobState.PENDING, restarts=1, reason="JobHeldUser", held=True)])) == []
    assert w.observe(snap(2, UP, [job(1, JobState.PENDING, restarts=1, reason="None")])) == []
    assert w.observe(snap(3, UP, [job(1, JobState.RUNNING, ("n1",), restarts=1)])) == []


def test_finished_and_purged_jobs_and_non_elastic_ones() -> None:
    w = Watcher()
    w.observe(snap(0, UP, [job(1, JobState.RUNNING, ("n1",)), job(2, JobState.RUNNING, ("n2",)),
                           job(3, JobState.RUNNING, ("n3",), spec=None)]))
    events = w.observe(snap(5, UP, [job(1, JobState.FAILED, ("n1",)), job(3, JobState.COMPLETED, spec=None)]))
    assert set(events) == {JobFinished(1, JobState.FAILED, 5), JobFinished(2, JobState.UNKNOWN, 5)}
    assert w.observe(snap(6, UP, [job(1, JobState.FAILED, ("n1",))])) == []


def test_strigger_program_only_touches_the_wake_file(tmp_path) -> None:
    import subprocess
    wake = tmp_path / "wake"
    prog = write_wake_program(tmp_path / "hint.sh", wake)
    waiter = WakeFile(wake)
    assert not waiter.wait(0.05)
    subprocess.run([str(prog), "n1", "n2"], check=True)
    assert wake.exists() and waiter.wait(1.0)
    assert prog.read_text().count("\n") == 3  # shebang, comment, touch: nothing else runs
    args = strigger_args(prog, "down")
    assert args[:5] == ["strigger", "--set", "--node", "--down", "--flags=PERM"]
    assert args[5] == f"--program={prog.resolve()}"


def test_replace_keeps_node_identity() -> None:
    # Node equality drives "reported once": a changed reason alone is not a new loss.
    w = Watcher()
    down = node("n2", NodeState.DOWN)
    w.observe(snap(0, [UP[0], down]))
    assert w.observe(snap(1, [UP[0], replace(down, reason="Not responding")])) == []


def test_memory_stays_bounded_as_jobs_come_and_go() -> None:
    w = Watcher()
    for i in range(50):
        w.observe(snap(i, UP, [job(i, JobState.RUNNING, ("n1",))]))
        w.observe(snap(i + 0.5, UP, [job(i, JobState.COMPLETED, ("n1",))]))
    w.observe(snap(100, UP, []))
    assert not w._finished and not w._ran_on and not w._restarts
