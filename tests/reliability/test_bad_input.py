"""Bad input, table-driven: each case is refused with exit 2 (or a typed error), one clear line, nothing done.

"Nothing submitted or changed" is checked with a tripwire, not a stand-in:
every Slurm command (sbatch, scontrol, scancel, squeue, sinfo, strigger,
sacctmgr) is shadowed on PATH by a script that records its argv and fails,
so any Slurm call made for a refused input shows up; and the files under the
case's working, state and daemon directories are compared before and after.
Job comments and checkpoint manifests come from Slurm and from disk, not from
a command line: those cases must raise the typed error (SpecError,
CheckpointError) and leave the job or the checkpoint directory untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.cluster.slurm_values import spec_from_comment
from slurm_elastic.errors import CheckpointError, SpecError
from slurm_elastic.spec import ElasticSpec
from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.store import CHECKSUMS, CheckpointStore

SLURM_COMMANDS = ("sbatch", "scontrol", "scancel", "squeue", "sinfo", "strigger", "sacctmgr", "srun", "salloc")
SCRIPT = "#!/bin/bash\n#SBATCH --time=5\nsrun python train.py\n"


@dataclass(frozen=True)
class CliCase:
    name: str
    argv: tuple[str, ...]
    expect: str                        # a fragment of the one error line
    script: str | None = SCRIPT        # written to ./train.sbatch in the case's directory
    env: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, bytes], ...] = ()


def _s(*lines: str) -> str:
    return "#!/bin/bash\n" + "\n".join(lines) + "\nsrun python train.py\n"


CLI_CASES = [
    # -- the sbatch wrapper's command line
    CliCase("no-gpus", ("sbatch", "train.sbatch"), "needs --gpus"),
    CliCase("gpus-reversed", ("sbatch", "--gpus", "8-4", "train.sbatch"), "min GPUs 8 exceeds max GPUs 4"),
    CliCase("gpus-zero", ("sbatch", "--gpus", "0-4", "train.sbatch"), "at least 1"),
    CliCase("gpus-negative", ("sbatch", "--gpus=-4-8", "train.sbatch"), "--gpus"),
    CliCase("gpus-words", ("sbatch", "--gpus", "four", "train.sbatch"), "--gpus must be MIN-MAX"),
    CliCase("gpus-huge", ("sbatch", "--gpus", "1-99999999999999999999", "train.sbatch"), "larger than"),
    CliCase("gpus-shell", ("sbatch", "--gpus", "1-4;touch pwned", "train.sbatch"), "--gpus"),
    CliCase("gpus-subst", ("sbatch", "--gpus", "$(touch pwned)", "train.sbatch"), "--gpus"),
    CliCase("step-not-dividing", ("sbatch", "--gpus", "3-8", "--gpu-step", "4", "train.sbatch"), "multiples"),
    CliCase("step-zero", ("sbatch", "--gpus", "4-8", "--gpu-step", "0", "train.sbatch"), "gpu"),
    CliCase("mem-garbage", ("sbatch", "--gpus", "1-4", "--mem-per-gpu", "lots", "train.sbatch"), "memory"),
    CliCase("mem-huge", ("sbatch", "--gpus", "1-4", "--mem-per-gpu", "999999T", "train.sbatch"), "memory per GPU"),
    CliCase("weight-nan", ("sbatch", "--gpus", "1-4", "--weight", "nan", "train.sbatch"), "weight"),
    CliCase("weight-inf", ("sbatch", "--gpus", "1-4", "--weight", "inf", "train.sbatch"), "weight"),
    CliCase("weight-negative", ("sbatch", "--gpus", "1-4", "--weight=-1", "train.sbatch"), "weight"),
    CliCase("ckpt-relative", ("sbatch", "--gpus", "1-4", "--ckpt-dir", "ckpt", "train.sbatch"), "absolute"),
    CliCase("ckpt-traversal", ("sbatch", "--gpus", "1-4", "--ckpt-dir", "/scratch/../etc", "train.sbatch"), ".."),
    CliCase("ckpt-shell", ("sbatch", "--gpus", "1-4", "--ckpt-dir", "/tmp/x;rm -rf ~", "train.sbatch"),
            "may contain only"),
    CliCase("ckpt-newline", ("sbatch", "--gpus", "1-4", "--ckpt-dir", "/tmp/x\nelastic:v1", "train.sbatch"),
            "may contain only"),
    CliCase("ckpt-missing", ("sbatch", "--gpus", "1-4", "train.sbatch"), "needs --ckpt-dir PATH",
            env=(("SLURM_ELASTIC_CKPT_DIR", ""),)),
    CliCase("ckpt-site-relative", ("sbatch", "--gpus", "1-4", "train.sbatch"), "absolute",
            env=(("SLURM_ELASTIC_CKPT_DIR", "ckpt"),)),
    CliCase("comment-smuggled", ("sbatch", "--gpus", "1-4", "--comment=elastic:v1 gpus=1-64", "train.sbatch"),
            "drop --comment"),
    CliCase("nodes", ("sbatch", "--gpus", "1-4", "-N", "2", "train.sbatch"), "drop -N"),
    CliCase("gres", ("sbatch", "--gpus", "1-4", "--gres=gpu:8", "train.sbatch"), "drop --gres"),
    CliCase("array", ("sbatch", "--gpus", "1-4", "--array=1-10", "train.sbatch"), "arrays"),
    CliCase("no-requeue", ("sbatch", "--gpus", "1-4", "--no-requeue", "train.sbatch"), "requeueable"),
    CliCase("wrap", ("sbatch", "--gpus", "1-4", "--wrap=sleep 1"), "--wrap"),
    CliCase("external", ("sbatch", "--gpus", "1-4", "--exter", "train.sbatch"), "--exter is not supported"),
    CliCase("ambiguous-prefix", ("sbatch", "--gpus", "1-4", "--spread", "train.sbatch"), "ambiguous"),
    CliCase("unknown-option", ("sbatch", "--gpus", "1-4", "--frobnicate", "train.sbatch"), "unknown option"),
    CliCase("flag-with-value", ("sbatch", "--gpus", "1-4", "--watch=yes", "train.sbatch"), "takes no value"),
    CliCase("missing-value", ("sbatch", "train.sbatch", "--gpus"), "needs --gpus"),
    CliCase("no-script", ("sbatch", "--gpus", "1-4"), "missing the batch script"),
    CliCase("script-missing", ("sbatch", "--gpus", "1-4", "nope.sbatch"), "does not exist"),
    CliCase("script-directory", ("sbatch", "--gpus", "1-4", "."), "is a directory"),
    CliCase("script-no-shebang", ("sbatch", "--gpus", "1-4", "train.sbatch"), "shebang", script="srun hostname\n"),
    CliCase("script-binary", ("sbatch", "--gpus", "1-4", "train.sbatch"), "shebang", script="\x7fELF\x00\x01"),
    # -- #ELASTIC lines
    CliCase("directive-unknown", ("sbatch", "train.sbatch"), "unknown #ELASTIC option",
            script=_s("#ELASTIC --gpus 1-4 --nodes 2")),
    CliCase("directive-no-value", ("sbatch", "train.sbatch"), "needs a value", script=_s("#ELASTIC --gpus")),
    CliCase("directive-glued", ("sbatch", "train.sbatch"), "expected '#ELASTIC --option value'",
            script=_s("#ELASTIC--gpus 1-4")),
    CliCase("directive-reversed", ("sbatch", "train.sbatch"), "exceeds", script=_s("#ELASTIC --gpus 9-3")),
    CliCase("directive-shell", ("sbatch", "train.sbatch"), "--gpus",
            script=_s("#ELASTIC --gpus `id`")),
    CliCase("directive-ckpt-traversal", ("sbatch", "train.sbatch"), "..",
            script=_s("#ELASTIC --gpus 1-4 --ckpt-dir /scratch/../../root")),
    CliCase("sbatch-directive-nodes", ("sbatch", "train.sbatch"), "#SBATCH -N",
            script=_s("#ELASTIC --gpus 1-4", "#SBATCH -N 4")),
    CliCase("sbatch-directive-comment", ("sbatch", "train.sbatch"), "#SBATCH --comment",
            script=_s("#ELASTIC --gpus 1-4", "#SBATCH --comment=elastic:v1")),
    # -- configuration (the controller settings come from SLURM_ELASTIC_* variables and flags)
    CliCase("env-interval", ("watch",), "SLURM_ELASTIC_INTERVAL", env=(("SLURM_ELASTIC_INTERVAL", "soon"),)),
    CliCase("env-interval-tiny", ("watch",), "interval", env=(("SLURM_ELASTIC_INTERVAL", "0"),)),
    CliCase("env-budget-negative", ("admin", "daemon"), "restart-budget",
            env=(("SLURM_ELASTIC_RESTART_BUDGET", "-3"),)),
    CliCase("env-signal", ("watch",), "signal", env=(("SLURM_ELASTIC_SIGNAL", "KILLME"),)),
    CliCase("flag-signal-number", ("admin", "rebalance", "--signal", "999"), "must name a signal"),
    CliCase("flag-metrics-port", ("admin", "daemon", "--metrics-port", "70000"), "metrics-port"),
    CliCase("slurm-conf-missing", ("admin", "install-plugin", "--slurm-conf", "nope.conf"), "no such file"),
    CliCase("slurm-conf-dir", ("admin", "install-plugin", "--slurm-conf", "."), "slurm-conf"),
    CliCase("slurm-conf-binary", ("admin", "install-plugin", "--slurm-conf", "slurm.conf", "--dry-run"),
            "slurm.conf", files=(("slurm.conf", b"\xff\xfe\x00JobSubmitPlugins=\x80\x81"),)),
    CliCase("job-id-text", ("admin", "rebalance", "--job", "12;scancel -u root"), "--job"),
    CliCase("watch-job-id-text", ("watch", "--job", "$(id)"), "--job"),
]


def _tree(*dirs: Path) -> dict[str, tuple[int, str]]:
    out = {}
    for d in dirs:
        for p in sorted(d.rglob("*")) if d.exists() else []:
            if p.is_file():
                out[str(p)] = (p.stat().st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                out[str(p)] = (p.stat().st_mode, "")
    return out


@pytest.fixture
def tripwire(tmp_path: Path) -> Callable[[], list[str]]:
    """Shadow every Slurm command; returns a function that lists the calls made."""
    bindir = tmp_path / "slurm-tripwire"
    bindir.mkdir()
    log = tmp_path / "slurm-calls.log"
    for cmd in SLURM_COMMANDS:
        path = bindir / cmd
        path.write_text(f"#!/bin/sh\necho \"{cmd} $*\" >> {log}\necho 'tripwire: {cmd} must not run' >&2\nexit 1\n")
        path.chmod(0o755)
    return lambda: log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("case", CLI_CASES, ids=[c.name for c in CLI_CASES])
def test_cli_bad_input_exits_2_with_one_line_and_does_nothing(case: CliCase, tmp_path: Path, tripwire: Any,
                                                             monkeypatch: pytest.MonkeyPatch, figures: Any) -> None:
    work = tmp_path / "work"
    state = tmp_path / "state"
    daemon = tmp_path / "daemon"
    for d in (work, state, daemon):
        d.mkdir()
    if case.script is not None:
        (work / "train.sbatch").write_text(case.script)
    for name, data in case.files:
        (work / name).write_bytes(data)
    monkeypatch.chdir(work)
    env = {"PATH": f"{tmp_path / 'slurm-tripwire'}:{os.environ['PATH']}", "SLURM_ELASTIC_STATE_DIR": str(state),
           "SLURM_ELASTIC_DAEMON_DIR": str(daemon), "SLURM_ELASTIC_BACKEND": "cli", **dict(case.env)}
    before = _tree(work, state, daemon)
    result = CliRunner().invoke(main, list(case.argv), env=env)
    after = _tree(work, state, daemon)
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    figures.put(exit_code=result.exit_code, message=errors[0] if errors else result.stderr.strip()[-200:],
                slurm_calls=len(tripwire()))
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"traceback instead of a message: {result.exception!r}"
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert len(errors) == 1, result.stderr
    assert case.expect in errors[0], errors[0]
    assert "Traceback" not in result.stderr
    assert tripwire() == [], f"Slurm was called for refused input: {tripwire()}"
    assert before == after, "files were written or changed for refused input"
    assert result.stdout == "", f"printed output as if something happened: {result.stdout!r}"


def test_the_installed_entry_point_refuses_like_the_library(tmp_path: Path, tripwire: Any) -> None:
    (tmp_path / "train.sbatch").write_text(SCRIPT)
    env = {**os.environ, "PATH": f"{tmp_path / 'slurm-tripwire'}:{os.environ['PATH']}"}
    entry = Path(sys.executable).parent / "slurm-elastic"   # what install.sh put beside the interpreter
    assert entry.is_file(), f"no entry point {entry}: the package is not installed in this environment"
    proc = subprocess.run([str(entry), "sbatch", "--gpus", "1-4;id", "train.sbatch"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("Error:")] and tripwire() == []


# -- elastic specs in job comments (they come from Slurm: typed error, job never touched) ----------------------
GOOD = ElasticSpec(1, 4).to_comment()
COMMENT_CASES = {
    "shell-subst": GOOD + " ckpt=/tmp/$(id)",
    "shell-semicolon": GOOD + "; scancel -u root",
    "backticks": GOOD.replace("gpus=1-4", "gpus=`id`-4"),
    "other-job-id": GOOD + " job=4242",
    "other-user": GOOD + " user=root",
    "two-specs": GOOD + " " + GOOD,
    "newline": GOOD + "\nelastic:v1 gpus=1-64 step=1 cpus-per-gpu=1 mem-per-gpu=1024M weight=1",
    "huge-gpus": GOOD.replace("gpus=1-4", "gpus=1-99999999999"),
    "huge-weight": GOOD.replace("weight=1", "weight=9999999.5"),
    "zero-step": GOOD.replace("step=1", "step=0"),
    "leading-zero": GOOD.replace("gpus=1-4", "gpus=01-4"),
    "ckpt-traversal": GOOD + " ckpt=/scratch/../root",
    "ckpt-relative": GOOD + " ckpt=scratch",
    "prefix-only": "elastic:v1",
    "unicode-digits": GOOD.replace("gpus=1-4", "gpus=\u0661-4"),
}


@pytest.mark.parametrize("name", sorted(COMMENT_CASES))
def test_malformed_comment_is_a_typed_error_and_the_job_is_never_touched(name: str, figures: Any) -> None:
    from control.fake_slurm import FakeSlurm  # stands in for Slurm: no cluster needed for the refusal itself

    from slurm_elastic.control.journal import Journal
    from slurm_elastic.control.protocol import ProtocolSettings
    from slurm_elastic.control.reconcile import ControllerConfig, Reconciler

    comment = COMMENT_CASES[name]
    with pytest.raises(SpecError):
        ElasticSpec.from_comment(comment)
    spec, error = spec_from_comment(comment)
    assert spec is None and error
    slurm = FakeSlurm()
    bad = slurm.add_job(None, nodes=1, gpus_per_node=1, comment=comment, spec_error=error)
    good = slurm.add_job(ElasticSpec(1, 8), nodes=1, gpus_per_node=1)
    slurm.calls.clear()
    config = ControllerConfig(node_confirm_s=0, protocol=ProtocolSettings(ack_timeout_s=0))
    report = Reconciler(slurm, Journal(":memory:"), config, sleep=lambda s: None).cycle()
    touched = sorted({verb for verb, job in slurm.calls if job == bad})
    figures.put(error=error, calls_on_bad_job=len(touched), calls_on_good_job=sum(j == good for _, j in slurm.calls))
    assert touched == [], f"the malformed job was acted on: {touched}"
    assert report.malformed.get(bad) == error
    assert any(job == good for _, job in slurm.calls), "the well-formed job next to it was not resized"


# -- checkpoint manifests (they come from disk: typed error, nothing written, nothing loaded) ---------------------
def _mutations() -> dict[str, Callable[[dict[str, Any]], None]]:
    def files(f: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        return lambda m: f(m["files"][0])

    return {
        "step-string": lambda m: m.update(step="1"),
        "step-negative": lambda m: m.update(step=-1),
        "step-huge": lambda m: m.update(step=10**40),
        "step-float": lambda m: m.update(step=1.0),
        "step-bool": lambda m: m.update(world_size=True),
        "samples-null": lambda m: m.update(samples_consumed=None),
        "format-other": lambda m: m.update(format="torch-pickle/1"),
        "files-empty": lambda m: m.update(files=[]),
        "files-object": lambda m: m.update(files={"name": "x"}),
        "missing-key": lambda m: m.pop("global_batch"),
        "name-traversal": files(lambda r: r.update(name="../../../etc/shadow")),
        "name-absolute": files(lambda r: r.update(name="/etc/passwd")),
        "name-pickle": files(lambda r: r.update(name="model.pt")),
        "name-nul": files(lambda r: r.update(name="a\x00.safetensors")),
        "size-string": files(lambda r: r.update(size="123")),
        "size-huge": files(lambda r: r.update(size=10**30)),
        "checksum-number": files(lambda r: r.update({k: 0 for k in CHECKSUMS if k in r})),
        "checksum-missing": files(lambda r: [r.pop(k) for k in CHECKSUMS if k in r]),
        "duplicate-file": lambda m: m["files"].append(dict(m["files"][0])),
        "not-an-object": lambda m: (m.clear(), m.update({"__list__": True})),
    }


MANIFEST_CASES = sorted(_mutations())


@pytest.mark.parametrize("name", MANIFEST_CASES)
def test_malformed_manifest_is_refused_and_nothing_is_written(name: str, tmp_path: Path, figures: Any) -> None:
    store = CheckpointStore(str(tmp_path / "job"), keep=3)
    store.ensure_job_dir()
    for step in (1, 2):
        store.begin_step(step)
        rec = store.write_tensors(step, "group-00000.safetensors", {"w": torch.full((8,), float(step))}, rank=0)
        store.commit(step, {"samples_consumed": step, "world_size": 1, "global_batch": 8,
                            "model_fingerprint": "fp", "files": [rec.to_json()]})
    mpath = tmp_path / "job" / protocol.step_dir_name(2) / protocol.MANIFEST_FILE
    manifest = json.loads(mpath.read_text())
    _mutations()[name](manifest)
    body: Any = [1, 2] if "__list__" in manifest else manifest
    mpath.write_text(json.dumps(body))
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError) as info:
        store.verify(2)
    found = store.newest_complete(model_fingerprint="fp")
    after = _tree(tmp_path)
    figures.put(error=str(info.value).split(": ", 1)[-1][:160])
    assert found is not None and found.step == 1, "the malformed step was used, or the good one was not"
    assert before == after, "reading a malformed manifest changed the checkpoint directory"
    assert "\n" not in str(info.value)


def test_suite_size(figures: Any) -> None:
    total = len(CLI_CASES) + 1 + len(COMMENT_CASES) + len(MANIFEST_CASES)
    figures.put(cli_cases=len(CLI_CASES) + 1, comment_cases=len(COMMENT_CASES), manifest_cases=len(MANIFEST_CASES),
                bad_inputs_total=total)
    assert total >= 40
