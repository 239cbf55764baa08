"""Fuzzing the contract's readers: whatever a job writes, a reader returns a record or the documented refusal."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_elastic.errors import JobFileRefused
from slurm_elastic.jobfiles import (BatchRange, Geometry, Heartbeat, MetricsCursor, MetricsRow, PeerLostReport,
                                    load_json, read_metrics)
from tests.jobfiles.test_records import RECORDS, ROW

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=6)),
                      max_leaves=30)

PARSERS = {"metrics": MetricsRow.from_value, "geometry": Geometry.parse, "batch": BatchRange.parse,
           "heartbeat": Heartbeat.parse, "peer-lost": PeerLostReport.from_value}
VALID = {"metrics": json.loads(ROW.to_line()), **{k: json.loads(RECORDS[k][0].to_bytes()) for k in PARSERS
                                                  if k != "metrics"}}  # type: ignore[attr-defined]


def _only_refused(parse, value: object) -> None:
    try:
        parse(value)
    except JobFileRefused:
        pass


@pytest.mark.parametrize("kind", sorted(PARSERS))
@FUZZ
@given(value=values)
def test_any_json_value_gives_a_record_or_the_refusal(kind: str, value: object) -> None:
    _only_refused(PARSERS[kind], value)


@pytest.mark.parametrize("kind", sorted(PARSERS))
@FUZZ
@given(data=st.data())
def test_a_valid_record_with_one_field_changed_gives_a_record_or_the_refusal(kind: str, data: st.DataObject) -> None:
    body = dict(VALID[kind])
    field = data.draw(st.sampled_from(sorted(body) + ["extra"]))
    body[field] = data.draw(values)
    try:
        record = PARSERS[kind](body)
    except JobFileRefused:
        return
    for name in type(record).__slots__:                       # what is accepted is typed and finite
        v = getattr(record, name)
        assert not isinstance(v, float) or math.isfinite(v)


@FUZZ
@given(data=st.binary(max_size=2000))
def test_any_bytes_load_as_json_or_are_refused(data: bytes) -> None:
    try:
        load_json(data)
    except JobFileRefused:
        pass


@FUZZ
@given(chunks=st.lists(st.one_of(st.binary(max_size=300), st.sampled_from([b"[" * 5000, b"\n", ROW.to_line(),
                                                                          b'{"step": NaN}\n'])), max_size=12))
def test_the_metrics_reader_never_raises_on_appended_bytes(chunks: list[bytes], tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.unlink(missing_ok=True)
    cursor = MetricsCursor()
    for chunk in chunks:
        with open(path, "ab") as f:
            f.write(chunk)
        got = read_metrics(str(path), owner_uid=os.geteuid(), max_bytes=4096, cursor=cursor)
        cursor = got.cursor
        assert all(isinstance(r, MetricsRow) for r in got.rows)
