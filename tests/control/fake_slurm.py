"""FakeSlurm: the tests' old name for the package's in-memory Slurm (slurm_elastic/cluster/memory.py).

No test-only copy: the controller tests and the simulator drive the same model.
The live tests in tests/control/test_live*.py prove the same paths on a real Slurm.
"""

from __future__ import annotations

from slurm_elastic.cluster.memory import REQUEUE_BEGIN_DELAY_S, InMemorySlurm

FakeSlurm = InMemorySlurm

__all__ = ["FakeSlurm", "InMemorySlurm", "REQUEUE_BEGIN_DELAY_S"]
