"""Backend selection: --backend / SLURM_ELASTIC_BACKEND / auto, with the reason it gives."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from slurm_elastic.cluster.backend import Backend
from slurm_elastic.cluster.select import BackendChoiceError, choose_backend, select_backend
from slurm_elastic.cluster.slurm_values import SlurmVersion
from slurm_elastic.errors import SlurmUnavailable


def no_pyslurm():
    raise ModuleNotFoundError("No module named 'pyslurm'")


def pyslurm_2511():
    # Stand-in for the pyslurm module: only its version matters to the choice.
    return SimpleNamespace(__version__="25.11.2")


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
    sel = choose_backend(None, env={}, importer=pyslurm_2511, slurm_version=lambda: SlurmVersion(22, 5, 8))
    assert sel.backend.name == "cli" and "25.11" in sel.reason and "22.05" in sel.reason


def test_auto_with_matching_pyslurm() -> None:
    sel = choose_backend(None, env={}, importer=pyslurm_2511, slurm_version=lambda: SlurmVersion(25, 11, 4))
    assert sel.backend.name == "pyslurm" and "matches" in sel.reason
    assert isinstance(sel.backend, Backend)


def test_requested_pyslurm_that_cannot_import_is_an_error() -> None:
    with pytest.raises(SlurmUnavailable, match="import pyslurm"):
        choose_backend("pyslurm", env={}, importer=no_pyslurm)


def test_one_log_line(caplog, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_ELASTIC_BACKEND", "cli")
    with caplog.at_level(logging.INFO, logger="slurm_elastic.cluster.select"):
        backend = select_backend()
    assert backend.name == "cli"
    lines = [r.getMessage() for r in caplog.records if r.name == "slurm_elastic.cluster.select"]
    assert lines == ["Slurm backend: cli (requested by SLURM_ELASTIC_BACKEND)"]
