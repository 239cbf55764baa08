"""The digits example, with a SIGTERM that reaches each rank while it leaves after its commit: Slurm's stop
to another node's tasks, a moment late (tests/train/test_late_signal.py)."""

import os
import signal
import sys

import torch.distributed as dist

from slurm_elastic.train.examples import digits

_destroy = dist.destroy_process_group


def _late_term(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return _destroy(*args, **kwargs)


dist.destroy_process_group = _late_term

if __name__ == "__main__":
    sys.exit(digits.main())
