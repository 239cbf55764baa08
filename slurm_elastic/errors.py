"""The one exception family of slurm-elastic; messages are written for the user."""

from __future__ import annotations


class ElasticError(Exception):
    """Base of every error slurm-elastic raises on purpose."""


class SpecError(ElasticError):
    """An elastic spec (CLI flags, #ELASTIC lines or a job comment) is invalid."""


class SlurmError(ElasticError):
    """A Slurm command or API call failed; carries Slurm's own message."""

    def __init__(self, message: str, *, command: tuple[str, ...] = (), returncode: int | None = None) -> None:
        super().__init__(message)
        self.command = command
        self.returncode = returncode


class SlurmUnavailable(SlurmError):
    """slurmctld cannot be reached (down, restarting, or no Slurm here)."""


class UnknownJob(SlurmError):
    """Slurm does not know the job id."""


class AllocationError(ElasticError):
    """The allocation problem is malformed (bad weights, empty cluster, ...)."""


class CheckpointError(ElasticError):
    """A checkpoint is damaged, foreign, or cannot be written."""


class ClusterSetupError(ElasticError):
    """The local development cluster cannot be started, stopped or changed."""


class PermissionRefused(ElasticError):
    """The caller may not perform this action (e.g. a non-operator acting cluster-wide)."""


class TraceError(ElasticError):
    """A simulator input (workload trace, application profile, sacct export, failure file) is malformed."""


class SettingError(ElasticError):
    """A setting's environment variable holds a value the setting cannot take (slurm_elastic/settings.py)."""


class JobFileRefused(ElasticError, ValueError):
    """A file in a job's directory is not used as it is (a link, another owner's, too big, malformed)."""
