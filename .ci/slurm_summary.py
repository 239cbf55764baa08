"""CI's verdict on one live-suite run, from its junit XML: one summary line and an exit status.

    python3 .ci/slurm_summary.py --label "Slurm 24.11.5 (trixie chroot)" --pytest-rc 0 --seconds 512 junit.xml
    == Slurm 24.11.5 (trixie chroot): 33 passed, 3 skipped, 0 failed in 512 s

Exit 1 (the line says why) when pytest failed or was stopped, when the run left no results, collected no
test or passed none, and when a test was skipped because the live cluster itself was missing (Slurm not
installed, not root): a CI that skips its live tests must not pass. Standard library only.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# Skip reasons of tests/conftest.py and tests/control/conftest.py meaning "there was no live Slurm".
NO_CLUSTER_SKIPS = ("Slurm is not installed", "Slurm client commands are not installed", "needs root")
PYTEST_RC = {1: "tests failed", 2: "interrupted", 3: "internal error", 4: "usage error",
             5: "collected no tests", 124: "timed out", 137: "killed", 143: "stopped"}


@dataclass(frozen=True, slots=True)
class Outcome:
    passed: int
    skipped: int
    failed: int
    skip_reasons: Counter[str]

    @property
    def total(self) -> int:
        return self.passed + self.skipped + self.failed


def read_junit(path: Path) -> Outcome:
    root = ET.parse(path).getroot()
    passed = skipped = failed = 0
    reasons: Counter[str] = Counter()
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            failed += 1  # a test whose teardown errs after it passed counts once, as failed
        elif "skipped" in kinds:
            skipped += 1
            node = case.find("skipped")
            reasons[(node.get("message") or "").strip()[:160] if node is not None else ""] += 1
        else:
            passed += 1
    return Outcome(passed, skipped, failed, reasons)


def verdict(outcome: Outcome | None, pytest_rc: str) -> str | None:
    """None when the run passed, else why not."""
    if pytest_rc not in ("0", ""):
        code = int(pytest_rc) if pytest_rc.isdigit() else None
        return f"pytest exit status {pytest_rc}" + (f" ({PYTEST_RC[code]})" if code in PYTEST_RC else "")
    if outcome is None:
        return "no test results"
    if outcome.total == 0:
        return "collected no tests"
    if outcome.failed:
        return f"{outcome.failed} failed"
    if outcome.passed == 0:
        return "no test passed"
    missing = [r for r in outcome.skip_reasons if any(s in r for s in NO_CLUSTER_SKIPS)]
    if missing:
        return f"skipped for want of a live cluster: {missing[0]}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--label", required=True, help='e.g. "Slurm 22.05.8 (host)"')
    parser.add_argument("--pytest-rc", default="", help="pytest's exit status ('none': it never ran)")
    parser.add_argument("--seconds", type=float, default=None, help="wall time (default: the junit's)")
    args = parser.parse_args(argv)

    outcome = None
    seconds = args.seconds
    if args.junit.is_file():
        try:
            outcome = read_junit(args.junit)
            if seconds is None:
                suite = ET.parse(args.junit).getroot().find(".//testsuite")
                seconds = float(suite.get("time", 0)) if suite is not None else 0.0
        except ET.ParseError as exc:
            print(f"{args.junit}: not junit XML ({exc})", file=sys.stderr)
    problem = "did not run" if args.pytest_rc == "none" else verdict(outcome, args.pytest_rc)
    if outcome is None:
        line = f"== {args.label}: no test results ({problem})"
    else:
        line = (f"== {args.label}: {outcome.passed} passed, {outcome.skipped} skipped, {outcome.failed} failed"
                f" in {seconds or 0:.0f} s")
        if problem:
            line += f"  -- FAILED: {problem}"
        for reason, count in sorted(outcome.skip_reasons.items()):
            print(f"   skipped {count}x: {reason}", file=sys.stderr)
    print(line, flush=True)
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
