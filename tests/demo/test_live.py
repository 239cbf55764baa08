"""The live view's model and its two faces: sentences for what happened, a plain log, a rich panel."""

from __future__ import annotations

from rich.console import Console

from slurm_elastic.demo.live import DemoState, PlainView, render
from slurm_elastic.demo.timeline import Acked, ControllerNote, DemoAction, JobInfo, JobSeen, NodeSeen, Progress


def _state():
    return DemoState([JobInfo("4", "digits-a", 4, 8)])


def test_events_become_sentences_and_first_rows_of_a_run_are_announced():
    s = _state()
    told = s.apply([
        DemoAction(t=1.0, action="submit", subject="4", text="submitted digits-a as job 4"),
        NodeSeen(t=1.0, node="n1", state="idle", available=True, gpus=4),
        JobSeen(t=2.0, job="4", state="RUNNING", gpus=8, nodes=("n1", "n2"), start=1.5),
        Progress(t=9.0, job="4", step=1, gpus=8), Progress(t=9.5, job="4", step=2, gpus=8),
        NodeSeen(t=10.0, node="n1", state="down", available=False, gpus=4),
        JobSeen(t=11.0, job="4", state="PENDING", gpus=8, restarts=1, reason="BeginTime"),
        ControllerNote(t=11.5, text="job 4: 8->4 GPUs"),
        JobSeen(t=12.0, job="4", state="RUNNING", gpus=4, nodes=("n3",), restarts=1, start=12.0),
        Progress(t=20.0, job="4", step=11, gpus=4),
        Acked(t=30.0, job="4", restart=1, step=40),
    ])
    text = [line.split("s  ", 1)[1] for line in told]
    assert text == [
        "submitted digits-a as job 4",
        "Slurm: digits-a (4) running on n1,n2 with 8 GPUs",
        "digits-a (4) training at step 1 on 8 GPUs",
        "Slurm: node n1 is DOWN (unavailable)",
        "Slurm: digits-a (4) PENDING (BeginTime)",
        "controller: job 4: 8->4 GPUs",
        "Slurm: digits-a (4) running on n3 with 4 GPUs, restart 1",
        "digits-a (4) training at step 11 on 4 GPUs",
        "digits-a (4) committed its checkpoint at step 40 on the signal (ACK)",
    ]
    [line] = s.job_lines()
    assert (line.state, line.gpus, line.step, line.restarts) == ("RUNNING", 4, 11, 1)


def test_plain_view_logs_phases_happenings_and_periodic_progress():
    lines: list[str] = []
    now = [0.0]
    view = PlainView(lines.append, every_s=10.0, clock=lambda: now[0])
    s = _state()
    s.phase = "waiting"
    view.update(s, s.apply([JobSeen(t=1.0, job="4", state="RUNNING", gpus=8, nodes=("n1",), start=1.0)]))
    now[0] = 11.0
    view.update(s, s.apply([Progress(t=5.0, job="4", step=3, gpus=8)]))
    assert lines[0].endswith("== waiting")
    assert "running on n1 with 8 GPUs" in lines[1]
    assert lines[-1].endswith("digits-a running 8 GPUs step 3")


def test_rich_panel_shows_nodes_jobs_and_what_happened():
    s = _state()
    s.phase = "waiting for the jobs to grow"
    s.apply([NodeSeen(t=0.0, node="n1", state="allocated", available=True, gpus=4),
             JobSeen(t=1.0, job="4", state="RUNNING", gpus=4, nodes=("n1",), start=1.0),
             Progress(t=5.0, job="4", step=3, gpus=4, steps_per_s=2.5)])
    console = Console(width=160, record=True)
    console.print(render(s))
    out = console.export_text()
    for text in ("waiting for the jobs to grow", "n1", "ALLOCATED", "4/4", "digits-a (4)", "2.5", "training at step 3"):
        assert text in out
