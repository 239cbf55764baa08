"""Backend selection: --backend / SLURM_ELASTIC_BACKEND / auto, with the reason it gives."""

from __future__ import annotations

import logging
import pytest

from slurm_elastic.cluster.backend import Backend
from slurm_elastic.cluster.select import BackendChoiceError, choose_backend, select_backend
from slurm_elastic.cluster.slurm_values import SlurmVersion
from slurm_elastic.cluster.pyslurm_backend import PyslurmUnusable
from slurm_elastic.errors import SlurmUnavailable

from tests.cluster.captures import load
from tests.cluster.pyslurm_standin import FakePyslurm, FakeSlurmctld


def no_pyslurm():
    raise ModuleNotFoundError("No module named 'pyslurm'")


def pyslurm(version: str):
    """An importer of the pyslurm stand-in (tests/cluster/pyslurm_standin.py) at `version`."""
    module = FakePyslurm(FakeSlurmctld(load("26.05", "squeue.json")), version=version)
    return lambda: module


def test_explicit_cli() -> None:
    sel = choose_backend("cli", env={}, importer=no_pyslurm)
    assert sel.backend.name == "cli" and "--backend" in sel.reason
    assert isinstance(sel.backend, Backend)


def test_env_variable_and_bad_names() -> None:
    sel = choose_backend(None, env={"SLURM_ELASTIC_BACKEND": "CLI"}, importer=no_pyslurm)
    assert sel.backend.name == "cli" and "SLURM_ELASTIC_BACKEND" in sel.reason
    with pytest.raises(BackendChoiceError, match="choose one of auto, cli, pyslurm"):
        choose_backend("slurmrestd", env={})


def test_auto_without_pyslurm_says_why() -> None:
    sel = choose_backend("auto", env={}, importer=no_pyslurm)
    assert sel.backend.name == "cli" and "not importable" in sel.reason and "No module named" in sel.reason


def test_auto_with_mismatched_pyslurm() -> None:
    sel = choose_backend(None, env={}, importer=pyslurm("25.11.2"), slurm_version=lambda: SlurmVersion(22, 5, 8))
    assert sel.backend.name == "cli" and "25.11" in sel.reason and "22.05" in sel.reason


def test_auto_with_matching_pyslurm() -> None:
    sel = choose_backend(None, env={}, importer=pyslurm("25.11.2"), slurm_version=lambda: SlurmVersion(25, 11, 4))
    assert sel.backend.name == "pyslurm" and "matches" in sel.reason
    assert isinstance(sel.backend, Backend)


def test_auto_refuses_the_broken_24_11_even_when_it_matches() -> None:
    # The issue: "pyslurm 24.11.0 matches Slurm 24.11.5" was taken, and every resize then failed.
    sel = choose_backend(None, env={}, importer=pyslurm("24.11.0"), slurm_version=lambda: SlurmVersion(24, 11, 5))
    assert sel.backend.name == "cli"
    assert sel.reason.startswith("auto: pyslurm 24.11.0 is known broken") and "NameError" in sel.reason


def test_auto_refuses_a_pyslurm_whose_self_check_fails() -> None:
    importer = pyslurm("25.11.3")
    importer().JobSubmitDescription.broken_memory_per_gpu = True
    sel = choose_backend(None, env={}, importer=importer, slurm_version=lambda: SlurmVersion(25, 11, 4))
    assert sel.backend.name == "cli" and "self-check failed" in sel.reason and "'val'" in sel.reason


def test_auto_when_the_probe_says_pyslurm_kills_its_process() -> None:
    def probed():
        raise PyslurmUnusable("`import pyslurm` ended its process (exit code 1; ...): fatal: Unable to process "
                              "configuration file")
    sel = choose_backend(None, env={}, importer=probed)
    assert sel.backend.name == "cli" and sel.reason.startswith("auto: `import pyslurm` ended its process")


def test_requested_pyslurm_that_cannot_import_is_an_error() -> None:
    with pytest.raises(SlurmUnavailable, match="import pyslurm|No module named 'pyslurm'"):
        choose_backend("pyslurm", env={}, importer=no_pyslurm)


def test_requested_broken_pyslurm_is_an_error_not_a_quiet_fallback() -> None:
    with pytest.raises(SlurmUnavailable, match="requested by --backend but unusable: pyslurm 24.11.0 is known broken"):
        choose_backend("pyslurm", env={}, importer=pyslurm("24.11.0"))


def test_one_log_line(caplog, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_ELASTIC_BACKEND", "cli")
    with caplog.at_level(logging.INFO, logger="slurm_elastic.cluster.select"):
        backend = select_backend()
    assert backend.name == "cli"
    lines = [r.getMessage() for r in caplog.records if r.name == "slurm_elastic.cluster.select"]
    assert lines == ["Slurm backend: cli (requested by SLURM_ELASTIC_BACKEND)"]
