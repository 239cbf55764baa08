"""sbatch's option grammar: every spelling sbatch accepts (prefixes, bundles, directives) resolved to one option.

sbatch parses its command line and its `#SBATCH` lines with glibc's
getopt_long: a long option may be abbreviated to any unambiguous prefix
(`--arr` is `--array`), short options bundle (`-Ha 0-2` is `--hold --array
0-2`), a required value is `--opt=v`, `--opt v`, `-ov` or `-o v` (the next
word is taken whatever it looks like, `-J -a` names the job "-a"), an
optional one only `--opt=v` or `-kv`. Refusing an option by its spelling
therefore misses the others; `parse` turns every spelling into the canonical
long name, and callers decide on that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from slurm_elastic.errors import SpecError


class Arg(Enum):
    NONE = "none"
    REQUIRED = "required"
    OPTIONAL = "optional"


_N, _R, _O = Arg.NONE, Arg.REQUIRED, Arg.OPTIONAL

# Long options of sbatch 22.05.8, read from the binary itself: `sbatch --a` ... `sbatch --z`
# list every option of a letter ("ambiguous; possibilities: ..."), and `sbatch --name` /
# `sbatch --name=x` say whether it takes a value (hidden options such as --ntasks-per-tres
# and --tasks-per-node included).
SBATCH_22_05: dict[str, Arg] = {
    "account": _R, "acctg-freq": _R, "array": _R, "batch": _R, "bb": _R, "bbf": _R, "begin": _R,
    "chdir": _R, "cluster": _R, "cluster-constraint": _R, "clusters": _R, "comment": _R, "constraint": _R,
    "container": _R, "context": _R, "contiguous": _N, "core-spec": _R, "cores-per-socket": _R,
    "cpu-freq": _R, "cpus-per-gpu": _R, "cpus-per-task": _R, "deadline": _R, "delay-boot": _R,
    "dependency": _R, "distribution": _R, "error": _R, "exclude": _R, "exclusive": _O, "export": _R,
    "export-file": _R, "extra-node-info": _R, "get-user-env": _O, "gid": _R, "gpu-bind": _R,
    "gpu-freq": _R, "gpus": _R, "gpus-per-node": _R, "gpus-per-socket": _R, "gpus-per-task": _R,
    "gres": _R, "gres-flags": _R, "help": _N, "hint": _R, "hold": _N, "ignore-pbs": _N, "input": _R,
    "job-name": _R, "kill-on-invalid-dep": _R, "licenses": _R, "mail-type": _R, "mail-user": _R,
    "mcs-label": _R, "mem": _R, "mem-bind": _R, "mem-per-cpu": _R, "mem-per-gpu": _R, "mincpus": _R,
    "network": _R, "nice": _O, "no-kill": _O, "no-requeue": _N, "nodefile": _R, "nodelist": _R,
    "nodes": _R, "ntasks": _R, "ntasks-per-core": _R, "ntasks-per-gpu": _R, "ntasks-per-node": _R,
    "ntasks-per-socket": _R, "ntasks-per-tres": _R, "open-mode": _R, "output": _R, "overcommit": _N,
    "oversubscribe": _N, "parsable": _N, "partition": _R, "power": _R, "prefer": _R, "priority": _R,
    "profile": _R, "propagate": _O, "qos": _R, "quiet": _N, "reboot": _N, "requeue": _N,
    "reservation": _R, "signal": _R, "sockets-per-node": _R, "spread-job": _N, "switches": _R,
    "tasks-per-node": _R, "test-only": _N, "thread-spec": _R, "threads-per-core": _R, "time": _R,
    "time-min": _R, "tmp": _R, "uid": _R, "usage": _N, "use-min-nodes": _N, "verbose": _N,
    "version": _N, "wait": _N, "wait-all-nodes": _R, "wckey": _R, "wrap": _R,
}

# Options later releases added (23.02 .. 26.05), so that a prefix is resolved against
# everything some supported sbatch knows: a prefix unique here is unique on every version,
# and one that names a new option on a newer Slurm is not taken for an old one. The first
# line is from the man pages; the rest was read from the 24.11.5 and 26.05.5 binaries like
# 22.05's (hidden ones included: `--autocomplete`, `--resv-ports`). `--requeue` takes
# `=expedite` from 25.11 on.
SBATCH_LATER: dict[str, Arg] = {
    "container-id": _R, "extra": _R, "oom-kill-step": _O, "tres-per-task": _R, "segment": _R,
    "tres-bind": _R, "requeue": _O,
    "autocomplete": _R, "resv-ports": _O, "stepmgr": _N,                                   # 24.11
    "consolidate-segments": _N, "container-type": _R, "external": _N, "mem-update": _R,  # 26.05
    "resources": _R, "spread-segments": _N,
}

SBATCH_LONG: dict[str, Arg] = {**SBATCH_22_05, **SBATCH_LATER}

# Short options (the same set from 22.05 to 26.05), probed like the long ones: `-X` alone
# says "requires an argument" or "invalid option"; `-kz` shows -k's value is optional.
SBATCH_SHORT: dict[str, str] = {
    "a": "array", "A": "account", "b": "begin", "B": "extra-node-info", "c": "cpus-per-task",
    "C": "constraint", "d": "dependency", "D": "chdir", "e": "error", "F": "nodefile", "G": "gpus",
    "h": "help", "H": "hold", "i": "input", "J": "job-name", "k": "no-kill", "L": "licenses",
    "m": "distribution", "M": "clusters", "n": "ntasks", "N": "nodes", "o": "output", "O": "overcommit",
    "p": "partition", "q": "qos", "Q": "quiet", "s": "oversubscribe", "S": "core-spec", "t": "time",
    "v": "verbose", "V": "version", "w": "nodelist", "W": "wait", "x": "exclude",
}

# Spellings that are one option under two names (glibc does not call a prefix shared only
# by them ambiguous).
ALIASES: dict[str, str] = {"cluster": "clusters", "tasks-per-node": "ntasks-per-node"}


@dataclass(frozen=True, slots=True)
class Grammar:
    """The long and short options of one command (sbatch, or sbatch plus slurm-elastic's own)."""

    long: dict[str, Arg]
    short: dict[str, str]
    aliases: dict[str, str]
    hidden: tuple[tuple[str, Arg], ...] = ()   # names only a short letter reaches (no long spelling)
    # Options whose separate value may not look like an option (ours: `--gpus --weight 2` is a
    # missing value, not a GPU range "--weight"); sbatch's own take any next word, as getopt does.
    strict_values: frozenset[str] = frozenset()

    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)

    def resolve_long(self, typed: str) -> str:
        """The long option `--typed` means: an exact name, else its only prefix match (a SpecError otherwise)."""
        if typed in self.long:
            return self.canonical(typed)
        matches = sorted(name for name in self.long if name.startswith(typed))
        meanings = {self.canonical(name) for name in matches}
        if not typed or not matches:
            raise SpecError(f"unknown option --{typed}")
        if len(meanings) > 1:
            shown = ", ".join(f"--{m}" for m in matches[:8]) + (", ..." if len(matches) > 8 else "")
            raise SpecError(f"option --{typed} is ambiguous ({shown}); write the option out in full")
        return meanings.pop()

    def arg(self, canonical: str) -> Arg:
        return self.long[canonical] if canonical in self.long else dict(self.hidden)[canonical]


SBATCH = Grammar(long=SBATCH_LONG, short=SBATCH_SHORT, aliases=ALIASES)


@dataclass(frozen=True, slots=True)
class Option:
    """One option as sbatch will understand it: canonical long name, its value, and how it was written."""

    name: str
    value: str | None
    spelling: str                  # the words as written, value included
    typed: str = ""                # the option part as written: "--arr", "-a"
    at: int = 0                    # index of the word it starts in

    def as_argument(self) -> str:
        """The unambiguous spelling, for passing on to sbatch."""
        return f"--{self.name}" if self.value is None else f"--{self.name}={self.value}"


@dataclass(frozen=True, slots=True)
class Parsed:
    options: tuple[Option, ...]
    rest: tuple[str, ...]          # the first non-option word and everything after it
    operands: tuple[int, ...] = ()  # with stop_at_operand False: indices of the words read as operands


def parse(words: list[str] | tuple[str, ...], grammar: Grammar = SBATCH, *, stop_at_operand: bool = True) -> Parsed:
    """Read options the way getopt_long does; stop at `--` or (stop_at_operand) at the first operand.

    With stop_at_operand False operands are skipped and reading goes on: used for
    directives, where sbatch refuses operands anyway and seeing more is safe.
    """
    words = list(words)
    options: list[Option] = []
    rest: list[str] = []
    operands: list[int] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            rest = words[i + 1:] if stop_at_operand else []
            break
        if not word.startswith("-") or word == "-":
            if stop_at_operand:
                rest = words[i:]
                break
            operands.append(i)
            i += 1
            continue
        start = i
        if word.startswith("--"):
            typed, eq, inline = word[2:].partition("=")
            name = grammar.resolve_long(typed)
            kind = grammar.arg(name)
            if eq and kind is Arg.NONE:
                raise SpecError(f"option --{name} takes no value (got {word!r})")
            if eq or kind is Arg.OPTIONAL:
                options.append(Option(name, inline if eq else None, word, f"--{typed}", start))
                i += 1
            elif kind is Arg.REQUIRED:
                if i + 1 >= len(words) or (name in grammar.strict_values and _looks_like_option(words[i + 1])):
                    raise SpecError(f"--{name} needs a value")
                options.append(Option(name, words[i + 1], f"{word} {words[i + 1]}", word, start))
                i += 2
            else:
                options.append(Option(name, None, word, word, start))
                i += 1
            continue
        # A bundle of short options: flags run on until one that takes a value.
        j = 1
        i += 1
        while j < len(word):
            letter = word[j]
            if letter not in grammar.short:
                raise SpecError(f"unknown option -{letter}" + (f" (in {word!r})" if len(word) > 2 else ""))
            name = grammar.short[letter]
            kind = grammar.arg(name)
            tail = word[j + 1:]
            if kind is Arg.NONE:
                options.append(Option(name, None, f"-{letter}", f"-{letter}", start))
                j += 1
                continue
            if tail:
                options.append(Option(name, tail, f"-{letter}{tail}", f"-{letter}", start))
            elif kind is Arg.OPTIONAL:
                options.append(Option(name, None, f"-{letter}", f"-{letter}", start))
            else:
                if i >= len(words):
                    raise SpecError(f"option -{letter} (--{name}) needs a value")
                options.append(Option(name, words[i], f"-{letter} {words[i]}", f"-{letter}", start))
                i += 1
            break
    return Parsed(tuple(options), tuple(rest), tuple(operands))


def _looks_like_option(word: str) -> bool:
    return word.startswith("-") and not re.fullmatch(r"-[0-9.]+", word)


# -- batch script directives -----------------------------------------------------------------------------
# sbatch 22.05 reads `#SBATCH` and, with a warning, `#SLURM` lines (case as written, at the
# start of the line; an indented one is a comment), up to the first line that is not blank
# and not a comment. `#PBS`/`#BSUB` lines are translated too unless --ignore-pbs is given.
DIRECTIVE_PREFIXES = ("#SBATCH", "#SLURM")
FOREIGN_PREFIXES = ("#PBS", "#BSUB")


@dataclass(frozen=True, slots=True)
class DirectiveWord:
    word: str
    lineno: int


def directive_words(script_text: str, prefixes: tuple[str, ...] = DIRECTIVE_PREFIXES) -> list[DirectiveWord]:
    """The words of every directive line sbatch reads, split the way sbatch splits them."""
    found: list[DirectiveWord] = []
    for lineno, line in enumerate(script_text.splitlines(), start=1):
        prefix = next((p for p in prefixes if line.startswith(p)), None)
        if prefix is None:
            stripped = line.lstrip()
            if stripped and not stripped.startswith("#"):
                break  # the first command: sbatch reads no directive after it
            continue
        found.extend(DirectiveWord(word, lineno) for word in _split_directive(line[len(prefix):], lineno))
    return found


def foreign_directive_lines(script_text: str) -> list[int]:
    """Line numbers of the #PBS/#BSUB directives sbatch would translate (without --ignore-pbs)."""
    lines = []
    for lineno, line in enumerate(script_text.splitlines(), start=1):
        stripped = line.lstrip()
        if stripped and not stripped.startswith("#"):
            break
        if line.startswith(FOREIGN_PREFIXES):
            lines.append(lineno)
    return lines


def _split_directive(body: str, lineno: int) -> list[str]:
    """sbatch's word splitting of a directive: blanks separate, quotes and backslashes protect,
    an unprotected '#' ends the line (`--job-name=x#y --time=3` is only `--job-name=x`)."""
    words: list[str] = []
    current: list[str] = []
    in_word = False
    quote = ""
    escape = False
    for ch in body:
        if escape:
            current.append(ch)
            escape = False
            in_word = True
        elif quote:
            if ch == quote:
                quote = ""
            else:
                current.append(ch)
        elif ch == "\\":
            escape = True
            in_word = True
        elif ch in "\"'":
            quote = ch
            in_word = True
        elif ch == "#":
            break
        elif ch.isspace():
            if in_word:
                words.append("".join(current))
                current, in_word = [], False
        else:
            current.append(ch)
            in_word = True
    if quote:
        raise SpecError(f"line {lineno}: unmatched {quote} in a directive")
    if in_word:
        words.append("".join(current))
    return words
