"""The Backend over Slurm's commands (squeue/sinfo/scontrol/sbatch/scancel), for every Slurm from 22.05 on.

Every command runs from an argument list (never a shell) with the caller's environment, so
SLURM_CONF chooses the cluster. A snapshot is exactly two calls: `squeue --json` for all
jobs, whose meta also tells the Slurm version (cached), then the node list: `sinfo --json`
on 22.05 (one full record per node there), `scontrol show nodes --json` from 23.02 on
(sinfo --json groups nodes by partition and state there, which loses per-node
allocations). A third call, `scontrol -o -d show job`, happens only when a job record
lacks a field the model needs. Where `--json` is not available at all, text is used.
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from typing import Mapping, Sequence

from slurm_elastic.cluster.backend import SubmitDescription
from slurm_elastic.cluster.model import ClusterState, Job
from slurm_elastic.cluster.partitions import PartitionTimes, parse_partitions
from slurm_elastic.cluster.reservations import AdvanceReservation, parse_reservations
from slurm_elastic.cluster.parse_json import (JSON_ERRORS, MissingField, job_from_record, loads, parse_nodes,
                                              version_of)
from slurm_elastic.cluster.parse_text import jobs_from_text, nodes_from_text
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.cluster.slurm_values import SlurmParseError, SlurmVersion
from slurm_elastic.errors import SlurmError, SlurmUnavailable, UnknownJob

log = logging.getLogger(__name__)

# scontrol --json (and per-node records from `scontrol show nodes --json`) exist from 23.02.
SCONTROL_JSON_SINCE = SlurmVersion(23, 2)
# From 23.02 Slurm prints and honours TRES names with '/', e.g. gres/gpu:3. On 22.05,
# `TresPerNode=gres/gpu:N` is accepted and shown but ignored by the scheduler, while
# `gres:gpu:N` works on every version (slurm-versions.md); so 22.05 gets the ':' spelling.
TRES_SLASH_SINCE = SlurmVersion(23, 2)
# `--requeue=expedite` (25.11 on): a job requeued after a node failure is eligible at once and at
# the top of the queue, instead of waiting ~120 s (BeginTime). Only where slurm.conf has
# SlurmctldParameters=enable_expedited_requeue: without it 26.05's slurmctld refuses the whole
# submission ("Requested operation not supported on this system", seen in CI's sid chroot).
# sbatch 24.11 refuses the argument ("option '--requeue' doesn't allow an argument"); 26.05 takes it.
REQUEUE_EXPEDITE_SINCE = SlurmVersion(25, 11)

_UNAVAILABLE = re.compile(
    r"Unable to contact slurm controller|Connection refused|Socket timed out|Zero Bytes were transmitted"
    r"|Could not establish a configuration source|Communication connection failure|standby mode"
    r"|Connection timed out|Transport endpoint|connect failure|Slurm temporarily unable"
    # what 22.05's scontrol says for a controller that is not listening (seen live)
    r"|Unexpected message received",
    re.IGNORECASE)
_UNKNOWN_JOB = re.compile(r"Invalid job id|Unknown job|job id \S+ not found|does not exist", re.IGNORECASE)
_NO_JSON = re.compile(r"unrecognized option '--json'|invalid option|No serializer|serializer.*not found"
                      r"|data_parser.*(not found|unavailable)", re.IGNORECASE)


class CliBackend:
    """Slurm through its command-line tools."""

    name = "cli"

    def __init__(self, *, env: Mapping[str, str] | None = None, retries: int = 3, backoff_s: float = 1.0,
                 max_backoff_s: float = 8.0, timeout_s: float = 60.0,
                 version: SlurmVersion | None = None) -> None:
        # None: the process environment at each call, so a SLURM_CONF set later is honoured
        self._env = None if env is None else dict(env)
        self.retries = max(int(retries), 1)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self._version = version
        self._json = True          # flips to False once if this Slurm's tools lack --json
        self.calls = 0             # Slurm commands run, for tests and the benchmark
        self._kill_wait_s: float | None = None
        self._expedite: bool | None = None

    # --- running commands ------------------------------------------------------------------------
    def _run(self, args: Sequence[str], *, retry: bool = True, stdin: str | None = None,
             stderr_errors: bool = False) -> str:
        """Run one Slurm command; SlurmUnavailable is retried with bounded exponential backoff."""
        delay = self.backoff_s
        attempts = self.retries if retry else 1
        for attempt in range(1, attempts + 1):
            try:
                return self._run_once(args, stdin, stderr_errors)
            except SlurmUnavailable as exc:
                if attempt == attempts:
                    raise
                log.warning("%s (attempt %d/%d), retrying in %.1f s", exc, attempt, attempts, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
        raise AssertionError("unreachable")

    def _run_once(self, args: Sequence[str], stdin: str | None, stderr_errors: bool) -> str:
        argv = tuple(str(a) for a in args)
        self.calls += 1
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=self._env, input=stdin,
                                  timeout=self.timeout_s, check=False)
        except FileNotFoundError:
            raise SlurmUnavailable(f"{argv[0]} not found: Slurm's commands are not installed or not on PATH",
                                   command=argv) from None
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"{' '.join(argv)} did not answer within {self.timeout_s:.0f} s",
                                   command=argv) from None
        err = proc.stderr.strip()
        if proc.returncode != 0:
            raise classify(err or proc.stdout.strip() or f"exit code {proc.returncode}", argv, proc.returncode)
        errors = [line for line in err.splitlines() if "error:" in line] if stderr_errors else []
        if errors:
            raise classify("\n".join(errors), argv, proc.returncode)
        return proc.stdout

    # --- version -----------------------------------------------------------------------------------
    @property
    def version(self) -> SlurmVersion:
        """The Slurm version, read once (from the first JSON meta, or `scontrol --version`)."""
        if self._version is None:
            self._version = SlurmVersion.parse(self._run(["scontrol", "--version"]))
            log.info("Slurm %s detected via scontrol --version", self._version)
        return self._version

    def _learn_version(self, doc: Mapping) -> None:
        if self._version is None:
            self._version = version_of(doc)
            log.info("Slurm %s detected from squeue --json meta", self._version)

    # --- snapshot ------------------------------------------------------------------------------------
    def snapshot(self) -> ClusterState:
        if self._json:
            try:
                return self._snapshot_json()
            except _NoJson as exc:
                log.warning("Slurm's tools have no usable --json (%s); reading scontrol text instead", exc)
                self._json = False
        return self._snapshot_text()

    def _load_json(self, args: Sequence[str]) -> dict:
        # The JSON document carries RPC failures in `errors` with rc 0 (seen on 22.05 with
        # slurmctld down), so those are retried like a failed command.
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                out = self._run(args, retry=False)
            except SlurmError as exc:
                if _NO_JSON.search(str(exc)):
                    raise _NoJson(str(exc)) from None
                if not isinstance(exc, SlurmUnavailable) or attempt == self.retries:
                    raise
                log.warning("%s (attempt %d/%d), retrying in %.1f s", exc, attempt, self.retries, delay)
            else:
                try:
                    doc = loads(out)
                except JSON_ERRORS as exc:
                    raise SlurmParseError(f"{' '.join(args)} printed no JSON ({exc}): {out[:120]!r}") from None
                errors = doc.get("errors") or []
                if not errors:
                    return doc
                msg = "; ".join(_error_text(e) for e in errors)
                if attempt == self.retries:
                    raise SlurmUnavailable(f"{' '.join(args)}: Slurm reported: {msg}", command=tuple(args))
                log.warning("%s: Slurm reported %s (attempt %d/%d), retrying in %.1f s",
                            " ".join(args), msg, attempt, self.retries, delay)
            time.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)
        raise AssertionError("unreachable")

    def _snapshot_json(self) -> ClusterState:
        taken_at = time.time()
        jobs_doc = self._load_json(["squeue", "--json", "--all", "--states=all"])
        self._learn_version(jobs_doc)
        if self.version >= SCONTROL_JSON_SINCE:
            nodes_doc = self._load_json(["scontrol", "show", "nodes", "--json"])
        else:
            nodes_doc = self._load_json(["sinfo", "--json", "--all"])
        jobs: list[Job] = []
        missing: dict[int, MissingField] = {}
        for rec in jobs_doc.get("jobs", []):
            try:
                jobs.append(job_from_record(rec))
            except MissingField as exc:
                missing[int(exc.record_id)] = exc
        if missing:
            # One text call for all of them, never one per job.
            log.info("job JSON lacks %s; reading scontrol text for %d job(s)",
                     next(iter(missing.values())).field, len(missing))
            by_id = {j.job_id: j for j in jobs_from_text(self._run(["scontrol", "-o", "-d", "show", "job"]))}
            for jid, exc in missing.items():
                if jid not in by_id:
                    raise exc
                jobs.append(by_id[jid])
        return ClusterState(nodes=parse_nodes(nodes_doc), jobs=tuple(jobs), taken_at=taken_at,
                            slurm_version=str(self.version))

    def _snapshot_text(self) -> ClusterState:
        taken_at = time.time()
        jobs = jobs_from_text(self._run(["scontrol", "-o", "-d", "show", "job"]))
        nodes = nodes_from_text(self._run(["scontrol", "-o", "-d", "show", "node"]), jobs)
        return ClusterState(nodes=nodes, jobs=jobs, taken_at=taken_at, slurm_version=str(self.version))

    # --- actions -------------------------------------------------------------------------------------
    def partition_times(self) -> tuple[PartitionTimes, ...]:
        """Every partition's DefaultTime and MaxTime (`scontrol -o show partition`: the same text on every Slurm)."""
        return parse_partitions(self._run(("scontrol", "-o", "show", "partition")))

    def reservations(self) -> tuple[AdvanceReservation, ...]:
        """Every advance reservation's window (`scontrol -o show reservation`)."""
        return parse_reservations(self._run(("scontrol", "-o", "show", "reservation")))

    def submit(self, description: SubmitDescription) -> int:
        out = self._run(sbatch_args(description, self.version, self._expedite_enabled()), retry=False)
        first = out.strip().splitlines()[0] if out.strip() else ""
        m = re.fullmatch(r"(\d+)(?:;\S+)?", first.strip())
        if m is None:
            raise SlurmError(f"sbatch printed no job id: {out.strip()[:200]!r}")
        return int(m[1])

    def hold(self, job_id: int) -> None:
        self._run(["scontrol", "hold", str(int(job_id))])

    def requeue_hold(self, job_id: int) -> None:
        self._run(["scontrol", "requeuehold", str(int(job_id))])

    def requeue(self, job_id: int) -> None:
        self._run(["scontrol", "requeue", str(int(job_id))])

    def set_resources(self, job_id: int, shape: RequestShape, *, start_now: bool = True,
                      nodes: tuple[str, ...] | None = None) -> None:
        self._run(update_args(self.version, job_id, shape, start_now=start_now, nodes=nodes))

    def release(self, job_id: int) -> None:
        self._run(["scontrol", "release", str(int(job_id))])

    def set_priority(self, job_id: int, priority: int) -> None:
        self._run(["scontrol", "update", f"JobId={int(job_id)}", f"Priority={int(priority)}"])

    def signal(self, job_id: int, signal: str) -> None:
        # --full: the batch shell and every step (srun tasks) get it; without it the batch
        # shell is skipped, with --batch only the batch shell (checked live on 22.05).
        self._run(["scancel", f"--signal={_signal_name(signal)}", "--full", str(int(job_id))])

    def cancel(self, job_id: int) -> None:
        # scancel exits 0 for an unknown job id and says so only with --verbose.
        self._run(["scancel", "--verbose", str(int(job_id))], stderr_errors=True)

    # --- a job's lost node (NodeExcludingBackend) ------------------------------------------------------
    def keep_nodes(self, job_id: int, nodes: tuple[str, ...]) -> None:
        # A running job shrunk to these nodes gives up the others at once, so its requeue completes
        # on the nodes that answer instead of waiting (COMPLETING) for a dead slurmd until
        # SlurmdTimeout (seen live on 22.05: 300 s otherwise, about 1 s this way).
        self._run(["scontrol", "update", f"JobId={int(job_id)}", f"NodeList={_node_list(nodes)}"])

    def exclude_nodes(self, job_id: int, nodes: tuple[str, ...], *, readmit: tuple[str, ...] = ()) -> None:
        # ExcNodeList replaces the job's list: the nodes it already excluded are kept, but for `readmit`.
        before = set(self._excluded(job_id))
        wanted = sorted((before | set(nodes)) - set(readmit))
        if set(wanted) == before:
            return
        # an empty value clears the list (scontrol takes "ExcNodeList=" on every version here)
        self._run(["scontrol", "update", f"JobId={int(job_id)}",
                   f"ExcNodeList={_node_list(tuple(wanted)) if wanted else ''}"])

    def drain(self, node: str, reason: str) -> None:
        text = " ".join(str(reason).split())[:200] or "slurm-elastic"
        self._run(["scontrol", "update", f"NodeName={_node_list((node,))}", "State=DRAIN", f"Reason={text}"])

    def resume(self, node: str) -> None:
        self._run(["scontrol", "update", f"NodeName={_node_list((node,))}", "State=RESUME"])

    def _expedite_enabled(self) -> bool:
        """Read once, and only where the version has it (older Slurms need no config read)."""
        if self.version is None or self.version < REQUEUE_EXPEDITE_SINCE:
            return False
        if self._expedite is None:
            self._expedite = expedited_requeue_enabled(self._run(["scontrol", "show", "config"]))
        return self._expedite

    def kill_wait_s(self) -> float:
        """Slurm's KillWait (read once): how long a step's srun waits for a node that does not answer."""
        if self._kill_wait_s is None:
            self._kill_wait_s = self._config_seconds("KillWait")
        return self._kill_wait_s

    def slurmd_timeout_s(self) -> float:
        """Slurm's SlurmdTimeout (read each time: an admin may reconfigure it): how long a node may not
        answer before Slurm sets it DOWN."""
        return self._config_seconds("SlurmdTimeout")

    def _config_seconds(self, name: str) -> float:
        m = re.search(rf"^{name}\s*=\s*(\d+)\s*sec", self._run(["scontrol", "show", "config"]), re.MULTILINE)
        if m is None:
            raise SlurmError(f"scontrol show config: no {name} line")
        return float(m[1])

    def _excluded(self, job_id: int) -> tuple[str, ...]:
        out = self._run(["scontrol", "-o", "show", "job", str(int(job_id))])
        m = re.search(r"(?:^|\s)ExcNodeList=(\S+)", out)
        if m is None or m[1] == "(null)":
            return ()
        return tuple(self._run(["scontrol", "show", "hostnames", m[1]]).split())


class _NoJson(Exception):
    """This Slurm's tool has no usable --json."""


def _error_text(e: object) -> str:
    if isinstance(e, dict):
        return str(e.get("description") or e.get("error") or e)
    return str(e)


def classify(message: str, command: tuple[str, ...], returncode: int | None) -> SlurmError:
    """Slurm's message -> the typed error a caller can act on (the message is Slurm's own)."""
    text = f"{' '.join(command[:2])}: {message}"
    if _UNAVAILABLE.search(message):
        return SlurmUnavailable(text, command=command, returncode=returncode)
    if _UNKNOWN_JOB.search(message):
        return UnknownJob(text, command=command, returncode=returncode)
    return SlurmError(text, command=command, returncode=returncode)


_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _node_list(nodes: tuple[str, ...]) -> str:
    """Node names for scontrol, each checked (they may come from a job's own report)."""
    if not nodes:
        raise SlurmError("no node names given")
    for name in nodes:
        if not isinstance(name, str) or not _NODE_NAME.fullmatch(name):
            raise SlurmError(f"not a node name: {name!r}")
    return ",".join(nodes)


def _signal_name(signal: str | int) -> str:
    name = str(signal).strip().upper()
    if name.isdigit():
        return name
    name = name.removeprefix("SIG")
    if not re.fullmatch(r"[A-Z0-9]+", name):
        raise SlurmError(f"not a signal name: {signal!r}")
    return name


def gpu_tres(version: SlurmVersion, count: int) -> str:
    """The per-GPU TRES spelling this Slurm honours in `scontrol update` (see TRES_SLASH_SINCE)."""
    return f"gres/gpu:{count}" if version >= TRES_SLASH_SINCE else f"gres:gpu:{count}"


def update_args(version: SlurmVersion, job_id: int, shape: RequestShape, *, start_now: bool = True,
                nodes: tuple[str, ...] | None = None) -> list[str]:
    """`scontrol update` for a held job's new shape (and, `nodes` given, where it must start).

    TresPerNode/CpusPerTres/MemPerTres take the version's spelling; they change the job the way
    --gres/--cpus-per-gpu/--mem-per-gpu at submit time do (checked live on 22.05: the released
    job runs with SLURM_GPUS_ON_NODE equal to the new count). StartTime=now clears the ~120 s
    BeginTime Slurm puts on a requeued job.
    """
    for name, val in shape.to_json().items():
        if int(val) < 1:
            raise SlurmError(f"set_resources: {name} must be >= 1, got {val}")
    args = ["scontrol", "update", f"JobId={int(job_id)}", *node_count_fields(shape.nodes), *cpu_count_fields(shape),
            f"TresPerNode={gpu_tres(version, int(shape.gpus_per_node))}",
            f"CpusPerTres={gpu_tres(version, int(shape.cpus_per_gpu))}",
            f"MemPerTres={gpu_tres(version, int(shape.mem_per_gpu_mb))}"]
    args += required_node_fields(nodes)
    if start_now:
        args.append("StartTime=now")
    return args


def required_node_fields(nodes: tuple[str, ...] | None) -> list[str]:
    """ReqNodeList of a pending job: it starts on exactly these nodes (NumNodes is their count), not wherever
    Slurm's first fit puts it first; () clears the list (an empty value, 22.05 to 26.05); None: no field."""
    if nodes is None:
        return []
    return [f"ReqNodeList={_node_list(tuple(nodes)) if nodes else ''}"]


def node_count_fields(nodes: int) -> list[str]:
    """The `scontrol update` fields that set a job's node count, as a fresh `sbatch --nodes=N` would.

    NumNodes=N-N: a bare N sets only the minimum, and for a non-operator (user-mode watch) the maximum
    stays at the submitted count, so a shrunk job restarted on its old node count (seen live, 22.05).
    NumTasks=N: 24.11 keeps the task count of the submission (1 for `--nodes=1`) when NumNodes grows,
    and a job with fewer tasks than nodes stays PENDING on `Resources` for good (seen live on 24.11.5:
    a pending 1x2 job resized to 2x1 beside free GPUs). The templates' sruns give their own counts.
    """
    return [f"NumNodes={int(nodes)}-{int(nodes)}", f"NumTasks={int(nodes)}"]


def cpu_count_fields(shape: RequestShape) -> list[str]:
    """The `scontrol update` fields that set a job's CPU count to the new shape's.

    The job keeps the CPU count of its submission when only CpusPerTres and TresPerNode change (seen
    live, 22.05: a job submitted at 1 GPU and resized to 2 still had NumCPUs=1, and its 2-task srun
    failed with "More processors requested than permitted"); a shrink would keep the CPUs it had."""
    per_node = int(shape.gpus_per_node) * int(shape.cpus_per_gpu)
    return [f"NumCPUs={int(shape.nodes) * per_node}", f"MinCPUsNode={per_node}"]


def requeue_flag(version: SlurmVersion | None, expedite_enabled: bool = False) -> str:
    """`--requeue=expedite` where this Slurm has it (REQUEUE_EXPEDITE_SINCE) and slurmctld enables it,
    else `--requeue`."""
    has = version is not None and version >= REQUEUE_EXPEDITE_SINCE
    return "--requeue=expedite" if has and expedite_enabled else "--requeue"


def expedited_requeue_enabled(config: str) -> bool:
    """Whether `scontrol show config` text has SlurmctldParameters with enable_expedited_requeue."""
    m = re.search(r"^SlurmctldParameters\s*=\s*(\S*)", config, re.MULTILINE)
    return m is not None and "enable_expedited_requeue" in m[1].split(",")


def sbatch_args(d: SubmitDescription, version: SlurmVersion | None = None,
                expedite_enabled: bool = False) -> list[str]:
    """sbatch flags for a SubmitDescription (per-node GPUs via --gres, understood by every version).

    `version`: the Slurm the job goes to; None (not known) gives the flags every version takes.
    `expedite_enabled`: slurmctld has SlurmctldParameters=enable_expedited_requeue.
    """
    shape = d.shape
    for name, val in shape.to_json().items():
        if int(val) < (0 if name == "gpus_per_node" else 1):
            raise SlurmError(f"submit: {name} must be positive, got {val}")
    args = ["sbatch", "--parsable", f"--nodes={int(shape.nodes)}"]
    if shape.gpus_per_node > 0:
        args += [f"--gres=gpu:{int(shape.gpus_per_node)}", f"--cpus-per-gpu={int(shape.cpus_per_gpu)}",
                 f"--mem-per-gpu={int(shape.mem_per_gpu_mb)}M"]
    if d.comment:
        args.append(f"--comment={d.comment}")
    if d.job_name:
        args.append(f"--job-name={d.job_name}")
    args.append(requeue_flag(version, expedite_enabled) if d.requeue else "--no-requeue")
    if d.hold:
        args.append("--hold")
    if d.workdir:
        args.append(f"--chdir={d.workdir}")
    if d.env:
        # --export keeps the caller's environment (ALL) and adds these; values may not hold commas.
        for k, v in d.env.items():
            if "," in v or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise SlurmError(f"submit: environment {k}={v!r} cannot be passed through sbatch --export")
        args.append("--export=ALL," + ",".join(f"{k}={v}" for k, v in d.env.items()))
    args += list(d.extra_args)
    args.append(d.script)
    args += list(d.script_args)
    return args
