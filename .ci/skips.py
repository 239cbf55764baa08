"""CI's check on a pytest run's JUnit XML: every skip must name an allowed reason; print a summary line.

Usage: python .ci/skips.py JUNIT.xml LABEL
A skip hides a test that never ran; on the CI machine only reasons that
cannot be fixed by an install step are allowed.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET

ALLOWED = {
    # pyslurm on PyPI builds only against Slurm 25.11, which no Debian suite ships.
    "pyslurm": re.compile(r"pyslurm", re.IGNORECASE),
    # --long variants are the reliability run's full sizes (benchmarks, not CI).
    "long": re.compile(r"^long variant: run with --long$"),
}


def main(path: str, label: str) -> int:
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    bad: list[str] = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif skipped is not None:
            message = skipped.get("message", "")
            if skipped.get("type") == "pytest.xfail":
                counts["xfailed"] += 1
                continue
            counts["skipped"] += 1
            reason = message.removeprefix("Skipped: ")
            if not any(rule.search(reason) for rule in ALLOWED.values()):
                bad.append(f"{name}: {reason}")
        else:
            counts["passed"] += 1
    total = sum(counts.values())
    print(f"== {label}: {counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed"
          f" ({counts['xfailed']} xfailed, {total} collected)")
    if total == 0:
        print(f"== {label}: no test ran", file=sys.stderr)
        return 1
    for line in bad:
        print(f"== skip not on the allow-list: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
