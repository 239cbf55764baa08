"""Snapshot cost at scale: parse time of one 2,000-job / 512-node snapshot per Slurm JSON format, and Slurm calls.

The documents are the real captures in ../shared/slurm-json scaled up: each job record and
node record is copied with a new id/name (and running jobs spread over the new nodes), so
every key and value shape is what that Slurm version writes.

Two measurements per format:
- parse_s: json.loads of both documents plus the translation into ClusterState;
- snapshot_s / calls: CliBackend.snapshot() end to end, with stand-in `squeue`, `sinfo` and
  `scontrol` executables on PATH that print the scaled documents (a real 512-node cluster
  is not available here) and count how often they are run.

    python3 benchmarks/snapshot.py            # table
    python3 benchmarks/snapshot.py --json     # one JSON object per format
    python3 benchmarks/snapshot.py --jobs 200 --nodes 64 --repeat 3
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import statistics
import tempfile
import time
from pathlib import Path

from slurm_elastic.cluster.cli_backend import CliBackend
from slurm_elastic.cluster.parse_json import cluster_state, loads
from slurm_elastic.spec import ElasticSpec

CAPTURES = Path(__file__).resolve().parents[2] / "shared" / "slurm-json"
FORMATS = {  # version folder -> the node document the CLI backend reads for that version
    "22.05": "sinfo.json",
    "24.11": "scontrol-show-nodes.json",
    "26.05": "scontrol-show-nodes.json",
}


def _set_number(rec: dict, key: str, value: int) -> None:
    if isinstance(rec.get(key), dict):
        rec[key] = {"set": True, "infinite": False, "number": value}
    else:
        rec[key] = value


def scale(version: str, n_jobs: int, n_nodes: int) -> tuple[dict, dict]:
    """Scaled (squeue, nodes) documents of one version."""
    jobs_doc = json.loads((CAPTURES / version / "squeue.json").read_text())
    nodes_doc = json.loads((CAPTURES / version / FORMATS[version]).read_text())
    node_templates = nodes_doc["nodes"]
    nodes = []
    for i in range(n_nodes):
        rec = copy.deepcopy(node_templates[i % len(node_templates)])
        rec["name"] = f"gpu{i + 1:04d}"
        nodes.append(rec)
    nodes_doc["nodes"] = nodes
    templates = jobs_doc["jobs"]
    spec = ElasticSpec(1, 16, cpus_per_gpu=4, mem_per_gpu_mb=16000).to_comment()
    jobs = []
    for i in range(n_jobs):
        rec = copy.deepcopy(templates[i % len(templates)])
        rec["job_id"] = 1000 + i
        rec["name"] = f"job{i}"
        if i % 2 == 0:
            rec["comment"] = spec  # half the jobs are elastic: their comments are parsed too
        if rec["nodes"]:
            rec["nodes"] = f"gpu{(i % n_nodes) + 1:04d}"
        jobs.append(rec)
    jobs_doc["jobs"] = jobs
    return jobs_doc, nodes_doc


def time_parse(jobs_text: str, nodes_text: str, repeat: int) -> tuple[float, float]:
    """Median wall and CPU seconds; CPU time is what the parse costs on a machine shared with other work."""
    walls, cpus = [], []
    for _ in range(repeat):
        start, cpu = time.perf_counter(), time.process_time()
        state = cluster_state(loads(jobs_text), loads(nodes_text), taken_at=time.time())
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
        assert state.jobs and state.nodes
    return statistics.median(walls), statistics.median(cpus)


def stand_in_commands(directory: Path, version: str, jobs_file: Path, nodes_file: Path, counter: Path) -> None:
    """Executables named like Slurm's that print the scaled documents (stand-ins for a large cluster)."""
    for name in ("squeue", "sinfo", "scontrol"):
        path = directory / name
        path.write_text(
            "#!/bin/sh\n"
            "# stand-in for Slurm's command at scale (benchmarks/snapshot.py)\n"
            f"echo {name} \"$@\" >> {shlex.quote(str(counter))}\n"
            f"case \"{name} $*\" in\n"
            f"  'squeue '*) exec cat {shlex.quote(str(jobs_file))} ;;\n"
            f"  'sinfo '*|'scontrol show nodes'*) exec cat {shlex.quote(str(nodes_file))} ;;\n"
            f"  'scontrol --version') echo 'slurm {version}.0' ;;\n"
            "  *) echo \"unexpected: $*\" >&2; exit 1 ;;\n"
            "esac\n")
        path.chmod(0o755)


def time_snapshot(version: str, jobs_text: str, nodes_text: str, repeat: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="snapshot-bench-") as tmp:
        d = Path(tmp)
        (d / "jobs.json").write_text(jobs_text)
        (d / "nodes.json").write_text(nodes_text)
        counter = d / "calls.log"
        stand_in_commands(d, version, d / "jobs.json", d / "nodes.json", counter)
        env = {**os.environ, "PATH": f"{d}:{os.environ.get('PATH', '')}"}
        backend = CliBackend(env=env)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            backend.snapshot()
            times.append(time.perf_counter() - start)
        lines = counter.read_text().splitlines()
        return statistics.median(times), len(lines) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--nodes", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print a JSON list, one object per format")
    args = ap.parse_args()
    if not CAPTURES.is_dir():
        raise SystemExit(f"real Slurm captures not found at {CAPTURES}")
    rows = []
    for version, nodes_name in FORMATS.items():
        jobs_doc, nodes_doc = scale(version, args.jobs, args.nodes)
        jobs_text, nodes_text = json.dumps(jobs_doc), json.dumps(nodes_doc)
        parse_s, parse_cpu_s = time_parse(jobs_text, nodes_text, args.repeat)
        snap_s, calls = time_snapshot(version, jobs_text, nodes_text, args.repeat)
        rows.append({"slurm": version, "node_document": nodes_name, "jobs": args.jobs, "nodes": args.nodes,
                     "json_mb": round((len(jobs_text) + len(nodes_text)) / 1e6, 1), "parse_s": round(parse_s, 3),
                     "parse_cpu_s": round(parse_cpu_s, 3),
                     "snapshot_s": round(snap_s, 3), "slurm_calls_per_snapshot": calls,
                     "target_parse_s": 0.5, "target_calls": 2})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'slurm':>6} {'node document':<26} {'jobs':>5} {'nodes':>5} {'JSON MB':>8} {'parse s':>8} "
          f"{'parse cpu s':>11} {'snapshot s':>10} {'calls':>5}")
    for r in rows:
        print(f"{r['slurm']:>6} {r['node_document']:<26} {r['jobs']:>5} {r['nodes']:>5} {r['json_mb']:>8} "
              f"{r['parse_s']:>8.3f} {r['parse_cpu_s']:>11.3f} {r['snapshot_s']:>10.3f} {r['slurm_calls_per_snapshot']:>5g}")
    print(f"targets: parse < 0.5 s, 2 Slurm calls per snapshot (load average now {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs: wall times include waiting for a CPU)")


if __name__ == "__main__":
    main()
