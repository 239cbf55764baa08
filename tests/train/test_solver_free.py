"""A training process loads the shim without the solver: neither highspy nor scipy is imported (issue 24)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TRAIN_ONE_STEP = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    import slurm_elastic.train
    from slurm_elastic.train import ElasticSession, ElasticSampler
    from slurm_elastic.train.environment import JobEnvironment

    env = JobEnvironment(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1,
                         master_addr="127.0.0.1", master_port=1, job_id="31", job_name="t", restart_count=0,
                         launcher="single")
    x = torch.randn(16, 4)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ElasticSession(ckpt_dir=sys.argv[1], env=env, metrics_every_s=0.0, fast_exit=False) as s:
        s.attach(model, opt, global_batch=8, micro_batch=4, dataset_size=len(x), group_bytes=1)
        for idx in s.micro_batches():
            model(x[idx]).pow(2).mean().backward()
        s.optimizer_step()
        step = s.step
    print(json.dumps({"step": step, "loaded": sorted(m for m in sys.modules
                                                     if m.split(".")[0] in ("highspy", "scipy"))}))
""")


def test_a_training_step_imports_neither_highspy_nor_scipy(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", TRAIN_ONE_STEP, str(tmp_path / "ckpt")], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"step": 1, "loaded": []}
