"""Throughput models: always concave piecewise-linear, from defaults, tables or measured rows."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_elastic.allocate import (LinearThroughput, fit_throughput, read_metrics, table_throughput,
                                    throughput_from_checkpoints)
from slurm_elastic.allocate.throughput import concave_hull, segments
from slurm_elastic.errors import AllocationError


def test_linear_with_node_penalty():
    m = LinearThroughput(per_gpu=10.0, node_penalty=0.1)
    assert m(0) == 0.0 and m(4) == 40.0 and m(8, 2) == pytest.approx(72.0)


def test_table_takes_the_concave_hull():
    m = table_throughput({1: 10.0, 2: 12.0, 4: 40.0, 8: 60.0})   # 2 GPUs is a dip: the hull goes over it
    assert m(2) == pytest.approx(20.0) and m(4) == 40.0 and m(6) == pytest.approx(50.0)
    assert m(16) >= m(8)                                           # never slower with more GPUs


@given(st.dictionaries(st.integers(1, 64), st.floats(0, 1e4), min_size=1, max_size=12))
def test_hull_is_concave_non_decreasing_and_above_every_point(table):
    hull = concave_hull(table.items())
    slopes = [a for a, _ in segments(hull)]
    assert all(s1 <= s0 + 1e-9 for s0, s1 in zip(slopes, slopes[1:]))
    assert all(s >= -1e-12 for s in slopes)
    m = table_throughput(table)
    for g, s in table.items():
        assert m(g) >= s - 1e-6 * max(1.0, s)


def test_bad_tables():
    with pytest.raises(AllocationError):
        table_throughput({})
    with pytest.raises(AllocationError):
        table_throughput({4: float("nan")})


def test_fit_from_rows():
    rows = [{"step": s, "gpus": g, "nodes": 1, "steps_per_s": 1.0, "samples_per_s": v}
            for s, (g, v) in enumerate([(2, 190.0), (2, 210.0), (2, 200.0), (4, 360.0), (8, 600.0)])]
    m = fit_throughput(rows)
    assert m(2) == pytest.approx(200.0) and m(4) == pytest.approx(360.0) and m(8) == pytest.approx(600.0)
    assert m(6) == pytest.approx(480.0)


def test_fit_with_one_count_is_linear_and_with_none_is_the_default():
    m = fit_throughput([{"gpus": 4, "samples_per_s": 400.0}])
    assert isinstance(m, LinearThroughput) and m(8) == pytest.approx(800.0 * 0.95 ** 0) and m.per_gpu == 100.0
    default = LinearThroughput(per_gpu=7.0)
    assert fit_throughput([], default=default) is default
    assert fit_throughput([{"gpus": "x"}, {"nope": 1}], default=default) is default


def test_read_metrics_skips_torn_lines(tmp_path):
    job_dir = tmp_path / "job-42"
    job_dir.mkdir()
    lines = [json.dumps({"step": 1, "gpus": 2, "nodes": 1, "steps_per_s": 2.0, "samples_per_s": 64.0}),
             "not json", "", json.dumps([1, 2]),
             json.dumps({"step": 2, "gpus": 4, "nodes": 1, "steps_per_s": 1.9, "samples_per_s": 120.0}),
             '{"step": 3, "gpus": 4, "nod']                           # the writer was mid-line
    (job_dir / "metrics.jsonl").write_text("\n".join(lines))
    rows = read_metrics(job_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    m = throughput_from_checkpoints(tmp_path, "job-42")
    assert m(2) == pytest.approx(64.0) and m(4) == pytest.approx(120.0)
    assert read_metrics(tmp_path / "missing.jsonl") == []


# -- the normaliser and the frontier (issue 15) --------------------------------------------------

def test_normaliser_is_the_best_speed_not_an_extrapolation_past_the_peak():
    from slurm_elastic.allocate import AllocationProblem, JobRequest, NodeCapacity
    from slurm_elastic.allocate.instance import Instance

    # yolov3-like: fastest at 2 GPUs, slower beyond; the hull is cut at the peak.
    job = JobRequest("y", 1, 8, throughput={1: 1.0, 2: 1.13, 4: 0.9, 8: 0.5})
    inst = Instance(AllocationProblem((job,), (NodeCapacity("n1", 8, 64, 64000),)))
    assert inst.terms[0].norm == pytest.approx(1.13)
    assert inst.throughput_value(0, 8) == pytest.approx(1.0)     # flat past the peak, never above 1


def test_frontier_skips_counts_the_shape_rule_cannot_place():
    from slurm_elastic.allocate.throughput import speed_frontier

    speeds = {g: float(g) for g in range(1, 9)} | {10: 100.0} | {g: 90.0 + g / 4 for g in range(12, 33, 4)}
    model = lambda g, n=1: speeds.get(g, 0.0)  # noqa: E731
    counts = [g for g in range(1, 33) if g in speeds]
    on_4gpu_nodes = lambda g: g <= 4 or g % 4 == 0  # noqa: E731  (whole 4-GPU nodes when spanning)
    kept = speed_frontier(counts, model, lambda g: -(-g // 4), on_4gpu_nodes)
    assert 10 not in kept and 32 in kept
    assert speed_frontier(counts, model, lambda g: 1, lambda g: True)[-1] == 10   # the old bug, shown


def test_measured_model_states_its_rule_for_sizes_never_run():
    from slurm_elastic.allocate.throughput import measured_throughput

    rows = [{"gpus": 2, "nodes": 1, "steps_per_s": 2.0}, {"gpus": 4, "nodes": 1, "steps_per_s": 3.0}]
    m = measured_throughput(rows)
    assert m(1) == pytest.approx(1.0)            # below: the smallest count's speed per GPU
    assert m(3) == pytest.approx(2.5)            # between: the hull
    assert m(8) == pytest.approx(5.0)            # above: the last marginal gain (0.5/GPU), never more
    assert m(16) == pytest.approx(9.0)
    assert dataclasses.replace(m, explore_factor=2.0)(16) == pytest.approx(5.0)   # capped: flat past 2x
    slower = measured_throughput(rows + [{"gpus": 8, "nodes": 2, "steps_per_s": 2.5}])
    assert slower(8) == pytest.approx(3.0) and slower(16) == pytest.approx(3.0)   # no gain past the peak
    assert measured_throughput([{"gpus": "x", "steps_per_s": 1.0}]) is None
