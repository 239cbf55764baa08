"""ElasticSpec: what a job accepts (GPU range, step, per-GPU CPUs and memory), and its one text form."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Mapping

from slurm_elastic.errors import SpecError

# The canonical form travels in the job's Slurm comment, so job_submit.lua and
# every backend read the same bytes. Keys are fixed and ordered; nothing else
# is accepted, which keeps shell syntax and foreign fields out by construction.
SPEC_PREFIX = "elastic:v1"
_CKPT_RE = r"/[A-Za-z0-9._/+@-]*"
_CANONICAL = re.compile(
    r"elastic:v1"
    r" gpus=(?P<min>[0-9]{1,6})-(?P<max>[0-9]{1,6})"
    r" step=(?P<step>[0-9]{1,6})"
    r" cpus-per-gpu=(?P<cpg>[0-9]{1,5})"
    r" mem-per-gpu=(?P<mpg>[0-9]{1,9})M"
    r" weight=(?P<w>[0-9]{1,7}(?:\.[0-9]{1,6})?)"
    r"(?: ckpt=(?P<ckpt>" + _CKPT_RE + r"))?"
)

MAX_GPUS = 100_000
MAX_CPUS_PER_GPU = 1024
MAX_MEM_PER_GPU_MB = 16 * 1024 * 1024  # 16 TiB
MAX_WEIGHT = 1_000_000.0

DEFAULT_CPUS_PER_GPU = 1
DEFAULT_MEM_PER_GPU_MB = 1024


@dataclass(frozen=True, slots=True)
class ElasticSpec:
    """The elastic contract of one job: any multiple of `gpu_step` in [min_gpus, max_gpus]."""

    min_gpus: int
    max_gpus: int
    gpu_step: int = 1
    cpus_per_gpu: int = DEFAULT_CPUS_PER_GPU
    mem_per_gpu_mb: int = DEFAULT_MEM_PER_GPU_MB
    weight: float = 1.0
    ckpt_dir: str | None = None
    batch: BatchRange | None = None     # adaptive batch (job-side: not part of the canonical comment)

    def __post_init__(self) -> None:
        _validate(self)

    # -- the canonical text form -------------------------------------------------
    def to_comment(self) -> str:
        """The one canonical text form, stored in the job's Slurm comment."""
        parts = [
            SPEC_PREFIX,
            f"gpus={self.min_gpus}-{self.max_gpus}",
            f"step={self.gpu_step}",
            f"cpus-per-gpu={self.cpus_per_gpu}",
            f"mem-per-gpu={self.mem_per_gpu_mb}M",
            f"weight={_format_weight(self.weight)}",
        ]
        if self.ckpt_dir is not None:
            parts.append(f"ckpt={self.ckpt_dir}")
        return " ".join(parts)

    @classmethod
    def from_comment(cls, text: str) -> ElasticSpec:
        """Parse the canonical form strictly; anything else is a SpecError."""
        m = _CANONICAL.fullmatch(text)
        if m is None:
            raise SpecError(f"not a canonical elastic spec: {_shorten(text)!r} "
                            f"(expected e.g. '{ElasticSpec(1, 4).to_comment()}')")
        spec = cls(
            min_gpus=int(m["min"]),
            max_gpus=int(m["max"]),
            gpu_step=int(m["step"]),
            cpus_per_gpu=int(m["cpg"]),
            mem_per_gpu_mb=int(m["mpg"]),
            weight=float(m["w"]),
            ckpt_dir=m["ckpt"],
        )
        if spec.to_comment() != text:
            # e.g. leading zeros or a trailing '.0': one spec has one spelling.
            raise SpecError(f"elastic spec is not in canonical form: {_shorten(text)!r}; "
                            f"canonical is {spec.to_comment()!r}")
        return spec

    @staticmethod
    def is_elastic_comment(text: str | None) -> bool:
        """True when a comment claims to be an elastic spec (it may still be malformed)."""
        return bool(text) and text.startswith(SPEC_PREFIX)

    # -- derived -------------------------------------------------------------------
    def allowed_gpus(self) -> range:
        """Every GPU count this job may run with (0, not running, is always allowed too)."""
        return range(self.min_gpus, self.max_gpus + 1, self.gpu_step)

    def with_overrides(self, **changes: object) -> ElasticSpec:
        return replace(self, **changes)


# -- the batch range of an adaptive-batch job ---------------------------------------------
MAX_BATCH = 1 << 40


@dataclass(frozen=True, slots=True)
class BatchRange:
    """`adaptive:MIN-MAX`: the global batch the job's shim may choose at each start (opt-in; fixed is the default).

    A job-side option: it reaches the job as SLURM_ELASTIC_BATCH, not in the
    Slurm comment, and the job records it in `<job dir>/batch.json` for the
    controller.
    """

    min_batch: int
    max_batch: int

    def __post_init__(self) -> None:
        for name in ("min_batch", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BATCH:
                raise SpecError(f"--batch: {name.split('_')[0]} batch must be a whole number in 1..{MAX_BATCH}, "
                                f"got {value!r}")
        if self.min_batch > self.max_batch:
            raise SpecError(f"--batch: min batch {self.min_batch} exceeds max batch {self.max_batch}")

    def to_text(self) -> str:
        return f"adaptive:{self.min_batch}-{self.max_batch}"


def parse_batch_range(text: str) -> BatchRange:
    """'adaptive:64-1024' -> BatchRange(64, 1024); anything else is one SpecError line."""
    m = re.fullmatch(r"adaptive:([0-9]{1,13})-([0-9]{1,13})", text.strip())
    if m is None:
        raise SpecError(f"--batch must be adaptive:MIN-MAX (global batch sizes, e.g. adaptive:64-1024), got {text!r}")
    return BatchRange(int(m[1]), int(m[2]))


# -- building a spec from user input (CLI flags and #ELASTIC lines) -----------------
FLAG_KEYS = ("gpus", "gpu_step", "cpus_per_gpu", "mem_per_gpu", "weight", "ckpt_dir", "batch")


def parse_gpu_range(text: str) -> tuple[int, int]:
    """'4-32' -> (4, 32); '8' -> (8, 8)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", text)
    if m is None:
        raise SpecError(f"--gpus must be MIN-MAX or N (e.g. 4-32), got {text!r}")
    lo = int(m[1])
    hi = int(m[2]) if m[2] is not None else lo
    return lo, hi


def parse_memory_mb(text: str) -> int:
    """Slurm-style memory: '4000', '4000M', '4G', '1T' -> MB (integer)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KkMmGgTt]?)[Bb]?\s*", text)
    if m is None:
        raise SpecError(f"memory must be a number with an optional K/M/G/T suffix (e.g. 4G), got {text!r}")
    value = float(m[1])
    scale = {"k": 1 / 1024, "m": 1, "": 1, "g": 1024, "t": 1024 * 1024}[m[2].lower()]
    mb = value * scale
    if mb < 1 or mb != mb:
        raise SpecError(f"memory per GPU must be at least 1M, got {text!r}")
    return int(math.ceil(mb))


def parse_int(name: str, text: str | int) -> int:
    if isinstance(text, int):
        return text
    if not re.fullmatch(r"\s*[0-9]+\s*", text):
        raise SpecError(f"{name} must be a positive whole number, got {text!r}")
    return int(text)


def parse_weight(text: str | float) -> float:
    try:
        w = float(text)
    except (TypeError, ValueError):
        raise SpecError(f"--weight must be a positive number, got {text!r}") from None
    return w


def spec_from_options(options: Mapping[str, object]) -> ElasticSpec:
    """Build a spec from option values (strings or numbers) keyed like FLAG_KEYS.

    `gpus` is required; everything else has a default.
    """
    unknown = set(options) - set(FLAG_KEYS)
    if unknown:
        raise SpecError(f"unknown elastic option(s): {', '.join(sorted(unknown))}")
    if options.get("gpus") is None:
        raise SpecError("an elastic job needs --gpus MIN-MAX (on the command line or an #ELASTIC line)")
    lo, hi = parse_gpu_range(str(options["gpus"]))
    kwargs: dict[str, object] = {"min_gpus": lo, "max_gpus": hi}
    if options.get("gpu_step") is not None:
        kwargs["gpu_step"] = parse_int("--gpu-step", options["gpu_step"])  # type: ignore[arg-type]
    if options.get("cpus_per_gpu") is not None:
        kwargs["cpus_per_gpu"] = parse_int("--cpus-per-gpu", options["cpus_per_gpu"])  # type: ignore[arg-type]
    if options.get("mem_per_gpu") is not None:
        mem = options["mem_per_gpu"]
        kwargs["mem_per_gpu_mb"] = mem if isinstance(mem, int) else parse_memory_mb(str(mem))
    if options.get("weight") is not None:
        kwargs["weight"] = parse_weight(options["weight"])  # type: ignore[arg-type]
    if options.get("ckpt_dir") is not None:
        kwargs["ckpt_dir"] = str(options["ckpt_dir"])
    if options.get("batch") is not None:
        batch = options["batch"]
        kwargs["batch"] = batch if isinstance(batch, BatchRange) else parse_batch_range(str(batch))
    return ElasticSpec(**kwargs)  # type: ignore[arg-type]


# #ELASTIC lines use the same long options as the command line.
_DIRECTIVE_OPTIONS = {
    "--gpus": "gpus",
    "--gpu-step": "gpu_step",
    "--cpus-per-gpu": "cpus_per_gpu",
    "--mem-per-gpu": "mem_per_gpu",
    "--weight": "weight",
    "--ckpt-dir": "ckpt_dir",
    "--batch": "batch",
    # The job's time-limit policy (control/time_limit.py): read by the wrapper, not part of the spec.
    "--signal-before": "signal_before",
    "--total-time": "total_time",
}


def parse_directives(script_text: str) -> dict[str, str]:
    """Collect `#ELASTIC --opt value` / `--opt=value` lines from a batch script.

    Like #SBATCH, directives are read only up to the first command line.
    """
    found: dict[str, str] = {}
    for lineno, raw in enumerate(script_text.splitlines(), start=1):
        line = raw.strip()
        if lineno == 1 and line.startswith("#!"):
            continue
        if not line or (line.startswith("#") and not line.startswith("#ELASTIC")):
            continue
        if not line.startswith("#ELASTIC"):
            break  # first command: directives end here, as with #SBATCH
        body = line[len("#ELASTIC"):]
        if body and not body[0].isspace():
            raise SpecError(f"line {lineno}: expected '#ELASTIC --option value', got {raw.strip()!r}")
        tokens = body.split()
        i = 0
        while i < len(tokens):
            tok = tokens[i]
            if "=" in tok:
                opt, value = tok.split("=", 1)
                i += 1
            else:
                opt = tok
                if i + 1 >= len(tokens):
                    raise SpecError(f"line {lineno}: {opt} needs a value")
                value = tokens[i + 1]
                i += 2
            key = _DIRECTIVE_OPTIONS.get(opt)
            if key is None:
                raise SpecError(f"line {lineno}: unknown #ELASTIC option {opt!r} "
                                f"(known: {', '.join(_DIRECTIVE_OPTIONS)})")
            found[key] = value
    return found


# -- validation ------------------------------------------------------------------------
def _validate(spec: ElasticSpec) -> None:
    for name in ("min_gpus", "max_gpus", "gpu_step", "cpus_per_gpu", "mem_per_gpu_mb"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{name} must be a whole number, got {value!r}")
        if value < 1:
            raise SpecError(f"{name} must be at least 1, got {value}")
    if spec.max_gpus > MAX_GPUS:
        raise SpecError(f"max GPUs {spec.max_gpus} is larger than {MAX_GPUS}")
    if spec.min_gpus > spec.max_gpus:
        raise SpecError(f"min GPUs {spec.min_gpus} exceeds max GPUs {spec.max_gpus}")
    if spec.gpu_step > spec.max_gpus:
        raise SpecError(f"GPU step {spec.gpu_step} exceeds max GPUs {spec.max_gpus}")
    if spec.min_gpus % spec.gpu_step or spec.max_gpus % spec.gpu_step:
        raise SpecError(f"min and max GPUs ({spec.min_gpus}-{spec.max_gpus}) must be multiples "
                        f"of the GPU step {spec.gpu_step}")
    if spec.cpus_per_gpu > MAX_CPUS_PER_GPU:
        raise SpecError(f"CPUs per GPU {spec.cpus_per_gpu} is larger than {MAX_CPUS_PER_GPU}")
    if spec.mem_per_gpu_mb > MAX_MEM_PER_GPU_MB:
        raise SpecError(f"memory per GPU {spec.mem_per_gpu_mb}M is larger than {MAX_MEM_PER_GPU_MB}M")
    w = spec.weight
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
        raise SpecError(f"weight must be a positive finite number, got {w!r}")
    if w > MAX_WEIGHT:
        raise SpecError(f"weight {w} is larger than {MAX_WEIGHT:g}")
    if round(w, 6) != w:
        raise SpecError(f"weight {w!r} has more than 6 decimals")
    if spec.ckpt_dir is not None:
        _validate_ckpt_dir(spec.ckpt_dir)
    if spec.batch is not None and not isinstance(spec.batch, BatchRange):
        raise SpecError(f"batch must be a BatchRange (adaptive:MIN-MAX), got {spec.batch!r}")


def _validate_ckpt_dir(path: str) -> None:
    if not isinstance(path, str) or not path.startswith("/"):
        raise SpecError(f"checkpoint dir must be an absolute path, got {path!r}")
    if not re.fullmatch(_CKPT_RE, path):
        raise SpecError(f"checkpoint dir {path!r} may contain only letters, digits and ._/+@-")
    if any(part == ".." for part in path.split("/")):
        raise SpecError(f"checkpoint dir {path!r} must not contain '..'")
    if len(path) > 1024:
        raise SpecError("checkpoint dir is longer than 1024 characters")


def _format_weight(w: float) -> str:
    text = f"{w:.6f}".rstrip("0").rstrip(".")
    return text or "0"


def _shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
