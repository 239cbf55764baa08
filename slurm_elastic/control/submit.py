"""Elastic submission: splitting a `slurm-elastic sbatch` command line, checking the script, the initial size."""

from __future__ import annotations

import logging
import os
import re
import shlex
from dataclasses import dataclass, field

from slurm_elastic.allocate.problem import AllocationProblem, JobRequest, NodeCapacity, Policy
from slurm_elastic.cluster.backend import Backend, SubmitDescription
from slurm_elastic.cluster.model import ClusterState
from slurm_elastic.errors import ElasticError, SpecError
from slurm_elastic.spec import ElasticSpec, parse_directives, spec_from_options
from slurm_elastic.train import protocol as shim

log = logging.getLogger(__name__)

# Elastic options (they replace sbatch's own --gpus/--cpus-per-gpu/--mem-per-gpu meaning).
ELASTIC_OPTIONS = {"--gpus": "gpus", "--gpu-step": "gpu_step", "--cpus-per-gpu": "cpus_per_gpu",
                   "--mem-per-gpu": "mem_per_gpu", "--weight": "weight", "--ckpt-dir": "ckpt_dir"}
OWN_FLAGS = ("--watch", "--dry-run", "--parsable")

# sbatch 22.05 options (sbatch --help), by how they take a value.
_LONG_WITH_VALUE = frozenset("""
account acctg-freq batch bb bbf begin chdir cluster-constraint clusters constraint container core-spec
cores-per-socket cpu-freq deadline delay-boot dependency distribution error export-file extra-node-info
gid gpu-bind gpu-freq gres-flags input job-name licenses mail-type mail-user mcs-label mem-bind mincpus
network nodefile nodelist ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket output
partition power prefer priority profile qos reservation signal sockets-per-node switches thread-spec
threads-per-core time time-min tmp uid wckey exclude cpus-per-task
""".split())
_LONG_OPTIONAL_VALUE = frozenset("export exclusive nice propagate kill-on-invalid-dep open-mode".split())
_LONG_FLAGS = frozenset("""
contiguous get-user-env hold ignore-pbs no-kill overcommit oversubscribe quiet reboot requeue spread-job
test-only use-min-nodes verbose wait help usage version
""".split())
_SHORT_WITH_VALUE = frozenset("AbBcdDeFiJLMmnopqStwx")
_SHORT_FLAGS = frozenset("HkOQsvWV")

# Options the controller sets itself, or that Slurm forbids next to them: refused with the reason.
_REFUSED = {
    "--array": "elastic job arrays are not supported: submit each job on its own",
    "-a": "elastic job arrays are not supported: submit each job on its own",
    "--nodes": "the node count is chosen by slurm-elastic from --gpus; drop --nodes",
    "-N": "the node count is chosen by slurm-elastic from --gpus; drop -N",
    "--gres": "GPUs are given as --gpus MIN-MAX; drop --gres",
    "-G": "GPUs are given as --gpus MIN-MAX (sbatch's -G is not elastic)",
    "--gpus-per-node": "GPUs are given as --gpus MIN-MAX; drop --gpus-per-node",
    "--gpus-per-task": "GPUs are given as --gpus MIN-MAX; drop --gpus-per-task",
    "--gpus-per-socket": "GPUs are given as --gpus MIN-MAX; drop --gpus-per-socket",
    "--no-requeue": "elastic jobs must be requeueable; drop --no-requeue",
    "--comment": "the job comment carries the elastic spec; drop --comment",
    "--wrap": "elastic jobs need a batch script (the template waits for its requeue); --wrap is not supported",
    "--mem": "memory is given per GPU (--mem-per-gpu), which Slurm does not allow next to --mem",
    "--mem-per-cpu": "memory is given per GPU (--mem-per-gpu), which Slurm does not allow next to --mem-per-cpu",
    "--cpus-per-task": "CPUs are given per GPU (--cpus-per-gpu), which Slurm does not allow next to "
                       "--cpus-per-task",
    "-c": "CPUs are given per GPU (--cpus-per-gpu), which Slurm does not allow next to -c",
}


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """A parsed `slurm-elastic sbatch` command line, the script's #ELASTIC lines merged in."""

    spec: ElasticSpec
    script: str
    script_args: tuple[str, ...] = ()
    sbatch_args: tuple[str, ...] = ()      # passed through to sbatch unchanged
    parsable: bool = False
    watch: bool = False
    dry_run: bool = False
    job_name: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def parse_command_line(args: list[str] | tuple[str, ...]) -> SubmitRequest:
    """Split elastic options, our own flags and sbatch's; read the script. Any problem is a SpecError."""
    elastic: dict[str, str] = {}
    passthrough: list[str] = []
    own = {flag: False for flag in OWN_FLAGS}
    i = 0
    args = list(args)
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        name, eq, inline = arg.partition("=") if arg.startswith("--") else (arg[:2], "", arg[2:])
        if name in OWN_FLAGS:
            if eq:
                raise SpecError(f"{name} takes no value")
            own[name] = True
            i += 1
            continue
        if name in _REFUSED:
            raise SpecError(f"{name}: {_REFUSED[name]}")
        if name in ELASTIC_OPTIONS:
            value, i = _value(args, i, name, inline if eq else None)
            elastic[ELASTIC_OPTIONS[name]] = value
            continue
        if arg.startswith("--"):
            opt = name[2:]
            if opt in _LONG_WITH_VALUE:
                value, i = _value(args, i, name, inline if eq else None)
                passthrough.append(f"{name}={value}")
            elif opt in _LONG_OPTIONAL_VALUE or (opt in _LONG_FLAGS and not eq):
                passthrough.append(arg)
                i += 1
            elif opt in _LONG_FLAGS:
                raise SpecError(f"{name} takes no value")
            else:
                raise SpecError(f"unknown option {name} (not an elastic option and not an sbatch option)")
            continue
        letter = name[1]
        if letter in _SHORT_WITH_VALUE:
            value, i = _value(args, i, name, inline or None)
            passthrough += [name, value]
        elif letter in _SHORT_FLAGS and not inline:
            passthrough.append(name)
            i += 1
        else:
            raise SpecError(f"unknown option {arg} (not an elastic option and not an sbatch option)")
    if i >= len(args):
        raise SpecError("missing the batch script (usage: slurm-elastic sbatch [OPTIONS] SCRIPT [ARGS...])")
    script, script_args = args[i], tuple(args[i + 1:])
    text = read_script(script)
    options = parse_directives(text)
    _check_sbatch_directives(text)
    options.update(elastic)  # the command line wins over #ELASTIC lines
    spec = spec_from_options(options)
    job_name = None
    env = {shim.CKPT_DIR_ENV: spec.ckpt_dir} if spec.ckpt_dir else {}
    return SubmitRequest(spec=spec, script=os.path.abspath(script), script_args=script_args,
                         sbatch_args=tuple(passthrough), parsable=own["--parsable"], watch=own["--watch"],
                         dry_run=own["--dry-run"], job_name=job_name, env=env)


def _value(args: list[str], i: int, name: str, inline: str | None) -> tuple[str, int]:
    if inline is not None:
        if inline == "":
            raise SpecError(f"{name} needs a value")
        return inline, i + 1
    if i + 1 >= len(args) or (args[i + 1].startswith("-") and not re.fullmatch(r"-[0-9.]+", args[i + 1])):
        raise SpecError(f"{name} needs a value")
    return args[i + 1], i + 2


def read_script(path: str) -> str:
    """The batch script's text; it must exist and start with a shebang, as sbatch requires."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(1_000_000)
    except FileNotFoundError:
        raise SpecError(f"batch script {path!r} does not exist") from None
    except IsADirectoryError:
        raise SpecError(f"batch script {path!r} is a directory") from None
    except OSError as exc:
        raise SpecError(f"cannot read batch script {path!r}: {exc.strerror}") from None
    if not text.startswith("#!"):
        raise SpecError(f"batch script {path!r} does not start with a shebang line such as #!/bin/bash")
    return text


def _check_sbatch_directives(text: str) -> None:
    """#SBATCH lines that would fight the elastic request are refused like their command-line form."""
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if lineno == 1 or not line or (line.startswith("#") and not line.startswith("#SBATCH")):
            continue
        if not line.startswith("#"):
            break
        try:
            tokens = shlex.split(line[len("#SBATCH"):], comments=True)
        except ValueError:
            continue  # sbatch itself will say what is wrong with the line
        for tok in tokens:
            if not tok.startswith("-"):
                continue
            name = tok.split("=", 1)[0] if tok.startswith("--") else tok[:2]
            if name in _REFUSED:
                raise SpecError(f"line {lineno}: #SBATCH {name}: {_REFUSED[name]}")


# -- the initial size -------------------------------------------------------------------------------
def initial_gpus(spec: ElasticSpec, state: ClusterState, policy: Policy = Policy()) -> int:
    """The GPUs the allocator gives a new job on the capacity free now, else the minimum."""
    from slurm_elastic.control.reconcile import solve

    nodes = tuple(NodeCapacity(n.name, n.free.gpus, n.free.cpus, n.free.mem_mb) for n in state.nodes)
    req = JobRequest(key="new", min_gpus=spec.min_gpus, max_gpus=spec.max_gpus, gpu_step=spec.gpu_step,
                     cpus_per_gpu=spec.cpus_per_gpu, mem_per_gpu_mb=spec.mem_per_gpu_mb, weight=spec.weight)
    try:
        allocation = solve(AllocationProblem((req,), nodes, policy))
    except ElasticError as exc:
        log.warning("no initial size from the allocator (%s); submitting at the minimum", exc)
        return spec.min_gpus
    return int(allocation.gpus.get("new", 0)) or spec.min_gpus


def describe_submission(request: SubmitRequest, nodes: int, gpus_per_node: int) -> SubmitDescription:
    spec = request.spec
    return SubmitDescription(script=request.script, nodes=nodes, gpus_per_node=gpus_per_node,
                             cpus_per_gpu=spec.cpus_per_gpu, mem_per_gpu_mb=spec.mem_per_gpu_mb,
                             comment=spec.to_comment(), job_name=request.job_name, requeue=True,
                             extra_args=request.sbatch_args, script_args=request.script_args,
                             env=dict(request.env))


def submit(backend: Backend, request: SubmitRequest) -> tuple[SubmitDescription, int | None]:
    """Choose the initial shape and submit (or only describe it, with `dry_run`)."""
    from slurm_elastic.control.reconcile import request_shape
    from slurm_elastic.cluster.model import Job, JobState

    state = backend.snapshot()
    gpus = initial_gpus(request.spec, state)
    probe = Job(job_id=0, user="", name="", state=JobState.PENDING, spec=request.spec)
    nodes, per_node = request_shape(probe, gpus, {}, {n.gpus for n in state.nodes if n.available})
    description = describe_submission(request, nodes, per_node)
    if request.dry_run:
        return description, None
    job_id = backend.submit(description)
    log.info("job %d: submitted elastic %s at %dx%d GPUs", job_id, request.spec.to_comment(), nodes, per_node)
    return description, job_id
