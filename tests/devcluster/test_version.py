"""SlurmVersion parsing and the missing-Slurm error."""

from __future__ import annotations

import pytest

from slurm_elastic.devcluster import version as version_module
from slurm_elastic.devcluster.version import SlurmVersion, detect_version
from slurm_elastic.errors import ClusterSetupError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("slurm-wlm 22.05.8\n", SlurmVersion(22, 5, 8)),
        ("slurm 24.11.5", SlurmVersion(24, 11, 5)),
        ("slurm-wlm 26.05.5-1", SlurmVersion(26, 5, 5)),
    ],
)
def test_parse(text: str, expected: SlurmVersion) -> None:
    assert SlurmVersion.parse(text) == expected


def test_order_and_cgroup_branch() -> None:
    assert SlurmVersion(22, 5, 8) < SlurmVersion(23, 11, 0) < SlurmVersion(24, 11, 5)
    assert not SlurmVersion(23, 2, 7).needs_cgroup_conf
    assert SlurmVersion(23, 11, 0).needs_cgroup_conf
    assert str(SlurmVersion(22, 5, 8)) == "22.05.8"


def test_garbage_is_refused() -> None:
    with pytest.raises(ClusterSetupError, match="cannot read a Slurm version"):
        SlurmVersion.parse("command not found")


def test_no_slurm_installed_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(version_module, "find_program", lambda name: None)
    with pytest.raises(ClusterSetupError, match="Slurm is not installed.*slurmctld.*--with-slurm"):
        detect_version()
