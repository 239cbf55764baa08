"""Per-file test durations from a pytest JUnit XML, slowest first (what the README's test command spends).

Usage: python .ci/durations.py JUNIT.xml [COUNT]
Under pytest-xdist the files run side by side, so the sum is above the wall time.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def main(path: str, count: str = "25") -> int:
    per_file: dict[str, float] = defaultdict(float)
    tests: dict[str, int] = defaultdict(int)
    for case in ET.parse(path).getroot().iter("testcase"):
        name = (case.get("classname") or "").replace(".", "/") + ".py"
        per_file[name] += float(case.get("time") or 0.0)
        tests[name] += 1
    total = sum(per_file.values())
    print(f"== test time per file (sum {total:.0f} s over {sum(tests.values())} tests; slowest {count}):")
    for name, seconds in sorted(per_file.items(), key=lambda item: -item[1])[:int(count)]:
        print(f"{seconds:9.1f} s  {tests[name]:4d} tests  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
