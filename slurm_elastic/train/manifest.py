"""The checkpoint's on-disk schemas: manifest.json and safetensors headers, checked before restore uses them."""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import math
import re
from collections.abc import Callable
from typing import Any

import xxhash

from slurm_elastic.errors import CheckpointError

FORMAT = "slurm-elastic-ckpt/1"

# The data files' checksum is for damage (a torn or truncated write, bit rot, a file from
# elsewhere), not for an adversary: whoever can rewrite a file can rewrite the manifest
# too. xxh3-128 costs about 0.04 CPU-seconds per GB here, sha256 (with SHA-NI) 0.55, and a
# checkpoint every step on a busy CPU pays that out of training's own time. Manifests
# name the algorithm per file, so either verifies; sha256 stays selectable.
CHECKSUMS: dict[str, Callable[..., Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
DEFAULT_CHECKSUM = "xxh3_128"
_DIGEST_HEX = {"xxh3_128": 32, "sha256": 64}

# safetensors dtype names the store writes, with their element sizes.
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

# Bounds for what restore parses. A manifest holds ~21 KB of RNG state per rank, so 256 MiB
# covers ten thousand ranks; nothing the store writes nests deeper than a user's own state.
MANIFEST_MAX_BYTES = 256 << 20
HEADER_MAX_BYTES = 100 << 20
MAX_DEPTH = 64
_MAX_INT = 1 << 62           # sizes, steps and counts above this are forgeries, not checkpoints

_FILE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors")
_HEX_RE = re.compile(r"[0-9a-f]+")
_REQUIRED = ("format", "step", "samples_consumed", "world_size", "global_batch", "model_fingerprint", "files")
# Optimizer hyper-parameters every torch optimizer that has them keeps as plain non-negative numbers.
_NON_NEGATIVE_HYPER = ("lr", "weight_decay", "momentum", "dampening")
_MT_WORDS = 624


def parse_json(data: bytes, where: str) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity (nor numbers that overflow to it), nesting at most MAX_DEPTH."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise CheckpointError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{where}: not valid JSON ({_short(exc)})") from None
    _check_depth(value, where)
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a checkpoint may hold")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows to infinity")
    return value


def _check_depth(value: Any, where: str) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise CheckpointError(f"{where}: nested deeper than {MAX_DEPTH} levels")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))


def check_file_name(name: Any) -> None:
    """Manifest file names are bare names: no separators, no '..', nothing hidden."""
    if not isinstance(name, str) or not _FILE_NAME_RE.fullmatch(name) or ".." in name:
        raise CheckpointError(f"refusing checkpoint file name {_clip(name)}: only plain *.safetensors names "
                              f"inside the step directory are allowed")


def validate_file_record(rec: Any, where: str) -> None:
    """One entry of `files`: name, size, at least one known checksum of the right length, optional rank."""
    if not isinstance(rec, dict) or "name" not in rec or "size" not in rec:
        raise CheckpointError(f"{where}: malformed file entry {_clip(rec)} (needs name, size and one of "
                              f"{', '.join(CHECKSUMS)})")
    check_file_name(rec["name"])
    sums = [k for k in CHECKSUMS if k in rec]
    if not sums:
        raise CheckpointError(f"{where}: file {rec['name']} has none of the checksums {', '.join(CHECKSUMS)}")
    for algo in sums:
        digest = rec[algo]
        if not isinstance(digest, str) or len(digest) != _DIGEST_HEX[algo] or not _HEX_RE.fullmatch(digest):
            raise CheckpointError(f"{where}: file {rec['name']}: {algo} is not a {_DIGEST_HEX[algo]}-digit hex digest")
    _int_field(rec, "size", where, low=0)
    if "rank" in rec:
        _int_field(rec, "rank", where, low=0)


def validate_manifest(manifest: Any, where: str) -> None:
    """Everything restore reads from a manifest has the type and range it needs; CheckpointError otherwise."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: manifest is not a JSON object")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise CheckpointError(f"{where}: not a slurm-elastic manifest (missing {', '.join(missing)})")
    if manifest["format"] != FORMAT:
        raise CheckpointError(f"{where}: unknown format {_clip(manifest['format'])} (this version reads {FORMAT})")
    _int_field(manifest, "step", where, low=0, high=10**18 - 1)
    _int_field(manifest, "samples_consumed", where, low=0)
    _int_field(manifest, "world_size", where, low=1)
    _int_field(manifest, "global_batch", where, low=1)
    for key in ("micro_batch", "accumulation"):
        if key in manifest:
            _int_field(manifest, key, where, low=1)
    if "sharded" in manifest and not isinstance(manifest["sharded"], bool):
        raise CheckpointError(f"{where}: sharded must be true or false")
    fp = manifest["model_fingerprint"]
    if not isinstance(fp, str) or not 1 <= len(fp) <= 256:
        raise CheckpointError(f"{where}: model_fingerprint must be a string")
    files = manifest["files"]
    if not isinstance(files, list) or not files:
        raise CheckpointError(f"{where}: manifest lists no files")
    seen = set()
    for rec in files:
        validate_file_record(rec, where)
        if rec["name"] in seen:
            raise CheckpointError(f"{where}: file {rec['name']!r} listed twice")
        seen.add(rec["name"])
    _optional(manifest, "layer_groups", list, where)
    _check_rng(manifest.get("rng"), where)
    _check_optimizer(manifest.get("optimizer"), where)
    _check_scheduler(manifest.get("scheduler"), where)
    _optional(manifest, "sampler", dict, where)
    _optional(manifest, "user_state", dict, where)
    job = _optional(manifest, "job", dict, where)
    if job:
        for key in ("id", "key"):
            if key in job and not isinstance(job[key], str):
                raise CheckpointError(f"{where}: job.{key} must be a string")
        if "restart_count" in job:
            _int_field(job, "restart_count", f"{where}: job", low=0)
    if "created" in manifest and not _is_number(manifest["created"]):
        raise CheckpointError(f"{where}: created must be a number")


def _check_rng(rng: Any, where: str) -> None:
    """Per-rank RNG states in the shape rng.restore_rng sets them (torch, Python and NumPy Mersenne twisters)."""
    if rng is None:
        return
    if not isinstance(rng, list):
        raise CheckpointError(f"{where}: rng must be a list of per-rank states")
    for i, state in enumerate(rng):
        w = f"{where}: rng[{i}]"
        if not isinstance(state, dict) or not {"torch", "python", "numpy"} <= state.keys():
            raise CheckpointError(f"{w} must hold torch, python and numpy states")
        if len(_b64(state["torch"], w + ".torch")) != _torch_rng_bytes():
            raise CheckpointError(f"{w}.torch is not a CPU generator state ({_torch_rng_bytes()} bytes)")
        py = state["python"]
        if not (isinstance(py, list) and len(py) == 3 and py[0] == 3 and not isinstance(py[0], bool)
                and _words(py[1], _MT_WORDS + 1) and 0 <= py[1][-1] <= _MT_WORDS
                and (py[2] is None or _is_number(py[2]))):
            raise CheckpointError(f"{w}.python is not a Python random state")
        np_state = state["numpy"]
        if not (isinstance(np_state, list) and len(np_state) == 5 and np_state[0] == "MT19937"
                and _words(np_state[1], _MT_WORDS) and _is_int(np_state[2]) and 0 <= np_state[2] <= _MT_WORDS
                and np_state[3] in (0, 1) and _is_int(np_state[3]) and _is_number(np_state[4])):
            raise CheckpointError(f"{w}.numpy is not a NumPy MT19937 state")
        if "cuda" in state:
            cuda = state["cuda"]
            if not isinstance(cuda, list) or not all(0 < len(_b64(s, w + ".cuda")) <= 1024 for s in cuda):
                raise CheckpointError(f"{w}.cuda must be a list of CUDA generator states")


def _check_optimizer(opt: Any, where: str) -> None:
    if opt is None:
        return
    if not isinstance(opt, dict):
        raise CheckpointError(f"{where}: optimizer must be an object")
    if "class" in opt and not isinstance(opt["class"], str):
        raise CheckpointError(f"{where}: optimizer.class must be a string")
    groups = opt.get("param_groups")
    if groups is None:
        return
    if not isinstance(groups, list):
        raise CheckpointError(f"{where}: optimizer.param_groups must be a list")
    for i, group in enumerate(groups):
        w = f"{where}: optimizer.param_groups[{i}]"
        if not isinstance(group, dict):
            raise CheckpointError(f"{w} must be an object")
        params = group.get("params", [])
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise CheckpointError(f"{w}.params must be a list of parameter names")
        for key, value in group.items():
            if key == "params":
                continue
            # What optimizer_groups_json writes: JSON scalars, or flat lists of them (betas).
            if not (_is_scalar(value) or (isinstance(value, list) and all(_is_scalar(v) for v in value))):
                raise CheckpointError(f"{w}.{key} must be a number, string, boolean, null or a list of them")
        for key in _NON_NEGATIVE_HYPER:
            if key in group and not (_is_number(group[key]) and group[key] >= 0):
                raise CheckpointError(f"{w}.{key} must be a non-negative number, got {_clip(group[key])}")
        if "betas" in group and not (isinstance(group["betas"], list) and
                                     all(_is_number(b) and 0 <= b <= 1 for b in group["betas"])):
            raise CheckpointError(f"{w}.betas must be numbers in [0, 1]")


def _check_scheduler(state: Any, where: str) -> None:
    """torch LR schedulers' own fields; any other field is the scheduler's business."""
    if state is None:
        return
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: scheduler must be an object or null")
    for key in ("base_lrs", "_last_lr"):
        if key in state and not (isinstance(state[key], list) and all(_is_number(v) for v in state[key])):
            raise CheckpointError(f"{where}: scheduler.{key} must be a list of numbers")
    if "last_epoch" in state:
        _int_field(state, "last_epoch", f"{where}: scheduler", low=-1)
    if "_step_count" in state:
        _int_field(state, "_step_count", f"{where}: scheduler", low=0)


def check_safetensors_layout(data: bytes | memoryview, where: str) -> None:
    """The header is a JSON object of known dtypes whose shapes match their offsets, and the offsets
    tile the data exactly: catches foreign or forged bytes before the safetensors parser sees them."""
    if len(data) < 8:
        raise CheckpointError(f"{where}: not a safetensors file (too short)")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8 or n > HEADER_MAX_BYTES:
        raise CheckpointError(f"{where}: not a safetensors file (bad header length)")
    header = parse_json(bytes(data[8:8 + n]), f"{where}: safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: not a safetensors file (header is not an object)")
    body = len(data) - 8 - n
    extents = []
    for key, entry in header.items():
        if key == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise CheckpointError(f"{where}: safetensors __metadata__ must map strings to strings")
            continue
        w = f"{where}: tensor {_clip(key)}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{w} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise CheckpointError(f"{w}: unknown dtype {_clip(dtype)}")
        if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d <= _MAX_INT for d in shape):
            raise CheckpointError(f"{w}: shape must be a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= body):
            raise CheckpointError(f"{w}: data_offsets must be two non-negative integers within the file")
        if math.prod(shape) * DTYPE_SIZES[dtype] != offsets[1] - offsets[0]:
            raise CheckpointError(f"{w}: shape {shape} of {dtype} does not fill data_offsets {offsets}")
        extents.append((offsets[0], offsets[1]))
    end = 0
    for begin, stop in sorted(extents):
        if begin != end:
            raise CheckpointError(f"{where}: safetensors tensors overlap or leave a gap at byte {end}")
        end = stop
    if end != body:
        raise CheckpointError(f"{where}: safetensors data extent does not match the file size")


# -- small checks ---------------------------------------------------------------------------------
@functools.cache
def _torch_rng_bytes() -> int:
    import torch

    return int(torch.get_rng_state().numel())


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, str)) or _is_number(v)


def _words(v: Any, n: int) -> bool:
    return isinstance(v, list) and len(v) == n and all(_is_int(x) and 0 <= x < 1 << 32 for x in v)


def _int_field(obj: dict, key: str, where: str, *, low: int, high: int = _MAX_INT) -> None:
    v = obj[key]
    if not _is_int(v) or not low <= v <= high:
        raise CheckpointError(f"{where}: {key} must be an integer in [{low}, {high}], got {_clip(v)}")


def _optional(obj: dict, key: str, kind: type, where: str) -> Any:
    v = obj.get(key)
    if v is not None and not isinstance(v, kind):
        raise CheckpointError(f"{where}: {key} must be {'an object' if kind is dict else 'a list'} or absent")
    return v


def _b64(v: Any, where: str) -> bytes:
    if not isinstance(v, str) or len(v) > 1 << 20:
        raise CheckpointError(f"{where} must be a base64 string")
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise CheckpointError(f"{where} is not valid base64") from None


def _clip(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _short(exc: BaseException) -> str:
    return _clip(str(exc)).strip("'\"")
