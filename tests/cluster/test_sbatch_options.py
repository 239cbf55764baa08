"""sbatch's option grammar: the tables against the installed sbatch, and getopt_long's rules."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_elastic.cluster.sbatch_options import (SBATCH, SBATCH_22_05, SBATCH_LONG, SBATCH_SHORT, Arg,
                                                  directive_words, foreign_directive_lines, parse)
from slurm_elastic.errors import SpecError


def _names(parsed) -> list[tuple[str, str | None]]:
    return [(o.name, o.value) for o in parsed.options]


@pytest.mark.parametrize("words,expected", [
    (["--arr=0-2"], [("array", "0-2")]),
    (["--arra", "0-2"], [("array", "0-2")]),
    (["-Ha", "0-2"], [("hold", None), ("array", "0-2")]),
    (["-a0-2"], [("array", "0-2")]),
    (["-HN2"], [("hold", None), ("nodes", "2")]),
    (["-J", "-a"], [("job-name", "-a")]),                     # a required value is the next word, whatever it is
    (["-vvQ"], [("verbose", None), ("verbose", None), ("quiet", None)]),
    (["-k", "-kcontinue"], [("no-kill", None), ("no-kill", "continue")]),   # -k's value is optional: glued only
    (["--nice", "5"], [("nice", None)]),                       # so is --nice's: "5" is the script
    (["--clusters=a", "--cluster=b"], [("clusters", "a"), ("clusters", "b")]),
    (["--tasks-per=2"], [("ntasks-per-node", "2")]),
])
def test_every_spelling_resolves_to_the_canonical_option(words: list[str], expected: list) -> None:
    assert _names(parse(words)) == expected


def test_parsing_stops_at_the_script_and_at_double_dash() -> None:
    parsed = parse(["-t", "5", "job.sh", "--array=1"])
    assert _names(parsed) == [("time", "5")] and parsed.rest == ("job.sh", "--array=1")
    assert parse(["--", "-a", "1"]).rest == ("-a", "1")


@pytest.mark.parametrize("words,message", [
    (["--nod=2"], "ambiguous"),
    (["--clu=x"], "ambiguous"),                                # cluster-constraint vs cluster(s)
    (["--frobnicate"], "unknown option --frobnicate"),
    (["-Z"], "unknown option -Z"),
    (["--hold=yes"], "takes no value"),
    (["--array"], "needs a value"),
    (["-Ha"], "needs a value"),
])
def test_what_sbatch_would_refuse_is_refused(words: list[str], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse(words)


def test_directives_are_read_like_sbatch_reads_them() -> None:
    text = ("#!/bin/bash\n"
            "#SBATCH -a\n"
            "  #SBATCH --indented-is-a-comment\n"
            "#SBATCH 0-2 --job-name='a b'#--array=9\n"
            "#SLURM --time=5\n"
            "# a comment\n"
            "\n"
            "echo first command\n"
            "#SBATCH --array=after-the-first-command\n")
    words = [w.word for w in directive_words(text)]
    assert words == ["-a", "0-2", "--job-name=a b", "--time=5"]
    assert _names(parse(words, stop_at_operand=False)) == [("array", "0-2"), ("job-name", "a b"), ("time", "5")]
    assert foreign_directive_lines("#!/bin/sh\n#PBS -t 0-2\n#BSUB -n 2\ntrue\n#PBS -l x\n") == [2, 3]
    with pytest.raises(SpecError, match="unmatched"):
        directive_words("#!/bin/sh\n#SBATCH --job-name='open\n")


def _probe_conf(tmp_path: Path) -> dict[str, str]:
    # A slurm.conf whose controller port has nothing behind it: a probe that got past option
    # parsing could not submit anything (and with an empty script on stdin none gets that far).
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=probe\nSlurmctldHost=localhost\nSlurmctldPort=9\nNodeName=p1 CPUs=1\n"
                    "PartitionName=p Nodes=p1\n")
    return {"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"}


def _sbatch(env: dict[str, str], *args: str) -> str:
    proc = subprocess.run(["sbatch", *args], env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    return (proc.stderr + proc.stdout).splitlines()[0] if (proc.stderr + proc.stdout).strip() else ""


# Marked slurm so that CI runs them on every version's sbatch, not only the machine's own.
@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed")
def test_the_long_option_table_is_the_installed_sbatchs(tmp_path: Path) -> None:
    """`sbatch --a` ... `--z` list every option of a letter; each one's value kind is what sbatch says."""
    env = _probe_conf(tmp_path)
    version = subprocess.run(["sbatch", "--version"], env=env, capture_output=True, text=True).stdout.split()[-1]
    installed: set[str] = set()
    for letter in "abcdefghijklmnopqrstuvwxyz":
        first = _sbatch(env, f"--{letter}")
        names = re.findall(r"'--([a-z][a-z-]*)'", first)
        installed.update(n for n in names if len(n) > 1)
    for name in sorted(installed):
        if "requires an argument" in _sbatch(env, f"--{name}"):
            kind = Arg.REQUIRED
        elif "allow an argument" in _sbatch(env, f"--{name}=x"):
            kind = Arg.NONE
        else:
            kind = Arg.OPTIONAL
        assert name in SBATCH_LONG, f"sbatch {version} has --{name}, the grammar does not"
        if version.startswith("22.05."):
            assert SBATCH_22_05[name] is kind, f"--{name}: sbatch {version} says {kind}"
    if version.startswith("22.05."):
        assert installed == set(SBATCH_22_05)


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed")
def test_the_short_option_table_is_the_installed_sbatchs(tmp_path: Path) -> None:
    env = _probe_conf(tmp_path)
    letters = {c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
               if "invalid option" not in _sbatch(env, f"-{c}")}
    assert letters == set(SBATCH_SHORT)
    for letter, name in SBATCH_SHORT.items():
        needs = "requires an argument" in _sbatch(env, f"-{letter}")
        assert needs == (SBATCH.arg(name) is Arg.REQUIRED), f"-{letter} (--{name})"
