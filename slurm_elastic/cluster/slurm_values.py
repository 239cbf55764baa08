"""Slurm's value spellings shared by every parser: numbers, states, GRES/TRES strings, hostlists, sizes."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from slurm_elastic.cluster.model import JobState, NodeFlag, NodeState
from slurm_elastic.errors import SlurmError, SpecError
from slurm_elastic.spec import ElasticSpec


class SlurmParseError(SlurmError):
    """Slurm answered, but in a shape this parser does not understand (a bug or a new Slurm)."""


@dataclass(frozen=True, slots=True, order=True)
class SlurmVersion:
    """major.minor.micro of the running Slurm, e.g. 22.05.8; releases compare as tuples."""

    major: int
    minor: int
    micro: int = 0

    @classmethod
    def parse(cls, text: str) -> SlurmVersion:
        """'slurm 22.05.8', '24.11.5', '26.05.5-1' or '25.11' -> SlurmVersion."""
        m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
        if m is None:
            raise SlurmParseError(f"cannot read a Slurm version from {text!r}")
        return cls(int(m[1]), int(m[2]), int(m[3] or 0))

    @classmethod
    def from_meta(cls, meta: dict) -> SlurmVersion:
        """The `meta` block of any --json output: `Slurm` (22.05, ints) or `slurm` (23.02+, strings)."""
        block = meta.get("slurm") or meta.get("Slurm") or {}
        ver = block.get("version") or {}
        try:
            return cls(int(ver["major"]), int(ver["minor"]), int(ver.get("micro") or 0))
        except (KeyError, TypeError, ValueError):
            release = block.get("release")
            if isinstance(release, str):
                return cls.parse(release)
            raise SlurmParseError(f"no Slurm version in JSON meta: {meta!r:.200}") from None

    @property
    def release(self) -> str:
        return f"{self.major}.{self.minor:02d}"

    def __str__(self) -> str:
        return f"{self.major}.{self.minor:02d}.{self.micro}"


# --- numbers -----------------------------------------------------------------------------------

def number(value: object, default: int | None = None) -> int | None:
    """A plain int (22.05) or a {set, infinite, number} object (23.11+); unset/infinite -> default."""
    if value is None or isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite", False):
            return default
        return number(value.get("number"), default)
    if isinstance(value, str):
        value = value.strip()
        if value.isdigit():
            return int(value)
        return default
    return default


_SIZE_UNITS = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024, "P": 1024 ** 3}


def size_mb(text: str) -> int:
    """'1024', '1024M', '1G', '62.50G' -> megabytes (Slurm's default unit is MB)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]?)B?\s*", text, flags=re.IGNORECASE)
    if m is None:
        raise SlurmParseError(f"not a Slurm memory size: {text!r}")
    return int(round(float(m[1]) * _SIZE_UNITS[m[2].upper()]))


# --- TRES and GRES -----------------------------------------------------------------------------

def tres_map(text: str | None) -> dict[str, str]:
    """'cpu=2,mem=1G,node=1,gres/gpu=3' -> {'cpu': '2', 'mem': '1G', 'node': '1', 'gres/gpu': '3'}."""
    out: dict[str, str] = {}
    if not text or text in ("(null)", "N/A"):
        return out
    for item in text.split(","):
        key, sep, val = item.partition("=")
        if sep:
            out[key.strip()] = val.strip()
    return out


def tres_gpus(text: str | None) -> int | None:
    """GPUs in a TRES string ('gres/gpu=3' or typed 'gres/gpu:a100=3'); None when it names none."""
    total = None
    for key, val in tres_map(text).items():
        if key == "gres/gpu" or (key.startswith("gres/gpu:") and total is None):
            if val.isdigit():
                total = int(val) if key == "gres/gpu" else (total or 0) + int(val)
    return total


def _split_top_level(text: str, opener: str = "(", closer: str = ")") -> list[str]:
    """Split on commas outside brackets ('gpu:2(S:0-1),shard:4'; with '[', ']': 'n[1-3],m2')."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == opener:
            depth += 1
        elif ch == closer:
            depth = max(depth - 1, 0)
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def gres_gpus(text: str | None) -> int | None:
    """GPUs in a GRES/TRES-per-node string, in any spelling Slurm uses.

    'gpu:4', 'gpu:a100:4(S:0-1)', 'gres:gpu:3' (22.05), 'gres/gpu:3' (23.02+),
    'gres/gpu:a100:2', 'gpu:3(IDX:0-2)', 'gpu:0'; several GPU types add up.
    None when the string names no GPU at all (so the caller can fall back).
    """
    if not text or text in ("(null)", "N/A"):
        return None
    total = None
    for item in _split_top_level(text):
        item = item.split("(", 1)[0]
        for prefix in ("gres:", "gres/"):
            if item.startswith(prefix):
                item = item[len(prefix):]
        fields = item.split(":")
        if fields[0] != "gpu":
            continue
        count = 1  # 'gpu' or 'gpu:a100' without a count means one
        if len(fields) >= 2 and fields[-1].isdigit():
            count = int(fields[-1])
        total = (total or 0) + count
    return total


def per_gpu_value(text: str | None) -> str | None:
    """The value of a per-GPU setting: 'gres:gpu:4' / 'gres/gpu:4' / 'gpu:4' -> '4'; None if not GPU."""
    if not text or text in ("(null)", "N/A"):
        return None
    for item in _split_top_level(text):
        for prefix in ("gres:", "gres/"):
            if item.startswith(prefix):
                item = item[len(prefix):]
        fields = item.split(":")
        if fields[0] == "gpu" and len(fields) >= 2:
            return fields[-1]
    return None


# --- hostlists ---------------------------------------------------------------------------------

def expand_hostlist(text: str | None) -> tuple[str, ...]:
    """'n[1-3,5],gpu[01-02]' -> ('n1', 'n2', 'n3', 'n5', 'gpu01', 'gpu02'); '' / '(null)' -> ()."""
    if not text or text in ("(null)", "None", "N/A"):
        return ()
    names: list[str] = []
    for part in _split_top_level(text, "[", "]"):
        m = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", part)
        if m is None:
            names.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for rng in ranges.split(","):
            lo, sep, hi = rng.partition("-")
            if not sep:
                names.extend(expand_hostlist(f"{prefix}{lo}{suffix}"))
                continue
            width = len(lo)
            for i in range(int(lo), int(hi) + 1):
                names.extend(expand_hostlist(f"{prefix}{i:0{width}d}{suffix}"))
    return tuple(names)


# --- states --------------------------------------------------------------------------------------

_NODE_BASE = {
    "IDLE": NodeState.IDLE, "MIXED": NodeState.MIXED, "MIX": NodeState.MIXED,
    "ALLOCATED": NodeState.ALLOCATED, "ALLOC": NodeState.ALLOCATED,
    "DOWN": NodeState.DOWN, "ERROR": NodeState.ERROR, "FUTURE": NodeState.FUTURE, "FUTR": NodeState.FUTURE,
    "UNKNOWN": NodeState.UNKNOWN, "UNK": NodeState.UNKNOWN,
    # sinfo's compound spellings: DRAIN set on an idle (drained) or busy (draining) node
    "DRAINED": NodeState.IDLE, "DRAINING": NodeState.ALLOCATED, "DRNG": NodeState.ALLOCATED,
}
_NODE_FLAGS = {
    "DRAIN": NodeFlag.DRAIN, "DRAINED": NodeFlag.DRAIN, "DRAINING": NodeFlag.DRAIN,
    "NOT_RESPONDING": NodeFlag.NOT_RESPONDING, "FAIL": NodeFlag.FAIL, "FAILING": NodeFlag.FAIL,
    "POWERED_DOWN": NodeFlag.POWERED_DOWN, "POWER_DOWN": NodeFlag.POWERING_DOWN,
    "POWERING_DOWN": NodeFlag.POWERING_DOWN, "POWERING_UP": NodeFlag.POWERING_UP,
    "POWER_UP": NodeFlag.POWERING_UP, "MAINTENANCE": NodeFlag.MAINTENANCE, "MAINT": NodeFlag.MAINTENANCE,
    "RESERVED": NodeFlag.RESERVED, "RESV": NodeFlag.RESERVED,
    "REBOOT": NodeFlag.REBOOT, "REBOOT_REQUESTED": NodeFlag.REBOOT, "REBOOT_ISSUED": NodeFlag.REBOOT,
    "COMPLETING": NodeFlag.COMPLETING,
}
# sinfo's one-character suffixes: '*' not responding, '~' powered down, '#' powering up,
# '%' powering down, '!' pending power down, '@' reboot pending, '$' maintenance.
_SUFFIX_FLAGS = {"*": NodeFlag.NOT_RESPONDING, "~": NodeFlag.POWERED_DOWN, "#": NodeFlag.POWERING_UP,
                 "%": NodeFlag.POWERING_DOWN, "!": NodeFlag.POWERING_DOWN, "@": NodeFlag.REBOOT,
                 "$": NodeFlag.MAINTENANCE}


def node_state(tokens: str | list[str] | tuple[str, ...],
               extra_flags: list[str] | tuple[str, ...] = ()) -> tuple[NodeState, frozenset[NodeFlag]]:
    """Normalise any node-state spelling to (base state, flags).

    22.05 JSON: 'down' + state_flags ['NOT_RESPONDING']; 23.02+ JSON: ['DOWN', 'NOT_RESPONDING'];
    text: 'DOWN+NOT_RESPONDING', 'IDLE+DRAIN', 'down*', 'drained'. Unknown flags are ignored (a
    newer Slurm adds some: e.g. PLANNED, DYNAMIC_NORM) but an unknown base state is an error.
    """
    if isinstance(tokens, str):
        tokens = [t for t in re.split(r"[+,]", tokens) if t]
    words: list[str] = []
    flags: set[NodeFlag] = set()
    for tok in list(tokens) + list(extra_flags):
        tok = tok.strip()
        while tok and tok[-1] in _SUFFIX_FLAGS:
            flags.add(_SUFFIX_FLAGS[tok[-1]])
            tok = tok[:-1]
        if tok:
            words.append(tok.upper())
    bases = [w for w in words if w in _NODE_BASE]
    if bases:
        base = _NODE_BASE[bases[0]]
    elif "COMPLETING" in words or "COMP" in words:
        base = NodeState.COMPLETING
    elif "DRAIN" in words:
        base = NodeState.IDLE  # sinfo's bare 'drain': DRAIN set, nothing running
    else:
        base = None
    for w in words:
        if w in _NODE_FLAGS:
            flags.add(_NODE_FLAGS[w])
        elif w == "DRNG":
            flags.add(NodeFlag.DRAIN)
    if base is None:
        raise SlurmParseError(f"unknown node state {'+'.join(words) or '(empty)'!r}")
    return base, frozenset(flags)


_JOB_BASE = {s.value: s for s in JobState}
_JOB_BASE.update({"COMPLETE": JobState.COMPLETED, "CONFIGURING": JobState.RUNNING,
                  "STAGE_OUT": JobState.COMPLETING, "SPECIAL_EXIT": JobState.FAILED,
                  "REVOKED": JobState.CANCELLED, "SIGNALING": JobState.RUNNING,
                  "STOPPED": JobState.SUSPENDED, "RESV_DEL_HOLD": JobState.PENDING,
                  "REQUEUE_FED": JobState.PENDING, "LAUNCH_FAILED": JobState.FAILED,
                  "UPDATE_DB": JobState.RUNNING, "POWER_UP_NODE": JobState.RUNNING,
                  "RECONFIG_FAIL": JobState.FAILED, "RESIZING": JobState.RESIZING})
_JOB_BASES = ("PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "COMPLETE", "CANCELLED", "FAILED", "TIMEOUT",
              "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY")


def job_state(value: str | list[str] | tuple[str, ...]) -> JobState:
    """'RUNNING' (22.05, text) or ['PENDING', 'REQUEUED'] (23.02+) -> JobState.

    The base state wins, except that COMPLETING/REQUEUE_HOLD/RESIZING say more than it does.
    """
    words = [w.upper() for w in ([value] if isinstance(value, str) else list(value)) if w]
    if not words:
        raise SlurmParseError("job without a state")
    for special in ("COMPLETING", "REQUEUE_HOLD", "RESIZING"):
        if special in words:
            return _JOB_BASE[special]
    for w in words:
        if w in _JOB_BASES:
            return _JOB_BASE[w]
    for w in words:
        if w in _JOB_BASE:
            return _JOB_BASE[w]
    raise SlurmParseError(f"unknown job state {'+'.join(words)!r}")


# --- what a job needs per node ----------------------------------------------------------------------

def job_cpus_per_node(cpus_total: int, num_nodes: int, *, gpus_per_node: int, cpus_per_gpu: int | None,
                      running: bool) -> int:
    """CPUs per node: a running job's allocation over its nodes; a pending job's request.

    A pending --cpus-per-gpu job's per-GPU request comes first: 22.05 counts its CPUs as one
    per task (NumCPUs=2 for 2 nodes x 2 GPUs at 1 CPU per GPU; it then ran with 4), 24.11
    and 26.05 count 4 (the project captures).
    """
    if not running and cpus_per_gpu and gpus_per_node:
        return cpus_per_gpu * gpus_per_node
    return math.ceil(cpus_total / max(num_nodes, 1)) if cpus_total else 0


def job_mem_per_node(*, allocated: int | None = None, per_gpu: int | None = None, gpus_per_node: int = 0,
                     per_node: int | None = None, per_cpu: int | None = None, cpus_per_node: int = 0,
                     tres_total: int | None = None, num_nodes: int = 1) -> int:
    """MB per node: what Slurm allocated on each node (running), else what the job asked for.

    --mem, --mem-per-cpu and --mem-per-gpu exclude each other, and a --mem-per-gpu=M job with
    G GPUs per node holds G*M per node. 23.02+ also report M itself as the job's memory per
    node (`memory_per_node` 500 and `MinMemoryTRES=500M` for 2 GPUs at 500M, where Slurm
    allocated 1000 per node; 22.05: null and `MinMemoryNode=0`), so the per-GPU request is read
    before the per-node one. The TRES total (no request of either kind) is spread evenly.
    """
    if allocated:
        return allocated
    if per_gpu and gpus_per_node:
        return per_gpu * gpus_per_node
    if per_node:
        return per_node
    if per_cpu:
        return per_cpu * cpus_per_node
    if tres_total:
        return math.ceil(tres_total / max(num_nodes, 1))
    return 0


# --- held jobs and reasons -------------------------------------------------------------------------

def job_held(state: JobState, *, hold_flag: bool, priority: int | None) -> bool:
    """Held: Slurm will not start the job until it is released.

    A finished job is never held: Slurm 24.11 and 26.05 keep `"hold": true` in `squeue --json`
    on a held job after it was cancelled, and 22.05 keeps priority 0 there (both seen live).
    Nor is a running one. A job still COMPLETING its `requeuehold` (or REQUEUED, as 22.05 spells
    it) is: it lands PENDING and held. Priority 0 is what a hold is in Slurm (`scontrol hold` and
    `requeuehold` set it; no scheduling plugin computes 0); 22.05 has no `hold` key.
    """
    if state is JobState.REQUEUE_HOLD:
        return True
    if state.finished or state is JobState.RUNNING:
        return False
    return hold_flag or priority == 0


# Descriptions slurmctld puts in a job's state_desc, which scontrol text (spaces -> '_'), squeue's
# %r and pyslurm's `state_reason` show instead of the reason code; the JSON's state_reason is the
# code. Only descriptions seen live are listed.
_REASON_OF_DESCRIPTION = {
    "job requeued in held state": "JobHeldUser",   # scontrol requeuehold (22.05, 24.11, 26.05)
}


def reason_code(text: str | None) -> str:
    """Slurm's reason code ('JobHeldUser', 'BeginTime') from a code or a state description.

    '', 'None' and '(null)' mean no reason. 'ReqNodeNotAvail, UnavailableNodes:n1' is a
    description that starts with its code. An unknown description is returned as it is.
    """
    text = (text or "").strip()
    if text in ("", "None", "(null)"):
        return ""
    known = _REASON_OF_DESCRIPTION.get(text.replace("_", " "))
    if known:
        return known
    head = text.split(",", 1)[0].strip()
    if re.fullmatch(r"[A-Z][A-Za-z0-9_]*", head):
        return head
    return text


# --- the elastic spec in a comment -----------------------------------------------------------------

def spec_from_comment(comment: str | None) -> tuple[ElasticSpec | None, str | None]:
    """(spec, None) for an elastic comment, (None, error) for a broken one, (None, None) otherwise.

    A comment that claims elasticity but does not parse is never treated as elastic and never
    crashes the snapshot: the error travels with the job so status can show it.
    """
    if not ElasticSpec.is_elastic_comment(comment):
        return None, None
    try:
        return ElasticSpec.from_comment(comment or ""), None
    except SpecError as exc:
        return None, str(exc)
