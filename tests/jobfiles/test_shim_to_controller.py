"""What a real one-process session writes is read back by the controller's readers, field for field."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from slurm_elastic import jobfiles
from slurm_elastic.control.requests import read_batch_range, read_job_geometry, read_job_metrics
from slurm_elastic.train.environment import JobEnvironment
from slurm_elastic.train.session import ElasticSession

ENV = JobEnvironment(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1,
                     master_addr="127.0.0.1", master_port=1, job_id="57", job_name="t", restart_count=0,
                     launcher="single")


def test_a_sessions_files_round_trip_to_the_controllers_readers(tmp_path: Path) -> None:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(SystemExit) as info:
        with ElasticSession(ckpt_dir=str(tmp_path), env=ENV, metrics_every_s=0.0, fast_exit=False,
                            batch="adaptive:4-16") as s:
            s.attach(model, opt, global_batch=8, micro_batch=4, dataset_size=len(x), group_bytes=1)
            while not s.done(6):
                for idx in s.micro_batches():
                    model(x[idx]).pow(2).mean().backward()
                s.optimizer_step()
                if s.step == 3:
                    os.kill(os.getpid(), signal.SIGUSR2)
    assert info.value.code == jobfiles.REQUEUE_EXIT_CODE
    me = os.geteuid()
    job = tmp_path / "57"

    geometry, problem = read_job_geometry(str(job / jobfiles.GEOMETRY_FILE), owner_uid=me, max_bytes=1 << 14)
    assert problem == "" and geometry is not None
    assert geometry.world_size == 1 and 1 in geometry.valid_world_sizes and not geometry.stuck

    batch, problem = read_batch_range(str(job / jobfiles.BATCH_FILE), owner_uid=me, max_bytes=1 << 12)
    assert problem == "" and batch == jobfiles.BatchRange(4, 16, 8)

    tail, problem = read_job_metrics(str(job / jobfiles.METRICS_FILE), owner_uid=me, max_bytes=1 << 20)
    assert problem == "" and tail.bad == 0 and tail.count >= 2
    assert tail.last is not None and tail.last["gpus"] == 1 and tail.last["batch"] == 8

    ack, problem = jobfiles.read_record(str(job / jobfiles.ack_file_name("57", 0)), jobfiles.Ack.parse, owner_uid=me,
                                        max_bytes=jobfiles.ACK_MAX_BYTES, what="an ACK")
    assert problem == "" and ack is not None and ack.committed and ack.world_size == 1 and ack.step is not None
