"""One controller everywhere: the daemon, `admin rebalance`, user-mode watch and the simulator build the same Reconciler."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_elastic.allocate.repair import RepairingSolver
from slurm_elastic.cli import main
from slurm_elastic.control import reconcile
from slurm_elastic.control.requests import MeasuredRequests
from slurm_elastic.spec import ElasticSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from control.fake_slurm import FakeSlurm  # noqa: E402


@pytest.fixture
def built(monkeypatch, tmp_path):
    """Every Reconciler constructed, and every request source made by the one factory."""
    made, sources = [], []
    real_init, real_factory = reconcile.Reconciler.__init__, reconcile.default_request_source

    def init(self, *a, **k):
        real_init(self, *a, **k)
        made.append(self)

    def factory(*a, **k):
        source = real_factory(*a, **k)
        sources.append(source)
        return source

    monkeypatch.setattr(reconcile.Reconciler, "__init__", init)
    monkeypatch.setattr(reconcile, "default_request_source", factory)
    fake = FakeSlurm()
    fake.add_job(ElasticSpec(1, 4), nodes=1, gpus_per_node=1)
    monkeypatch.setattr("slurm_elastic.cluster.select.select_backend", lambda *a, **k: fake)
    monkeypatch.setenv("SLURM_ELASTIC_DAEMON_DIR", str(tmp_path / "daemon"))
    monkeypatch.setenv("SLURM_ELASTIC_STATE_DIR", str(tmp_path / "user"))
    return made, sources


def test_daemon_rebalance_and_simulator_use_the_same_reconciler_and_request_source(built):
    from slurm_elastic.sim.controller import ControllerPolicy

    made, sources = built
    for args in (["admin", "daemon", "--interval", "0.5", "--max-cycles", "1", "--ack-timeout", "0"], ["admin", "rebalance", "--dry-run"]):
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
    policy = ControllerPolicy()
    assert len(made) == 3 and policy.reconciler is made[-1]
    assert all(type(r) is reconcile.Reconciler for r in made)
    assert [r.requests for r in made] == sources                 # each from the one factory
    assert all(type(s) is MeasuredRequests for s in sources)
    # the L1 MILP, with the warm path between its full solves on large clusters, unless told otherwise
    assert all(type(r.allocator) is RepairingSolver and r.allocator.full is reconcile.solve for r in made)
    policy.close()
