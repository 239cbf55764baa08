"""Elastic submission: splitting a `slurm-elastic sbatch` command line, checking the script, the initial size."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import Mapping

from slurm_elastic import settings
from slurm_elastic.allocate.problem import AllocationProblem, JobRequest, NodeCapacity, Policy
from slurm_elastic.allocate.from_state import partition_nodes
from slurm_elastic.allocate.shapes import request_shape
from slurm_elastic.cluster.backend import Backend, SubmitDescription
from slurm_elastic.cluster.model import ClusterState
from slurm_elastic.cluster.partitions import PartitionReader, PartitionTimes
from slurm_elastic.cluster.reservations import AdvanceReservation, ReservationReader, blocking, open_nodes
from slurm_elastic.cluster.sbatch_options import (SBATCH, Arg, Grammar, Parsed, directive_words,
                                                  foreign_directive_lines, parse)
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.control import time_limit
from slurm_elastic.control.time_limit import TimeLimitPolicy
from slurm_elastic.errors import ElasticError, SpecError
from slurm_elastic.spec import ElasticSpec, parse_directives, spec_from_options
from slurm_elastic import jobfiles as shim

log = logging.getLogger(__name__)

# Elastic options (they replace sbatch's own --gpus/--cpus-per-gpu/--mem-per-gpu meaning) and our own flags.
# `batch` is the job's batch range (adaptive:MIN-MAX); it takes over sbatch's rarely used --batch
# (node features of the batch step), which an `#SBATCH --batch` line still gives.
ELASTIC_OPTIONS = {"gpus": "gpus", "gpu-step": "gpu_step", "cpus-per-gpu": "cpus_per_gpu",
                   "mem-per-gpu": "mem_per_gpu", "weight": "weight", "ckpt-dir": "ckpt_dir", "batch": "batch",
                   **time_limit.OPTIONS}
OWN_FLAGS = ("watch", "dry-run", "parsable")

# The wrapper's command line is sbatch's grammar plus ours: prefixes resolve over both, so
# `--we` is --weight and `--gpu` is ambiguous. sbatch's -G keeps its meaning (a job-wide GPU
# count), reachable only by its letter.
_SBATCH_GPUS = "gpus (sbatch -G)"
WRAPPER = Grammar(
    long={**SBATCH.long, **{name: Arg.REQUIRED for name in ELASTIC_OPTIONS}, **{f: Arg.NONE for f in OWN_FLAGS}},
    short={**SBATCH.short, "G": _SBATCH_GPUS},
    aliases=SBATCH.aliases,
    hidden=((_SBATCH_GPUS, Arg.REQUIRED),),
    strict_values=frozenset(ELASTIC_OPTIONS),
)

_ARRAYS = "elastic job arrays are not supported: submit each job on its own"
_GPUS = "GPUs are given as --gpus MIN-MAX"
_NEEDS_SCRIPT = "elastic jobs need a batch script (the template waits for its requeue)"
# Options the controller sets itself, or that Slurm forbids next to them, by canonical name:
# refused with the reason in whatever spelling they come (`{}` is the spelling).
REFUSED = {
    "array": _ARRAYS,
    "nodes": "the node count is chosen by slurm-elastic from --gpus; drop {}",
    "nodelist": "the nodes are chosen by slurm-elastic at every size (--exclude keeps it off nodes); drop {}",
    "nodefile": "the nodes are chosen by slurm-elastic at every size (--exclude keeps it off nodes); drop {}",
    "gres": _GPUS + "; drop {}",
    _SBATCH_GPUS: _GPUS + " (sbatch's -G is not elastic)",
    "gpus-per-node": _GPUS + "; drop {}",
    "gpus-per-task": _GPUS + "; drop {}",
    "gpus-per-socket": _GPUS + "; drop {}",
    "tres-per-task": _GPUS + ", CPUs and memory per GPU; drop {}",
    "no-requeue": "elastic jobs must be requeueable; drop {}",
    "comment": "the job comment carries the elastic spec; drop {}",
    "wrap": _NEEDS_SCRIPT + "; --wrap is not supported",
    "external": _NEEDS_SCRIPT + "; {} is not supported",
    "mem": "memory is given per GPU (--mem-per-gpu), which Slurm does not allow next to --mem",
    "mem-per-cpu": "memory is given per GPU (--mem-per-gpu), which Slurm does not allow next to --mem-per-cpu",
    "cpus-per-task": "CPUs are given per GPU (--cpus-per-gpu), which Slurm does not allow next to {}",
    "signal": ("the warning before the time limit is slurm-elastic's: set --signal-before SECONDS "
               f"(the signal is ${settings.SIGNAL.env}); drop {{}}"),
}
# In #SBATCH lines sbatch's --gpus/--cpus-per-gpu/--mem-per-gpu keep sbatch's meaning and
# the wrapper's command line would silently override them: say where they belong instead.
REFUSED_IN_SCRIPT = {
    **REFUSED,
    "gpus": _GPUS + " (an #ELASTIC line or the command line); sbatch's --gpus is not elastic",
    "cpus-per-gpu": "write it as '#ELASTIC --cpus-per-gpu N': the controller sets it per size",
    "mem-per-gpu": "write it as '#ELASTIC --mem-per-gpu SIZE': the controller sets it per size",
}
# sbatch also takes options from SBATCH_* variables; the command line overrides most of them,
# but not these (SBATCH_ARRAY_INX=0-3 alone makes an array).
REFUSED_IN_ENV = {
    "SBATCH_ARRAY_INX": "array", "SBATCH_GPUS": _SBATCH_GPUS, "SBATCH_GPUS_PER_NODE": "gpus-per-node",
    "SBATCH_GPUS_PER_TASK": "gpus-per-task", "SBATCH_GPUS_PER_SOCKET": "gpus-per-socket",
    "SBATCH_TRES_PER_TASK": "tres-per-task", "SBATCH_MEM_PER_CPU": "mem-per-cpu", "SBATCH_MEM_PER_NODE": "mem",
    "SBATCH_CPUS_PER_TASK": "cpus-per-task", "SBATCH_SIGNAL": "signal",
}
EXPORT_ENV = "SBATCH_EXPORT"
PARTITION_ENV = "SBATCH_PARTITION"       # sbatch's variable for --partition
RESERVATION_ENV = "SBATCH_RESERVATION"   # sbatch's variable for --reservation
_HETJOB_WORDS = ("hetjob", "packjob")

PYTHON_ENV = settings.PYTHON.env   # the interpreter job_templates/*.sbatch run

# The controller finds a job's files by its job id, so a key of the user's choosing is refused.
JOB_KEY_ENV = settings.JOB_KEY.env
_SETS_JOB_KEY = re.compile(r"(?m)^[^#\n]*\b" + re.escape(str(JOB_KEY_ENV)) + r"=")
JOB_KEY_REFUSED = (f"{JOB_KEY_ENV} is set{{}}: the controller finds a job's checkpoints, reports and ACKs "
                   "by its job id, so a job under another key would be invisible to it; drop it, and to "
                   "continue an ended job keep its id: scontrol requeue OLD_JOB_ID")


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """A parsed `slurm-elastic sbatch` command line, the script's #ELASTIC lines merged in."""

    spec: ElasticSpec
    script: str
    script_args: tuple[str, ...] = ()
    sbatch_args: tuple[str, ...] = ()      # passed on to sbatch, each option spelled out in full
    parsable: bool = False
    watch: bool = False
    dry_run: bool = False
    job_name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    user_export: str | None = None         # the user's own --export (command line, #SBATCH or SBATCH_EXPORT)
    time_limits: TimeLimitPolicy = TimeLimitPolicy()
    time_limit: str | None = None          # its --time as sbatch will read it (None: the partition's default)
    partition: str | None = None           # its --partition as sbatch will read it (None: the default one)
    reservation: str | None = None         # its --reservation as sbatch will read it (None: none)
    signal: str = shim.DEFAULT_SIGNAL      # the checkpoint signal, as scancel and sbatch --signal take it


def parse_command_line(args: list[str] | tuple[str, ...],
                       environ: Mapping[str, str] | None = None) -> SubmitRequest:
    """Split elastic options, our own flags and sbatch's; read the script. Any problem is a SpecError."""
    environ = os.environ if environ is None else environ
    parsed = parse(list(args), WRAPPER)
    elastic: dict[str, str] = {}
    passthrough: list[str] = []
    own = {flag: False for flag in OWN_FLAGS}
    exports: list[str] = []
    times: list[str] = []
    partitions: list[str] = []
    reservations: list[str] = []
    for option in parsed.options:
        if option.name in OWN_FLAGS:
            own[option.name] = True
        elif option.name in REFUSED:
            raise SpecError(f"{option.typed}: {REFUSED[option.name].format(option.typed)}")
        elif option.name in ELASTIC_OPTIONS:
            if not option.value:
                raise SpecError(f"{option.typed} needs a value")
            elastic[ELASTIC_OPTIONS[option.name]] = option.value
        elif option.name == "export":
            exports.append(option.value or "")
        elif option.name != "ignore-pbs":   # always given (see describe_submission)
            if option.name == "time":
                times.append(option.value or "")
            elif option.name == "partition":
                partitions.append(option.value or "")
            elif option.name == "reservation":
                reservations.append(option.value or "")
            passthrough.append(option.as_argument())
    if not parsed.rest:
        raise SpecError("missing the batch script (usage: slurm-elastic sbatch [OPTIONS] SCRIPT [ARGS...])")
    _check_environment(environ)
    script, script_args = parsed.rest[0], tuple(parsed.rest[1:])
    text = read_script(script)
    options = parse_directives(text)
    directives = _check_sbatch_directives(text, ignore_pbs=_ignores_pbs(parsed))
    options.update(elastic)  # the command line wins over #ELASTIC lines
    policy = time_limit.policy_from_options({k: options.pop(k) for k in time_limit.OPTIONS.values() if k in options})
    # sbatch reads --time from the command line, else SBATCH_TIMELIMIT, else the script.
    given_time = _as_sbatch_reads(times, environ.get(time_limit.TIMELIMIT_ENV), directives.times)
    time_limit.check_time_limit(policy, given_time)
    partition = _as_sbatch_reads(partitions, environ.get(PARTITION_ENV), directives.partitions)
    reservation = _as_sbatch_reads(reservations, environ.get(RESERVATION_ENV), directives.reservations)
    spec = spec_from_options(options)
    if spec.ckpt_dir is None:
        spec = dataclasses.replace(spec, ckpt_dir=_site_ckpt_dir(environ))
    _check_ckpt_root(spec.ckpt_dir)
    env = {shim.CKPT_DIR_ENV: spec.ckpt_dir} if spec.ckpt_dir else {}
    env[settings.MIN_GPUS.env or ""] = str(spec.min_gpus)   # survivors below it do not go on in place
    if spec.batch is not None:
        env[shim.BATCH_ENV] = spec.batch.to_text()   # the shim reads the range from here
    env.update(policy.env(submitted_at=time.time()))
    try:
        signal = shim.signal_name(settings.SIGNAL.read(environ))
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    # The job templates run this interpreter, which has slurm_elastic (and torch) - not whatever
    # `python3` the job's PATH finds - unless the user named one.
    env[PYTHON_ENV] = settings.PYTHON.read(environ) or sys.executable
    _check_inherited(env, environ)
    # sbatch keeps the last --export it reads: the command line's, else the script's, else SBATCH_EXPORT.
    user_export = (exports or directives.exports or [None])[-1]
    if user_export is None and environ.get(EXPORT_ENV):
        user_export = environ[EXPORT_ENV]
    _refuse_job_key(environ, user_export, text)
    return SubmitRequest(spec=spec, script=os.path.abspath(script), script_args=script_args,
                         sbatch_args=tuple(passthrough), parsable=own["parsable"], watch=own["watch"],
                         dry_run=own["dry-run"], job_name=None, env=env, user_export=user_export,
                         time_limits=policy, time_limit=given_time, partition=partition,
                         reservation=reservation, signal=signal)


def _site_ckpt_dir(environ: Mapping[str, str]) -> str:
    """The checkpoint root a job without --ckpt-dir gets: the site's (or the user's) SLURM_ELASTIC_CKPT_DIR.

    Every elastic job needs one - its checkpoints, ACKs and reports to the controller live there -
    so a job without one is refused at submit rather than failing when it first starts.
    """
    site = settings.CKPT_DIR.read(environ)
    if not site:
        raise SpecError("an elastic job needs --ckpt-dir PATH (on the command line or an #ELASTIC line; "
                        f"or set {settings.CKPT_DIR.env}): its checkpoints live there")
    return site


def _check_ckpt_root(root: str) -> None:
    """A checkpoint root the submitting user cannot create their job's directory in would fail the job at its
    first start: refused now, in one line. One that does not exist yet is left to the job to create, where
    its nearest existing parent lets the user create it (`/root/ckpt` for a user is refused here, not by a
    traceback from every rank)."""
    if os.path.lexists(root) and not os.path.isdir(root):
        raise SpecError(f"--ckpt-dir {root}: not a directory")
    if os.path.isdir(root):
        if not os.access(root, os.W_OK | os.X_OK):
            raise SpecError(f"--ckpt-dir {root}: you cannot create your job's directory there (not writable by you)")
        return
    parent = os.path.dirname(os.path.normpath(root))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise SpecError(f"--ckpt-dir {root}: it does not exist and you cannot create it ({parent} is not a "
                        f"directory writable by you)")


def _refuse_job_key(environ: Mapping[str, str], user_export: str | None, script_text: str) -> None:
    """A job key the user chooses would hide the job's files from the controller (issue 28): refused
    wherever the wrapper can see it reach the job (sbatch passes the caller's SLURM_* variables
    over --export, an --export list can name it, the script can set it before srun)."""
    if environ.get(str(JOB_KEY_ENV)):
        raise SpecError(JOB_KEY_REFUSED.format(" in your environment"))
    if user_export and any(t.split("=", 1)[0] == JOB_KEY_ENV for t in user_export.split(",")):
        raise SpecError(JOB_KEY_REFUSED.format(" in --export"))
    if _SETS_JOB_KEY.search(script_text):
        raise SpecError(JOB_KEY_REFUSED.format(" by the batch script"))


def _ignores_pbs(parsed: Parsed) -> bool:
    return any(option.name == "ignore-pbs" for option in parsed.options)


def _check_environment(environ: Mapping[str, str]) -> None:
    for var, name in REFUSED_IN_ENV.items():
        if environ.get(var):
            reason = REFUSED[name].format(var)
            raise SpecError(f"{var} is set: sbatch would read it as {name.split()[0]!r} ({reason}); unset it")


def _check_inherited(env: Mapping[str, str], environ: Mapping[str, str]) -> None:
    """sbatch gives the job every SLURM_* variable of its caller over any --export value."""
    for key, value in env.items():
        inherited = environ.get(key)
        if inherited is not None and inherited != value:
            raise SpecError(f"{key}={inherited} in your environment would reach the job instead of {value!r} "
                            f"(sbatch passes SLURM_* variables over --export); unset it first")


def merged_export(user_export: str | None, env: Mapping[str, str]) -> str | None:
    """One --export value that keeps the user's choice and carries the wrapper's variables.

    None when neither has anything to say (sbatch's default, ALL). `NONE` becomes the list
    of our variables alone: a list without ALL exports only it plus SLURM_*, which is NONE
    with our variables added (the form sbatch documents; `NONE,X=1` is not).
    """
    for key, value in env.items():
        if "," in value or "\n" in value or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise SpecError(f"{key}={value!r} cannot be passed through sbatch --export")
    ours = [f"{k}={v}" for k, v in env.items()]
    if user_export is None:
        return ",".join(["ALL", *ours]) if ours else None
    tokens = [t for t in user_export.split(",") if t]
    if not tokens:
        raise SpecError("--export needs a value (ALL, NONE or a list of variables)")
    kept = [t for t in tokens if t.upper() != "NONE" and t.split("=", 1)[0] not in env]
    if not kept and not ours:
        return "NONE"
    return ",".join(kept + ours)


def read_script(path: str) -> str:
    """The batch script's text; it must be a readable regular file starting with a shebang, as sbatch requires.

    Opened without blocking and checked with fstat first: a named pipe would otherwise
    hang here (and in sbatch) until someone writes to it, a device could be read forever.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise SpecError(f"batch script {path!r} does not exist") from None
    except IsADirectoryError:
        raise SpecError(f"batch script {path!r} is a directory") from None
    except OSError as exc:
        raise SpecError(f"cannot read batch script {path!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise SpecError(f"batch script {path!r} is a directory")
        if not stat.S_ISREG(info.st_mode):
            raise SpecError(f"batch script {path!r} is not a regular file ({_file_kind(info.st_mode)})")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(1_000_000)
    except OSError as exc:
        raise SpecError(f"cannot read batch script {path!r}: {exc.strerror}") from None
    finally:
        os.close(fd)
    text = data.decode("utf-8", errors="replace")
    if not text.startswith("#!"):
        raise SpecError(f"batch script {path!r} does not start with a shebang line such as #!/bin/bash")
    return text


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a plain file"


def _as_sbatch_reads(given: list[str], variable: str | None, in_script: list[str]) -> str | None:
    """An option's value as sbatch reads it: the command line's last, else its SBATCH_ variable, else the script's."""
    return given[-1] if given else variable or (in_script[-1] if in_script else None)


@dataclass(frozen=True, slots=True)
class ScriptOptions:
    """The values of the #SBATCH options the wrapper reads (each in the script's order)."""

    exports: list[str]
    times: list[str]
    partitions: list[str]
    reservations: list[str]


def _check_sbatch_directives(text: str, *, ignore_pbs: bool) -> ScriptOptions:
    """#SBATCH/#SLURM options that would fight the elastic request are refused like their command-line form.

    Read with sbatch's own grammar (all the lines' words are one argument list to sbatch, so
    `#SBATCH -a` followed by `#SBATCH 0-2` is an array too). Returns the values of the options the
    wrapper reads.
    """
    words = directive_words(text)
    if not ignore_pbs:
        foreign = foreign_directive_lines(text)
        if foreign:
            raise SpecError(f"line {foreign[0]}: #PBS/#BSUB directives are not read for elastic jobs "
                            "(sbatch runs with --ignore-pbs); write them as #SBATCH lines")
    found = ScriptOptions([], [], [], [])
    try:
        parsed = parse([w.word for w in words], SBATCH, stop_at_operand=False)
    except SpecError as exc:
        raise SpecError(f"#SBATCH lines: {exc}") from None
    for index in parsed.operands:
        if words[index].word in _HETJOB_WORDS:   # sbatch starts the next component of a heterogeneous job
            raise SpecError(f"line {words[index].lineno}: #SBATCH {words[index].word}: "
                            "heterogeneous elastic jobs are not supported")
    for option in parsed.options:
        if option.name in REFUSED_IN_SCRIPT:
            lineno = words[option.at].lineno
            raise SpecError(f"line {lineno}: #SBATCH {option.spelling}: "
                            f"{REFUSED_IN_SCRIPT[option.name].format(option.typed)}")
        values = {"export": found.exports, "time": found.times, "partition": found.partitions,
                  "reservation": found.reservations}.get(option.name)
        if values is not None:
            values.append(option.value or "")
    return found


# -- the initial size -------------------------------------------------------------------------------
def initial_gpus(spec: ElasticSpec, state: ClusterState, policy: Policy = Policy(), *,
                 allowed: frozenset[str] | None = None) -> int:
    """The GPUs the allocator gives a new job on the capacity free now (on the `allowed` nodes, its
    partition's; None: all), else the minimum."""
    from slurm_elastic.control.reconcile import solve

    nodes = tuple(NodeCapacity(n.name, n.free.gpus, n.free.cpus, n.free.mem_mb) for n in state.nodes
                  if allowed is None or n.name in allowed)
    req = JobRequest(key="new", min_gpus=spec.min_gpus, max_gpus=spec.max_gpus, gpu_step=spec.gpu_step,
                     cpus_per_gpu=spec.cpus_per_gpu, mem_per_gpu_mb=spec.mem_per_gpu_mb, weight=spec.weight)
    try:
        allocation = solve(AllocationProblem((req,), nodes, policy))
    except ElasticError as exc:
        log.warning("no initial size from the allocator (%s); submitting at the minimum", exc)
        return spec.min_gpus
    return int(allocation.gpus.get("new", 0)) or spec.min_gpus


def describe_submission(request: SubmitRequest, shape: RequestShape) -> SubmitDescription:
    """The submission; the user's options go last so that sbatch's last-wins cannot override ours.

    --ignore-pbs: sbatch would otherwise turn #PBS/#BSUB lines into options (`#PBS -t 0-2`
    is an array) behind the checks above. The wrapper's variables travel in the one final
    --export (merged with the user's), not in `env`, where a later user --export would win.
    """
    spec = request.spec
    export = merged_export(request.user_export, request.env)
    extra = (*request.sbatch_args, "--ignore-pbs", *request.time_limits.sbatch_args(request.signal),
             *((f"--export={export}",) if export else ()))
    return SubmitDescription(script=request.script, shape=shape, comment=spec.to_comment(), job_name=request.job_name, requeue=True,
                             extra_args=extra, script_args=request.script_args)


@dataclass(frozen=True, slots=True)
class SiteView:
    """What a submission reads from Slurm about the site, once: the partitions' times and the reservations
    (None where the backend cannot read them)."""

    partitions: tuple[PartitionTimes, ...] | None
    reservations: tuple[AdvanceReservation, ...] | None

    @classmethod
    def read(cls, backend: Backend) -> SiteView:
        partitions = backend.partition_times() if isinstance(backend, PartitionReader) else None
        if partitions is None:
            log.info("the %s backend cannot read partitions: --time is not checked against MaxTime",
                     type(backend).__name__)
        reservations = backend.reservations() if isinstance(backend, ReservationReader) else None
        if reservations is None:
            log.info("the %s backend cannot read reservations: the reservations are not checked",
                     type(backend).__name__)
        return cls(partitions, reservations)


def submission_notices(backend: Backend, request: SubmitRequest, now: float | None = None,
                       site: SiteView | None = None) -> tuple[str, ...]:
    """What the user should know before the job runs and nothing refuses: a reservation that ends its requeues,
    reservations it is not in that keep it off their nodes."""
    site = site or SiteView.read(backend)
    if site.reservations is None:
        return ()
    now = time.time() if now is None else now
    limit = time_limit.expected_limit_s(request.time_limit, request.partition, site.partitions or ())
    notices = (time_limit.reservation_notice(request.time_limits, request.reservation, site.reservations, now)
               if request.reservation else None,
               time_limit.blocked_notice(limit, request.reservation, site.reservations, now))
    return tuple(n for n in notices if n)


def submit(backend: Backend, request: SubmitRequest, site: SiteView | None = None
           ) -> tuple[SubmitDescription, int | None]:
    """Check the time limit against the partition's, choose the initial shape and submit (or only describe
    it, with `dry_run`). `site`: what was read for the notices, else read here."""
    site = site or SiteView.read(backend)
    partitions = site.partitions or ()
    if site.partitions is not None:
        time_limit.check_partition_time(request.time_limits, request.time_limit, request.partition, partitions)
    state = backend.snapshot()
    # Slurm starts the job in its partition (-p, else the default one), inside its reservation if it names
    # one: its size is chosen on those nodes
    allowed = partition_nodes(state, request.partition or next((p.name for p in partitions if p.is_default), ""))
    if site.reservations is not None:
        windows = {r.name: r for r in site.reservations}
        if request.reservation:
            inside = open_nodes(windows, request.reservation)
            allowed = inside if allowed is None else allowed & inside
        # nor on the nodes of a reservation that is not its own and opens before its time limit ends
        limit = time_limit.expected_limit_s(request.time_limit, request.partition, partitions)
        blocked = frozenset(blocking(windows, request.reservation or "", time.time(), limit))
        if blocked:
            allowed = (frozenset(n.name for n in state.nodes) if allowed is None else allowed) - blocked
    gpus = initial_gpus(request.spec, state, allowed=allowed)
    shape = request_shape(request.spec, gpus, {}, {n.gpus for n in state.nodes
                                                   if n.available and (allowed is None or n.name in allowed)})
    description = describe_submission(request, shape)
    if request.dry_run:
        return description, None
    job_id = backend.submit(description)
    log.info("job %d: submitted elastic %s at %s GPUs", job_id, request.spec.to_comment(), shape.describe())
    return description, job_id
