"""Each record of the contract round-trips from its writer to its reader; each reader refuses hostile files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable

import pytest

from slurm_elastic import jobfiles
from slurm_elastic.errors import JobFileRefused
from slurm_elastic.jobfiles import (Ack, BatchRange, Geometry, Heartbeat, LauncherStopped, LostRank, MetricsRow,
                                    PeerLostReport, read_metrics, read_record, read_user_file)

ME = os.geteuid()
REPORT = PeerLostReport(job_id="7", restart_count=1, step_id=0, world_size=4, detected_by="heartbeat",
                        detected_at=1.7e9, lost=(LostRank(2, "n2"), LostRank(3, "n2")), lost_nodes=("n2",),
                        surviving_nodes=("n1",), agreed_step=40, commit="done", committed_step=40, reason="rank 2 silent")
ROW = MetricsRow(step=10, time=1.7e9, gpus=4, steps_per_s=2.5, nodes=2, total_steps=100, samples_per_s=320.0,
                 batch=128, grad_sqr=0.5, grad_var=3.0)

# kind -> (the record as its writer writes it, the reader's parse, the size bound its caller uses)
RECORDS: dict[str, tuple[object, Callable[[object], object], int]] = {
    "geometry": (Geometry(4, (1, 2, 4, 8), global_batch=64, micro_batch=8, nearest_valid_world_size=4),
                 Geometry.parse, jobfiles.GEOMETRY_MAX_BYTES),
    "batch": (BatchRange(32, 1024, 128), BatchRange.parse, jobfiles.BATCH_MAX_BYTES),
    "ack": (Ack(step=40, time=1.7e9, committed=True, world_size=4), Ack.parse, jobfiles.ACK_MAX_BYTES),
    "heartbeat": (Heartbeat(seq=3, rank=1, node="n1", pid=1234, state="running"), Heartbeat.parse,
                  jobfiles.HEARTBEAT_MAX_BYTES),
    "peer-lost": (REPORT, PeerLostReport.from_value, 1 << 16),
}


def _read(kind: str, path: Path, owner: int | None = ME) -> tuple[object | None, str]:
    if kind == "metrics":
        got = read_metrics(str(path), owner_uid=owner, max_bytes=1 << 20)
        return (got.rows[0] if got.rows else None), got.problem or ("bad" if got.bad else "")
    _, parse, bound = RECORDS[kind]
    return read_record(str(path), parse, owner_uid=owner, max_bytes=bound, what="a record")


def _bytes(kind: str) -> bytes:
    return ROW.to_line() if kind == "metrics" else RECORDS[kind][0].to_bytes()  # type: ignore[attr-defined]


ALL = ["metrics", *RECORDS]


@pytest.mark.parametrize("kind", ALL)
def test_the_writers_bytes_read_back_as_the_same_record(kind: str, tmp_path: Path) -> None:
    path = tmp_path / kind
    path.write_bytes(_bytes(kind))
    record, problem = _read(kind, path)
    assert problem == ""
    assert record == (ROW if kind == "metrics" else RECORDS[kind][0])


def test_launcher_stopped_round_trips(tmp_path: Path) -> None:
    for said in (LauncherStopped(True), LauncherStopped(False)):
        (tmp_path / "m").write_bytes(said.to_bytes())
        data = read_user_file(str(tmp_path / "m"), owner_uid=ME, max_bytes=64, what="a marker")
        assert data is not None and LauncherStopped.parse_bytes(data) == said


def _hostile(kind: str, case: str, path: Path, tmp_path: Path) -> None:
    good = _bytes(kind)
    if case == "symlink":
        (tmp_path / "elsewhere").write_bytes(good)
        os.symlink(tmp_path / "elsewhere", path)
    elif case == "fifo":
        os.mkfifo(path)        # a reader that opened it blocking would hang here
    elif case == "other-owner":
        path.write_bytes(good)
        os.chown(path, 65534, 65534)
    elif case == "oversized":
        path.write_bytes(good.rstrip(b"\n")[:-1] + b', "pad": "' + b"x" * (1 << 17) + b'"}\n')
    elif case == "deep":
        path.write_bytes(b"[" * 100000 + b"\n")
    elif case in ("nan", "inf", "string-number", "bool-for-int"):
        body = json.loads(good)
        field = {"metrics": "time", "geometry": "world_size", "batch": "min", "ack": "time",
                 "heartbeat": "seq", "peer-lost": "detected_at"}[kind]
        body[field] = {"nan": math.nan, "inf": math.inf, "string-number": "NaN", "bool-for-int": True}[case]
        path.write_text(json.dumps(body) + "\n")


CASES = ["symlink", "fifo", "other-owner", "oversized", "deep", "nan", "inf", "string-number", "bool-for-int"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ALL)
def test_each_reader_refuses_a_hostile_file_with_a_reason(kind: str, case: str, tmp_path: Path) -> None:
    if case == "other-owner" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    path = tmp_path / kind
    _hostile(kind, case, path, tmp_path)
    record, problem = _read(kind, path)
    assert record is None and problem


@pytest.mark.parametrize("case", ["symlink", "fifo", "other-owner", "oversized"])
def test_the_marker_reader_refuses_what_is_not_a_small_regular_file_of_the_owner(case: str, tmp_path: Path) -> None:
    if case == "other-owner" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    path = tmp_path / "launcher-stopped"
    _hostile("batch", case, path, tmp_path)
    with pytest.raises(JobFileRefused):
        read_user_file(str(path), owner_uid=ME, max_bytes=64, what="a marker")


def test_a_peer_lost_report_with_a_nan_detection_time_is_refused() -> None:
    body = REPORT.to_json()
    for bad in ("NaN", math.nan, math.inf, "1.7e9", None, True):
        body["detected_at"] = bad
        with pytest.raises(JobFileRefused, match="detected_at|NaN|Infinity"):
            PeerLostReport.parse(json.dumps(body))


def test_writers_refuse_what_the_reader_would_refuse() -> None:
    with pytest.raises(JobFileRefused):
        MetricsRow(step=1, time=math.nan, gpus=1, steps_per_s=1.0)
    with pytest.raises(JobFileRefused):
        MetricsRow(step=1, time=1.0, gpus=1, steps_per_s=1.0, grad_sqr=1.0)   # the pair, or neither


def test_the_metrics_reader_bounds_a_line_that_never_ends(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(ROW.to_line())
    got = read_metrics(str(path), owner_uid=ME, max_bytes=1 << 20)
    cursor = got.cursor
    for _ in range(60):                                  # 60 appends of 900 KiB, no newline
        with open(path, "ab") as f:
            f.write(b"x" * (900 << 10))
        got = read_metrics(str(path), owner_uid=ME, max_bytes=1 << 20, cursor=cursor)
        assert got.rows == [] and len(cursor.partial) <= jobfiles.metrics.MAX_LINE_BYTES
    with open(path, "ab") as f:                          # the line ends; the next row counts again
        f.write(b"\n" + ROW.to_line())
    got = read_metrics(str(path), owner_uid=ME, max_bytes=1 << 20, cursor=cursor)
    assert got.rows == [ROW] and got.bad == 1
    assert len([r for r in caplog.records if "longer than" in r.getMessage()]) == 1


def test_a_file_of_over_long_lines_is_logged_once_and_counted_always(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A probe's file wrote 64 over-long lines a cycle, each one warning in the root daemon's log."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"")
    cursor = read_metrics(str(path), owner_uid=ME, max_bytes=1 << 20).cursor
    bad = 0
    for _ in range(3):
        with open(path, "ab") as f:
            f.write((b"y" * (jobfiles.metrics.MAX_LINE_BYTES + 1) + b"\n") * 20 + ROW.to_line())
        got = read_metrics(str(path), owner_uid=ME, max_bytes=1 << 20, cursor=cursor)
        assert got.rows == [ROW]
        bad += got.bad
    assert bad == 60
    assert len([r for r in caplog.records if "longer than" in r.getMessage()]) == 1


def test_a_torn_last_line_waits_for_its_end(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    line = ROW.to_line()
    path.write_bytes(line + line[:20])
    got = read_metrics(str(path), owner_uid=ME, max_bytes=1 << 20)
    assert got.rows == [ROW] and got.cursor.partial == line[:20]
    with open(path, "ab") as f:
        f.write(line[20:])
    got = read_metrics(str(path), owner_uid=ME, max_bytes=1 << 20, cursor=got.cursor)
    assert got.rows == [ROW] and got.bad == 0
