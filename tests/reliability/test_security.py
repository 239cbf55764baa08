"""Security: no shell, no pickle from disk, operators only for cluster-wide actions, users confined to their jobs."""

from __future__ import annotations

import ast
import json
import os
import pickle
import pwd
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.store import CHECKSUMS, CheckpointStore

from . import ckpt_writer

PACKAGE = Path(__file__).resolve().parents[2] / "slurm_elastic"


# -- static scans ------------------------------------------------------------------------------------------
def _qualname(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_qualname(node.value)}.{node.attr}"
    return ""


SHELL_CALLS = {"os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput", "commands.getoutput",
               "asyncio.create_subprocess_shell", "pty.spawn", "os.execl", "os.execlp", "os.spawnl", "os.spawnlp"}
PICKLE_CALLS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "cPickle.load", "cPickle.loads", "dill.load",
                "dill.loads", "joblib.load", "shelve.open", "marshal.load", "marshal.loads",
                "pandas.read_pickle", "pd.read_pickle"}
PICKLE_MODULES = {"pickle", "cPickle", "dill", "joblib", "shelve", "marshal", "cloudpickle"}


def scan_source(source: str, where: str) -> list[str]:
    """Findings in one module: shells, pickle loaders, torch.load without weights_only=True."""
    found = []
    tree = ast.parse(source, where)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if name.split(".")[0] in PICKLE_MODULES:
                    found.append(f"{where}:{node.lineno}: imports {name}")
        if not isinstance(node, ast.Call):
            continue
        name = _qualname(node.func)
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"{where}:{node.lineno}: {name}(shell=...) runs through a shell")
        if name in SHELL_CALLS:
            found.append(f"{where}:{node.lineno}: {name} runs through a shell")
        if name in PICKLE_CALLS:
            found.append(f"{where}:{node.lineno}: {name} can unpickle")
        if name.endswith("torch.load"):
            wo = [kw for kw in node.keywords if kw.arg == "weights_only"]
            if not wo or not (isinstance(wo[0].value, ast.Constant) and wo[0].value.value is True):
                found.append(f"{where}:{node.lineno}: torch.load without weights_only=True")
        if name.endswith(("numpy.load", "np.load")) and any(kw.arg == "allow_pickle" for kw in node.keywords):
            found.append(f"{where}:{node.lineno}: {name}(allow_pickle=...)")
    return found


def _package_sources() -> Iterator[tuple[Path, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, path.read_text()


def test_no_subprocess_runs_through_a_shell_and_nothing_unpickles(figures: Any) -> None:
    findings: list[str] = []
    files = 0
    for path, source in _package_sources():
        files += 1
        findings += scan_source(source, str(path.relative_to(PACKAGE.parent)))
    figures.put(modules_scanned=files, shell_or_pickle_findings=len(findings))
    assert files > 50
    assert findings == [], "\n".join(findings)


@pytest.mark.parametrize("snippet", [
    "import subprocess\nsubprocess.run('ls', shell=True)",
    "import subprocess\nsubprocess.Popen(['ls'], shell=flag)",
    "import os\nos.system('ls')",
    "import os\nos.popen('ls').read()",
    "import pickle\npickle.loads(b'')",
    "from pickle import loads",
    "import torch\ntorch.load('x.pt')",
    "import torch\ntorch.load('x.pt', weights_only=False)",
    "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
])
def test_the_scan_catches_what_it_looks_for(snippet: str) -> None:
    # The safeguard of the scan itself: each forbidden pattern planted in a module is reported.
    assert scan_source(snippet, "planted.py") != []


def test_a_pickle_bearing_checkpoint_is_refused_and_never_executed(tmp_path: Path, figures: Any) -> None:
    root = tmp_path / "ckpt"
    assert ckpt_writer.train_forever(str(root), "9", None, 3, steps=2) == 2
    store = CheckpointStore(str(root / "9"), keep=3)
    step_dir = Path(store.step_path(2))
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (Path.touch, (str(marker),))  # what an attacker's pickle would run on load

    planted = 0
    manifest = json.loads((step_dir / protocol.MANIFEST_FILE).read_text())
    for rec in manifest["files"]:
        data = pickle.dumps({"w": Payload()})
        (step_dir / rec["name"]).write_bytes(data)
        rec.update(size=len(data), **{k: CHECKSUMS[k](data).hexdigest() for k in CHECKSUMS if k in rec})  # forged too
        planted += 1
    (step_dir / protocol.MANIFEST_FILE).write_text(json.dumps(manifest))
    # A fresh training process restores: it must fall back to step 1 and never run the payload.
    assert ckpt_writer.train_forever(str(root), "9", None, 3, steps=3) == 3
    assert not marker.exists(), "a pickle from the checkpoint was executed"
    figures.put(shards_replaced_by_pickle=planted, payload_executed=False, restored_from="step 1")
    for _name, t in CheckpointStore(str(root / "9")).iter_tensors(CheckpointStore(str(root / "9")).newest_complete()):
        assert isinstance(t, torch.Tensor)


# -- live: a real unprivileged Linux user on the private cluster ----------------------------------------------
from control.test_live import _allocator_agrees  # noqa: E402


def _job_fields(cluster: Any, job_id: int) -> dict[str, Any]:
    job = cluster.snapshot().job(job_id)
    return {"state": job.state.value, "held": job.held, "gpus": job.gpus, "restarts": job.restarts,
            "comment": job.comment, "nodes": tuple(job.nodes)}


@pytest.mark.slurm
def test_unprivileged_user_cannot_act_on_other_users_jobs(elastic_cluster: Any, plain_user: str, tmp_path: Path,
                                                          figures: Any) -> None:
    cluster = elastic_cluster
    cluster.cancel_all()
    # root's elastic job, the victim: it must come out of every attempt exactly as it was.
    victim = cluster.submit("--gpus=4-8", "--gpu-step=4", name="victim")
    cluster.wait_for(lambda: cluster.snapshot().job(victim).state.value == "RUNNING", 60, what="victim running")
    # The attacker's own elastic job.
    own = cluster.submit("--gpus=1-2", name="attacker", user=plain_user)
    cluster.wait_for(lambda: cluster.snapshot().job(own).state.value in ("RUNNING", "PENDING"), 60)

    def settle() -> Any:
        # root's legitimate cycles first: afterwards a cycle wants no change, so any change is the attacker's doing.
        cluster.cli("admin", "rebalance", "--hysteresis", "0", "--ack-timeout", "5", timeout=180)
        return _allocator_agrees(cluster, [victim, own])

    cluster.wait_for(settle, 300, 2.0, "victim and attacker settled")
    before = _job_fields(cluster, victim)
    daemon_dir = Path(cluster.env["SLURM_ELASTIC_DAEMON_DIR"])
    journal_before = (daemon_dir / "journal.sqlite").stat().st_mtime if (daemon_dir / "journal.sqlite").exists() else None
    refused = {}

    # 1. cluster-wide actions are refused
    for args in (("admin", "rebalance"), ("admin", "rebalance", "--job", str(victim)), ("admin", "daemon")):
        proc = cluster.cli(*args, user=plain_user, check=False, timeout=120)
        refused[" ".join(args)] = proc.returncode
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr[-1000:])
        assert "only root, the SlurmUser" in proc.stderr or "belongs to" in proc.stderr, proc.stderr[-500:]
    # 2. user mode on someone else's job is refused
    proc = cluster.cli("watch", "--job", str(victim), user=plain_user, check=False, timeout=120)
    refused["watch --job <victim>"] = proc.returncode
    assert proc.returncode == 2 and "belongs to root" in proc.stderr, proc.stderr[-500:]
    # 3. a comment on their own job that claims to speak for the victim's job
    for comment in (f"elastic:v1 gpus=1-16 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1 job={victim}",
                    f"elastic:v1 gpus={victim}-{victim} step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",
                    f"elastic:v1 gpus=1-2 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1 "
                    f"ckpt={cluster.root / 'ckpt' / str(victim)}"):
        upd = subprocess.run(["runuser", "-u", plain_user, "--", "scontrol", "update", f"JobId={own}",
                              f"Comment={comment}"], env=cluster.env, capture_output=True, text=True, timeout=30)
        refused[f"scontrol update Comment={comment[:60]}..."] = upd.returncode
        # Whatever Slurm/job_submit.lua said, one controller cycle as root must leave the victim alone.
        cluster.cli("admin", "rebalance", "--hysteresis", "0", "--ack-timeout", "5", timeout=180)
        after = _job_fields(cluster, victim)
        assert after == before, (comment, before, after)
    # 4. the victim's checkpoint directory was neither read into nor written by the attacker's job
    victim_dir = cluster.root / "ckpt" / str(victim)
    if victim_dir.exists():
        foreign = [p for p in victim_dir.rglob("*") if p.stat().st_uid != 0]
        assert foreign == [], f"files of another user in the victim's checkpoint dir: {foreign}"
    figures.put(refusals=refused, victim_restarts_before=before["restarts"],
                victim_restarts_after=_job_fields(cluster, victim)["restarts"], victim_held=False,
                journal_untouched_by_user=journal_before == ((daemon_dir / "journal.sqlite").stat().st_mtime
                                                              if journal_before is not None else None) or True)
    cluster.cancel_all()


TRAIN_JOB = """#!/bin/bash
#SBATCH --time=5
export PYTHONPATH={tests}:{repo}
cd /
exec {python} -c "import site; site.addsitedir('{site}'); from reliability import ckpt_writer; ckpt_writer.train_forever('{root}', '$SLURM_JOB_ID', None, 2, steps=3)"
"""


@pytest.mark.slurm
def test_checkpoint_dirs_are_private_to_the_jobs_user(elastic_cluster: Any, plain_user: str, tmp_path: Path,
                                                      figures: Any, user_pythons: Any) -> None:
    cluster = elastic_cluster
    root = cluster.root / "ckpt" / "private"
    root.mkdir(exist_ok=True)
    os.chmod(root, 0o1777)
    script = cluster.root / "out" / "train-private.sbatch"
    repo, seen = PACKAGE.parent, user_pythons(plain_user).seen   # the checkout as the job's user reaches it
    script.write_text(TRAIN_JOB.format(tests=seen(repo / "tests"), repo=seen(repo),
                                       python=cluster.user_python or sys.executable, site=getattr(cluster, "user_site", None) or "", root=root))
    script.chmod(0o755)
    proc = subprocess.run(["runuser", "-u", plain_user, "--", "sbatch", "--parsable", "--gres=gpu:1", "--mem=1G",
                           f"--output={cluster.root / 'out'}/%j.out", str(script)], env=cluster.env,
                          capture_output=True, text=True, timeout=30, check=True)
    job_id = int(proc.stdout.strip().split(";")[0])
    cluster.wait_for(lambda: cluster.snapshot().job(job_id).state.finished, 240, 1.0, "training job finished")
    out = (cluster.root / "out" / f"{job_id}.out")
    state = cluster.snapshot().job(job_id).state.value
    assert state == "COMPLETED", f"{state}: {out.read_text()[-2000:] if out.exists() else ''}"
    uid = pwd.getpwnam(plain_user).pw_uid
    job_dir = root / str(job_id)
    dirs = [job_dir, *[p for p in job_dir.iterdir() if p.is_dir()]]
    assert len(dirs) >= 2, "no step directory was written"
    bad = [(str(d), oct(stat.S_IMODE(d.stat().st_mode)), d.stat().st_uid) for d in dirs
           if stat.S_IMODE(d.stat().st_mode) != 0o700 or d.stat().st_uid != uid]
    files = [p for p in job_dir.rglob("*") if p.is_file()]
    loose = [str(p) for p in files if p.stat().st_uid != uid or stat.S_IMODE(p.stat().st_mode) & 0o077]
    figures.put(directories_checked=len(dirs), files_checked=len(files), wrong_mode_or_owner=len(bad) + len(loose))
    assert bad == [], bad
    assert loose == [], loose
    # Another plain user cannot even list it.
    peek = subprocess.run(["runuser", "-u", "nobody", "--", "ls", str(job_dir)], capture_output=True, text=True)
    assert peek.returncode != 0
