"""pytorch/examples' minGPT-ddp (upstream's bytes plus the edits docs/researcher.md documents): a Trainer that
owns its loaders, its snapshot and a per-epoch evaluation, epochs counted from 1, gradient clipping, entered
through Hydra; resumed at another world size it ends with the weights of a run that never stopped.

The model is shrunk and dropout set to 0 through Hydra overrides (configuration, not edits) so that two
runs can be compared on this machine's CPUs; the text is a generated one (upstream's default is a URL), and
torch's seed is fixed before the script starts (a sitecustomize.py beside it), since upstream seeds nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from slurm_elastic import jobfiles as protocol

from .launch import rank_envs, wait_ranks
from .upstream_edits import MINGPT

DOCS = Path(__file__).resolve().parents[2] / "docs" / "researcher.md"
JOB = "616"
OVERRIDES = ["data_config.truncate=1.0", "data_config.block_size=16", "gpt_config.n_layer=1", "gpt_config.n_head=2",
             "gpt_config.n_embd=16", "+gpt_config.embd_pdrop=0.0", "+gpt_config.resid_pdrop=0.0",
             "+gpt_config.attn_pdrop=0.0", "trainer_config.max_epochs=3", "trainer_config.batch_size=8",
             "trainer_config.data_loader_workers=0", "trainer_config.use_amp=false", "trainer_config.save_every=1"]


def _folder(tmp: Path, **skip: str) -> Path:
    run = MINGPT.write_converted(tmp, **skip)
    # Upstream seeds nothing, and torch seeds each process at random: two runs would start from different
    # weights. Python imports sitecustomize at start-up, so the runs begin alike with upstream untouched.
    (run / "sitecustomize.py").write_text("import torch\ntorch.manual_seed(0)\n")
    (run / "input.txt").write_text("".join(f"{i} little pigs, let me come in. not by the hair of my chinny chin "
                                           f"chin.\n" for i in range(150)))
    return run


def _start(run: Path, world: int, restart: int, overrides: list[str] = OVERRIDES) -> list[subprocess.Popen]:
    path = os.pathsep.join(p for p in (str(run), os.environ.get("PYTHONPATH", "")) if p)
    procs = []
    for env in rank_envs(world_size=world, job_id=JOB, restart_count=restart,
                         extra_env={"SLURM_ELASTIC_CKPT_DIR": str(run / "ck"), "PYTHONPATH": path}):
        procs.append(subprocess.Popen([sys.executable, "main.py", f"data_config.path={run / 'input.txt'}",
                                       *overrides], cwd=run, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _run(procs: list[subprocess.Popen], stop_at: str | None = None) -> tuple[list[int], str]:
    head = []
    assert procs[0].stdout is not None
    if stop_at is not None:
        for text in procs[0].stdout:
            head.append(text)
            if stop_at in text:
                for p in procs:
                    p.send_signal(signal.SIGUSR2)
                break
    results = wait_ranks(procs, timeout=900)
    return [r.returncode for r in results], "".join(head) + results[0].stdout


def _weights(run: Path, epochs: int = 3) -> dict[str, torch.Tensor]:
    snapshot = torch.load(run / "gpt_snapshot.pt", weights_only=True)
    assert snapshot["finished_epoch"] == epochs
    return snapshot["model_state"]


def test_the_upstream_files_are_upstreams_bytes_and_the_docs_show_the_edits() -> None:
    for name, digest in MINGPT.sha256.items():
        assert hashlib.sha256((MINGPT.folder / name).read_bytes()).hexdigest() == digest, name
    assert MINGPT.lines_touched() <= 10
    assert f"```diff\n{MINGPT.diff()}\n```" in DOCS.read_text(), MINGPT.diff()


def _drift(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return float(torch.cat([(a[k] - b[k]).flatten() for k in a]).norm() / torch.cat([a[k].flatten() for k in a]).norm())


def test_mingpt_resumed_at_half_the_ranks_ends_within_float_noise_of_a_run_that_never_stopped(tmp_path: Path) -> None:
    straight = {}
    for world in (4, 2):
        run = _folder(tmp_path / f"straight-{world}")
        codes, out = _run(_start(run, world, 0))
        assert codes == [0] * world, out[-3000:]
        straight[world] = _weights(run)

    elastic = _folder(tmp_path / "elastic")
    codes, out = _run(_start(elastic, 4, 0), stop_at="[RANK0] Epoch 2 | Iter 100 |")
    assert codes == [protocol.REQUEUE_EXIT_CODE] * 4, out[-3000:]
    with open(protocol.ack_path(str(elastic / "ck"), JOB, JOB, 0)) as f:
        ack = json.load(f)
    assert ack["committed"] and ack["world_size"] == 4
    codes, out = _run(_start(elastic, 2, 1))
    assert codes == [0] * 2, out[-3000:]
    assert f"slurm-elastic: resumed at step {ack['step']} (epoch 2)" in out, out[-3000:]
    assert "Epoch 3 | Iter 0 | Train" in out, out[-3000:]
    assert "Epoch 1 |" not in out, out[-3000:]      # the finished epoch is neither trained nor evaluated again

    # float32 sums in another order (2 ranks x 2 micro-batches against 4 x 1), amplified by ~400 AdamW steps:
    # two runs that never stopped, at 4 and at 2 ranks, differ by that noise (0.15 % here); the resumed run,
    # which ran the same steps on the same data, stays within the same order of it.
    noise = _drift(straight[4], straight[2])
    assert 0 < noise < 0.05
    assert _drift(straight[4], _weights(elastic)) <= 2 * noise, (noise, _drift(straight[4], _weights(elastic)))
