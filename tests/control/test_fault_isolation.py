"""One job's input cannot stop the controller: a reader that raises costs that job its measurements only."""

from __future__ import annotations

import getpass
import json
import os

import pytest
from prometheus_client import generate_latest

from slurm_elastic.cluster.memory import InMemorySlurm
from slurm_elastic.cluster.model import JobState
from slurm_elastic.control.requests import measuring as requests_module
from slurm_elastic.control.daemon import Loop
from slurm_elastic.control.journal import Journal
from slurm_elastic.control.metrics import ControllerMetrics
from slurm_elastic.control.protocol import ProtocolSettings
from slurm_elastic.control.reconcile import ControllerConfig, Reconciler
from slurm_elastic.spec import ElasticSpec
from slurm_elastic import jobfiles as shim

ME = getpass.getuser()


def _reconciler(slurm: InMemorySlurm, tmp_path, **kw) -> Reconciler:
    config = ControllerConfig(protocol=ProtocolSettings(ack_timeout_s=0.1, settle_timeout_s=0.5),
                              min_resize_interval_s=0, node_confirm_s=0)
    return Reconciler(slurm, Journal(tmp_path / "j.sqlite"), config, **kw)


@pytest.fixture
def two(tmp_path):
    slurm = InMemorySlurm(nodes=2)
    ckpt = str(tmp_path / "ckpt")
    a = slurm.add_job(ElasticSpec(1, 4, ckpt_dir=ckpt), nodes=1, gpus_per_node=1, user=ME)
    b = slurm.add_job(ElasticSpec(1, 4, ckpt_dir=ckpt), nodes=1, gpus_per_node=1, user=ME)
    return slurm, ckpt, a, b


def _geometry_raises_for(monkeypatch, job_id: int, exc: BaseException) -> None:
    real = requests_module.read_job_geometry

    def hook(path, **kw):
        if f"{os.sep}{job_id}{os.sep}" in path:
            raise exc
        return real(path, **kw)

    monkeypatch.setattr(requests_module, "read_job_geometry", hook)


@pytest.mark.parametrize("exc", [RecursionError("maximum recursion depth exceeded"), KeyError("world_size")])
def test_a_reader_that_raises_for_one_job_gives_it_the_default_model_and_the_cycle_completes(
        two, tmp_path, monkeypatch, caplog, exc):
    slurm, ckpt, a, b = two
    _geometry_raises_for(monkeypatch, a, exc)
    rec = _reconciler(slurm, tmp_path)
    for _ in range(3):
        report = rec.cycle()
    assert report.allocation is not None
    assert {j.job_id for j in slurm.jobs.values() if j.state is JobState.RUNNING} == {a, b}
    assert slurm.jobs[a].gpus == 4 and slurm.jobs[b].gpus == 4      # both grew: the cycles did their work
    assert "its files could not be used" in report.allocation.basis[str(a)]
    assert "could not be used" not in report.allocation.basis[str(b)]
    said = [r for r in caplog.records if f"job {a}" in r.getMessage() and type(exc).__name__ in r.getMessage()]
    assert len(said) == 1                                            # one line, not one per cycle


def test_a_metrics_line_nested_past_the_recursion_limit_does_not_end_the_daemon(two, tmp_path):
    slurm, ckpt, a, b = two
    path = shim.metrics_path(ckpt, shim.job_key(a))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps({"step": 1, "time": 0, "gpus": 1, "steps_per_s": 1.0}) + "\n")
        f.write("[" * 100000 + "\n")
    metrics = ControllerMetrics()
    loop = Loop(_reconciler(slurm, tmp_path), interval_s=0.01, metrics=metrics)
    loop.run(max_cycles=2)
    assert loop.cycles == 2
    assert "slurm_elastic_cycle_errors_total 0.0" in generate_latest(metrics.registry).decode()
    assert slurm.jobs[b].gpus == 4


class _BrokenSource:
    """A request source (the Reconciler's seam) with a defect that a job's input reaches."""

    def requests(self, state, now, policy):
        raise KeyError("gpus")


def test_a_request_source_that_fails_whole_leaves_every_job_on_the_default_model(two, tmp_path, caplog):
    slurm, _, a, b = two
    report = _reconciler(slurm, tmp_path, requests=_BrokenSource()).cycle()
    assert report.allocation is not None and report.target(a) == 4 and report.target(b) == 4
    assert any("request source failed" in r.getMessage() for r in caplog.records)


def test_the_loop_survives_an_internal_error_in_a_cycle_and_counts_it(two, tmp_path):
    slurm, _, a, _ = two
    rec = _reconciler(slurm, tmp_path)
    real = rec.cycle
    calls = {"n": 0}

    def flaky(**kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ZeroDivisionError("a defect")
        return real(**kw)

    rec.cycle = flaky  # type: ignore[method-assign]
    metrics = ControllerMetrics()
    loop = Loop(rec, interval_s=0.01, metrics=metrics)
    loop.run(max_cycles=2)
    assert loop.cycles == 2 and slurm.jobs[a].gpus == 4
    assert "slurm_elastic_cycle_errors_total 1.0" in generate_latest(metrics.registry).decode()
