"""Taking in a file a job's user wrote: the one place such a file is read, as input and never as authority.

A file is opened without following a link at its name and without blocking
(a FIFO or a device is refused after fstat, never read), must be a regular
file of the expected owner and at most a bounded size; its JSON is parsed
with a bounded nesting depth and no NaN or infinity. Anything else is one
JobFileRefused line; the caller says it once and goes on without the record.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from typing import Callable, TypeVar

from slurm_elastic.errors import JobFileRefused

MAX_DEPTH = 16
"""The deepest nesting a record's JSON may have (the deepest record, a peer-lost report, has 3)."""

R = TypeVar("R")

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def open_user_file(path: str, *, owner_uid: int | None, dir_fd: int | None = None) -> int | None:
    """A read-only descriptor of the regular file at `path` (owned by `owner_uid` unless None).

    None when there is no file; JobFileRefused for a link, a FIFO, a device,
    a directory or another owner's file. The caller closes the descriptor.
    """
    try:
        fd = os.open(path, _FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise JobFileRefused("is a symbolic link") from None
        raise JobFileRefused(f"cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise JobFileRefused("is not a regular file")
        if owner_uid is not None and st.st_uid != owner_uid:
            raise JobFileRefused(f"is owned by uid {st.st_uid}, not the job's user (uid {owner_uid})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_user_file(path: str, *, owner_uid: int | None, max_bytes: int, what: str,
                   dir_fd: int | None = None) -> bytes | None:
    """All of a small file (`open_user_file`), at most `max_bytes`; None when there is none.

    `what` names the kind of file in the size problem ("a report", "a geometry").
    """
    fd = open_user_file(path, owner_uid=owner_uid, dir_fd=dir_fd)
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise JobFileRefused(f"is {size} bytes, more than the {max_bytes} {what} takes")
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:     # it grew between fstat and read
        raise JobFileRefused(f"is more than the {max_bytes} bytes {what} takes")
    return data


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a job may write")


def load_json(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> object:
    """The JSON value of `data`: nested at most `max_depth` deep, no NaN or infinity; JobFileRefused if not."""
    try:
        text = data.decode() if isinstance(data, bytes) else data
    except UnicodeDecodeError:
        raise JobFileRefused("is not JSON (not UTF-8)") from None
    if text.count("[") + text.count("{") > max_depth and _depth(text) > max_depth:
        raise JobFileRefused(f"is not JSON of at most {max_depth} levels")
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and an integer of more digits than Python converts
        raise JobFileRefused(f"is not JSON ({str(exc)[:120]})") from None


def _depth(text: str) -> int:
    """The deepest bracket nesting outside strings (linear in the text; no recursion)."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub('""', text)):
        if m[0] in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(depth - 1, 0)
    return deepest


def read_record(path: str, parse: Callable[[object], R], *, owner_uid: int | None, max_bytes: int,
                what: str) -> tuple[R | None, str]:
    """The record at `path` and a problem: (record, ""), (None, "") when there is no file, (None, why) when refused.

    `parse` takes the file's JSON value and returns the record, or raises
    JobFileRefused (ValueError) naming what is wrong with it.
    """
    try:
        data = read_user_file(path, owner_uid=owner_uid, max_bytes=max_bytes, what=what)
        if data is None:
            return None, ""
        return parse(load_json(data)), ""
    except JobFileRefused as exc:
        return None, str(exc)
    except (ValueError, TypeError, KeyError) as exc:
        return None, f"is malformed ({type(exc).__name__}: {str(exc)[:200]})"


# -- field checks: a job's values, typed and in range --------------------------------------------------
def field_int(body: dict, name: str, lo: int, hi: int, *, optional: bool = False) -> int | None:
    """An integer field in [lo, hi] (a bool is not an integer); None only when optional and absent or null."""
    v = body.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise JobFileRefused(f"has no valid {name} (an integer {lo}-{hi})")
    return v


def field_float(body: dict, name: str, lo: float, hi: float, *, optional: bool = False) -> float | None:
    """A finite number in [lo, hi] (NaN, infinity, a string or a bool are refused)."""
    v = body.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (lo <= v <= hi):
        raise JobFileRefused(f"has no valid {name} (a number {lo:g}-{hi:g})")
    return float(v)


def field_object(value: object) -> dict:
    if not isinstance(value, dict):
        raise JobFileRefused("is not a JSON object")
    return value
