"""The recorder: snapshots become change events; metrics rows, ACK files and controller lines are read incrementally."""

from __future__ import annotations

import json

from slurm_elastic.cluster.model import ClusterState, Job, JobState, Node, NodeFlag, NodeState
from slurm_elastic.demo.recorder import TimelineRecorder
from slurm_elastic.demo.timeline import Acked, ControllerNote, JobInfo, JobSeen, NodeSeen, Progress
from slurm_elastic.spec import ElasticSpec

T0 = 1_000.0


def _state(at, nodes, jobs=()):
    return ClusterState(nodes=tuple(nodes), jobs=tuple(jobs), taken_at=T0 + at)


def _node(name, state=NodeState.IDLE, flags=()):
    return Node(name=name, state=state, flags=frozenset(flags), gpus=4, cpus=8, mem_mb=16000)


def _job(jid, state=JobState.RUNNING, nodes=("n1",), restarts=0, start=T0 + 1):
    return Job(job_id=jid, user="root", name="j", state=state, nodes=nodes, num_nodes=len(nodes) or 1,
               gpus_per_node=4, restarts=restarts, start_time=start, spec=ElasticSpec(2, 8))


def test_only_changes_become_events_and_only_for_the_demo_jobs():
    rec = TimelineRecorder(T0)
    rec.add_job(JobInfo("5", "a", 2, 8))
    first = rec.observe(_state(1.0, [_node("n1"), _node("n2")], [_job(5), _job(99)]))
    assert [type(e) for e in first] == [NodeSeen, NodeSeen, JobSeen]
    assert rec.observe(_state(2.0, [_node("n1"), _node("n2")], [_job(5), _job(99)])) == []
    down = rec.observe(_state(3.0, [_node("n1"), _node("n2", NodeState.DOWN, [NodeFlag.NOT_RESPONDING])],
                              [_job(5, JobState.PENDING, nodes=(), restarts=1, start=None)]))
    node, job = down
    assert node == NodeSeen(t=3.0, node="n2", state="down+not_responding", available=False, gpus=4)
    assert (job.state, job.restarts, job.start, job.nodes) == ("PENDING", 1, None, ())


def test_a_new_start_time_is_a_new_run_even_at_the_same_size():
    rec = TimelineRecorder(T0)
    rec.add_job(JobInfo("5", "a", 2, 8))
    rec.observe(_state(1.0, [_node("n1")], [_job(5, start=T0 + 1)]))
    [e] = rec.observe(_state(9.0, [_node("n1")], [_job(5, restarts=1, start=T0 + 8)]))
    assert (e.start, e.restarts) == (8.0, 1)


def test_a_job_that_leaves_squeue_is_gone_once():
    rec = TimelineRecorder(T0)
    rec.add_job(JobInfo("5", "a", 2, 8))
    rec.observe(_state(1.0, [_node("n1")], [_job(5)]))
    [gone] = rec.observe(_state(2.0, [_node("n1")], []))
    assert gone.state == "GONE"
    assert rec.observe(_state(3.0, [_node("n1")], [])) == []


def test_metrics_rows_are_read_once_and_a_half_written_line_waits(tmp_path):
    rec = TimelineRecorder(T0, ckpt_root=tmp_path)
    rec.add_job(JobInfo("5", "a", 2, 8))
    job_dir = tmp_path / "5"
    job_dir.mkdir()
    metrics = job_dir / "metrics.jsonl"
    assert rec.read_files() == []
    metrics.write_text(json.dumps({"step": 1, "time": T0 + 2, "gpus": 4, "steps_per_s": 3.0}) + "\n"
                       + '{"step": 2, "ti')
    [row] = rec.read_files()
    assert row == Progress(t=2.0, job="5", step=1, gpus=4, steps_per_s=3.0)
    with metrics.open("a") as f:
        f.write('me": %r, "gpus": 4}\nnot json\n' % (T0 + 3))
    [row2] = rec.read_files()
    assert (row2.step, row2.t) == (2, 3.0)
    assert rec.read_files() == []


def test_acks_are_found_with_their_restart_count_and_step(tmp_path):
    rec = TimelineRecorder(T0, ckpt_root=tmp_path)
    rec.add_job(JobInfo("5", "a", 2, 8))
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "ACK-5-1").write_text(json.dumps({"step": 40, "time": T0 + 7}))
    (tmp_path / "5" / "ACK-6-0").write_text(json.dumps({"step": 1, "time": T0}))   # another job's name
    (tmp_path / "5" / "ACK-5-2").write_text('{"step": ')                          # being written
    assert rec.read_files() == [Acked(t=7.0, job="5", restart=1, step=40)]
    (tmp_path / "5" / "ACK-5-2").write_text(json.dumps({"step": 90, "time": T0 + 20}))
    assert rec.read_files() == [Acked(t=20.0, job="5", restart=2, step=90)]


def test_controller_plan_lines_become_notes_once_at_their_logged_time(tmp_path):
    import time

    log = tmp_path / "controller.log"
    now = [T0 + 4]
    rec = TimelineRecorder(T0, controller_log=log, clock=lambda: now[0])
    logged = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(T0 + 2)) + ",250"
    log.write_text("2026 INFO reconcile: job 4: 8->4 GPUs (1x4, pending; requeued by Slurm)\n"
                   "2026 INFO journal: job 4: plan 1 opened: job 4: 8->4 GPUs (1x4, pending; requeued by Slurm)\n"
                   "2026 INFO cli_backend: Slurm 22.05.8 detected\n"
                   f"{logged} WARNING reconcile: node n2 lost\n")
    notes = rec.read_files()
    assert notes == [ControllerNote(t=4.0, text="job 4: 8->4 GPUs (1x4, pending; requeued by Slurm)"),
                     ControllerNote(t=2.25, text="node n2 lost")]


def test_take_new_hands_out_each_event_once_including_actions():
    rec = TimelineRecorder(T0, clock=lambda: T0 + 1)
    rec.add_job(JobInfo("5", "a", 2, 8))
    rec.action("submit", "5", "submitted a")
    rec.observe(_state(1.0, [_node("n1")], [_job(5)]))
    assert [e.kind for e in rec.take_new()] == ["action", "node", "job"]
    assert rec.take_new() == []
    assert len(rec.timeline().events) == 3
