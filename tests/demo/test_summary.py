"""The demo's numbers from recorded timelines: runs, restarts, steps lost, recovery, and the checks."""

from __future__ import annotations

import dataclasses

from slurm_elastic.demo.summary import runs_of, summarize
from slurm_elastic.demo.timeline import JobInfo, JobSeen, Progress, Timeline
from tests.demo.timelines import demo_timeline, rows


def _job(summary, name):
    return next(j for j in summary.jobs if j.name == name)


def test_node_loss_restart_loses_the_steps_since_the_periodic_checkpoint():
    s = summarize(demo_timeline())
    a = _job(s, "digits-a")
    [restart] = a.restarts
    assert (restart.last_step, restart.resumed_from, restart.steps_lost) == (58, 50, 8)
    assert not restart.signalled and restart.cause == "n2 lost"
    assert (restart.gpus_before, restart.gpus_after) == (8, 4)
    assert a.gpu_sequence == (8, 4)


def test_signalled_restart_loses_nothing_and_records_the_ack():
    s = summarize(demo_timeline())
    [restart] = _job(s, "digits-b").restarts
    assert restart.signalled and restart.ack_step == 230
    assert (restart.last_step, restart.resumed_from, restart.steps_lost) == (230, 230, 0)
    assert restart.cause == "n5 gained" and restart.downtime_s == 135.0 - 124.5


def test_recovery_time_per_event_and_jobs_that_kept_training():
    s = summarize(demo_timeline())
    assert [e.label for e in s.events] == ["n2 lost", "n5 gained"]
    assert s.events[0].slurm_t == 70.0 and s.events[1].slurm_t == 123.0
    lost, gained = _job(s, "digits-a").after_events
    assert lost.restarted and lost.recovery_s == 80.0 - 40.0 and lost.trained_after
    assert not gained.restarted and gained.recovery_s is None and gained.trained_after
    c = _job(s, "digits-c")
    assert c.restarts == () and all(a.trained_after and not a.restarted for a in c.after_events)
    assert s.problems() == []


def test_a_signalled_restart_that_loses_steps_is_a_problem():
    s = summarize(demo_timeline(b_resume_gap=3))
    [restart] = _job(s, "digits-b").restarts
    assert restart.steps_lost == 3
    assert any("digits-b: signalled restart 1 lost 3 steps" in p for p in s.problems())


def test_an_unsignalled_restart_may_lose_steps_without_a_problem():
    s = summarize(demo_timeline(b_signalled=False, b_resume_gap=3))
    assert not _job(s, "digits-b").restarts[0].signalled
    assert s.problems() == []


def test_a_job_that_never_resumes_did_not_train_after_the_event():
    s = summarize(demo_timeline(a_resumes=False))
    lost = _job(s, "digits-a").after_events[0]
    assert lost.restarted and lost.recovery_s is None and not lost.trained_after
    assert "digits-a: did not train after n2 lost" in s.problems()


def test_too_many_restarts_are_a_problem():
    jobs = (JobInfo("1", "j", 1, 4),)
    events = []
    for i in range(4):
        start = i * 20.0
        events.append(JobSeen(t=start, job="1", state="RUNNING", gpus=2, restarts=i, start=start))
        events += rows("1", start + 1, start + 5, i * 10 + 1, 2)
        events.append(JobSeen(t=start + 10, job="1", state="PENDING", gpus=2, restarts=i + 1))
    s = summarize(Timeline(started_at=0.0, jobs=jobs, events=tuple(events), ended_at=80.0))
    assert len(s.jobs[0].restarts) == 3
    assert s.problems(max_restarts=2) == ["j: restarted 3 times (at most 2 expected)"]


def test_a_restart_the_polling_missed_is_found_where_the_step_goes_back():
    jobs = (JobInfo("1", "j", 1, 4),)
    events = [JobSeen(t=0.0, job="1", state="RUNNING", gpus=2, start=0.0)]
    events += rows("1", 1.0, 10.0, 1, 2)          # steps 1..19
    events += rows("1", 15.0, 20.0, 11, 2)        # resumed from 10, seen only in the metrics
    runs = runs_of(Timeline(started_at=0.0, jobs=jobs, events=tuple(events)), "1")
    assert [r.first_step for r in runs] == [1, 11]
    s = summarize(Timeline(started_at=0.0, jobs=jobs, events=tuple(events), ended_at=21.0))
    assert s.jobs[0].restarts[0].steps_lost == 19 - 10


def test_a_relaunch_in_place_is_a_restart_found_where_the_rows_change_gpus():
    # Slurm's run goes on (no new start); the ranks came back on 2 GPUs, resuming at the committed step.
    jobs = (JobInfo("1", "j", 1, 4),)
    events = [JobSeen(t=0.0, job="1", state="RUNNING", gpus=4, start=0.0)]
    events += rows("1", 1.0, 10.0, 1, 4)          # steps 1..19 on 4 GPUs
    events += rows("1", 16.0, 20.0, 20, 2)        # step 19 committed just in time: 20.. on 2
    runs = runs_of(Timeline(started_at=0.0, jobs=jobs, events=tuple(events)), "1")
    assert [(r.first_step, r.gpus) for r in runs] == [(1, 4), (20, 2)]
    s = summarize(Timeline(started_at=0.0, jobs=jobs, events=tuple(events), ended_at=21.0))
    [restart] = s.jobs[0].restarts
    assert (restart.last_step, restart.resumed_from, restart.steps_lost) == (19, 19, 0)
    assert (restart.gpus_before, restart.gpus_after) == (4, 2)


def test_gpus_over_time_follows_slurm_and_counts_zero_while_not_running():
    s = summarize(demo_timeline())
    a = _job(s, "digits-a")
    assert [g for _, g in a.gpus_over_time] == [8, 0, 4]


def test_summary_json_is_plain_data():
    import json

    body = summarize(demo_timeline(), phases={"x": 1.234}).to_json()
    again = json.loads(json.dumps(body))
    assert again["phases_s"] == {"x": 1.23}
    job_a = next(j for j in again["jobs"] if j["name"] == "digits-a")
    assert job_a["restarts"] == 1 and job_a["steps_lost"] == [8] and job_a["gpus"] == [8, 4]
    assert again["problems"] == []


def test_a_job_that_never_trained_is_a_problem():
    t = demo_timeline()
    t = dataclasses.replace(t, events=tuple(e for e in t.events if not (isinstance(e, Progress) and e.job == "13")))
    assert "digits-c: never trained" in summarize(t).problems()


def test_a_signalled_restart_after_a_rollback_counts_from_the_run_just_before():
    """Seen in CI: a node-loss restart rolled a job back to step 0; its later signalled restart lost
    nothing, but counting from the highest step of *all* earlier runs reported 1 step lost."""
    from slurm_elastic.demo.timeline import Acked
    from tests.demo.timelines import demo_timeline as base

    t = base()
    kept = [e for e in t.events if not (isinstance(e, Progress) and e.job == "11" and e.t >= 80.0)]
    extra = [*rows("11", 80.0, 82.0, 1, 4),                        # restarted from scratch: steps 1-5
             Acked(t=83.0, job="11", restart=1, step=5),
             JobSeen(t=84.0, job="11", state="PENDING", gpus=4, restarts=2, held=True, reason="JobHeldUser"),
             JobSeen(t=85.0, job="11", state="RUNNING", gpus=8, nodes=("n1", "n2"), restarts=2, start=85.0),
             *rows("11", 90.0, 100.0, 6, 8)]
    t = dataclasses.replace(t, events=tuple(sorted([*kept, *extra], key=lambda e: e.t)))
    first, second = _job(summarize(t), "digits-a").restarts
    assert (first.last_step, first.resumed_from, first.steps_lost) == (58, 0, 58)
    assert second.signalled and second.ack_step == 5
    assert (second.last_step, second.resumed_from, second.steps_lost) == (5, 5, 0)
