"""Time the local cluster: `up` until nodes IDLE, node-down until DOWN in Slurm, node-up, spare start, `down`.

Runs its own cluster in a private state directory on free ports, so a cluster
that is already up (tests, demo) is not touched. Needs root and Slurm.

    python3 benchmarks/devcluster_timings.py            # table
    python3 benchmarks/devcluster_timings.py --json     # one JSON object per measured case
    python3 benchmarks/devcluster_timings.py --repeat 3 --skip-failure
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from slurm_elastic.devcluster import LocalCluster, node_state_serving, processes
from table import print_rows  # benchmarks/table.py: how every benchmark prints


def wait_state(local: LocalCluster, node: str, predicate, timeout: float = 120.0) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        state = local.node_states().get(node, {}).get("State", "")
        if predicate(state):
            return time.monotonic() - start
        time.sleep(0.05)
    raise SystemExit(f"{node} did not reach the expected state within {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1, help="up/down cycles to time")
    parser.add_argument("--skip-failure", action="store_true", help="skip the ~30 s node-failure measurement")
    args = parser.parse_args()

    rows: list[dict[str, object]] = []
    state_dir = Path(tempfile.mkdtemp(prefix="se-bench-", dir="/tmp"))
    local = LocalCluster(state_dir)
    base = processes.free_port_base(args.nodes + 8, start=18817)
    try:
        for cycle in range(args.repeat):
            start = time.monotonic()
            local.up(nodes=args.nodes, spares=1, port_base=base)
            rows.append({"case": "up_until_idle", "nodes": args.nodes, "cycle": cycle, "wall_s": round(time.monotonic() - start, 3)})
            if cycle == args.repeat - 1:
                spare = local.layout.spare_names[0]
                start = time.monotonic()
                local.node_up(spare)
                rows.append({"case": "spare_start_until_idle", "nodes": 1, "cycle": cycle, "wall_s": round(time.monotonic() - start, 3)})
                if not args.skip_failure:
                    victim = local.layout.node_names[1]
                    local.node_down(victim)
                    killed = time.monotonic()
                    wait_state(local, victim, lambda s: "NOT_RESPONDING" in s)
                    rows.append({"case": "kill_until_not_responding", "nodes": 1, "cycle": cycle, "wall_s": round(time.monotonic() - killed, 3)})
                    wait_state(local, victim, lambda s: s.startswith("DOWN"))
                    rows.append({"case": "kill_until_down", "nodes": 1, "cycle": cycle, "wall_s": round(time.monotonic() - killed, 3)})
                    start = time.monotonic()
                    local.node_up(victim, wait=False)
                    wait_state(local, victim, node_state_serving)
                    rows.append({"case": "node_up_until_idle", "nodes": 1, "cycle": cycle, "wall_s": round(time.monotonic() - start, 3)})
            start = time.monotonic()
            local.down()
            rows.append({"case": "down", "nodes": args.nodes, "cycle": cycle, "wall_s": round(time.monotonic() - start, 3)})
    finally:
        if local.exists() and local.leftover_processes():
            local.down()
        shutil.rmtree(state_dir, ignore_errors=True)

    print_rows(rows, args.json, columns=("case", "nodes", "cycle", "wall_s"))


if __name__ == "__main__":
    main()
