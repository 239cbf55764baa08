"""The timeline's JSON-lines form: every event kind survives a round trip; malformed input is refused."""

from __future__ import annotations

import pytest

from slurm_elastic.demo.timeline import Acked, ControllerNote, DemoAction, JobSeen, NodeSeen, Progress, Timeline
from slurm_elastic.errors import ElasticError
from tests.demo.timelines import demo_timeline


def test_round_trip_keeps_every_event_and_the_header(tmp_path):
    timeline = demo_timeline()
    path = tmp_path / "timeline.jsonl"
    timeline.write(path)
    again = Timeline.read(path)
    assert again == timeline
    kinds = {type(e) for e in again.events}
    assert kinds == {DemoAction, NodeSeen, JobSeen, Progress, Acked}


def test_controller_notes_and_job_nodes_round_trip():
    t = Timeline(started_at=5.0, jobs=(), events=(
        JobSeen(t=1.0, job="7", state="RUNNING", gpus=4, nodes=("n1", "n3"), restarts=2, start=0.5),
        ControllerNote(t=2.0, text="job 7: 4->8 GPUs (2x4, running; grow)")), ended_at=3.0)
    again = Timeline.from_jsonl(t.to_jsonl())
    assert again.events[0].nodes == ("n1", "n3")
    assert again == t and again.duration == 3.0


def test_events_are_put_in_time_order():
    text = Timeline(started_at=0.0, jobs=(), events=(DemoAction(t=5.0, action="note"),
                                                     DemoAction(t=1.0, action="note"))).to_jsonl()
    assert [e.t for e in Timeline.from_jsonl(text).events] == [1.0, 5.0]


HEADER = '{"kind": "header", "started_at": 0, "jobs": []}\n'


@pytest.mark.parametrize("text", ["", '{"kind": "action", "t": 1}\n', HEADER + '{"kind": "bogus", "t": 1}\n',
                                  HEADER + '{"kind": "progress", "t": 1}\n'])
def test_malformed_timelines_are_refused(text):
    with pytest.raises(ElasticError):
        Timeline.from_jsonl(text)
