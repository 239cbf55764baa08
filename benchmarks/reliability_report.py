"""docs/reliability.md from the last reliability run (build/reliability/last-run.json, written by tests/reliability).

    python3 -m pytest tests/reliability --long        # or without --long: the CI sizes
    python3 benchmarks/reliability_report.py          # writes docs/reliability.md
    python3 benchmarks/reliability_report.py --json   # one row per test, figures flattened
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = ROOT / "build" / "reliability" / "last-run.json"
DEFAULT_DOC = ROOT / "docs" / "reliability.md"

SECTIONS = [
    ("test_checkpoint_faults.py", "Checkpoint crash consistency"),
    ("test_controller_faults.py", "Controller faults"),
    ("test_load.py", "Load"),
    ("test_bad_input.py", "Bad input"),
    ("test_security.py", "Security"),
]

# Which safeguard each test would catch being removed (test function name -> safeguard).
GUARDS = {
    "test_sigkill_at_random_points_never_loses_a_committed_step":
        "manifest committed last (temp+fsync+rename) after the shards; retention un-commits a step "
        "(manifest first) before deleting it and runs only after the new manifest; temp files of killed "
        "writers collected; restore picks the newest verified step",
    "test_random_bit_flips_and_truncations_are_detected":
        "checksum (xxh3-128, or sha256) and size of every shard checked on restore, safetensors layout check, "
        "fallback to the previous step",
    "test_full_filesystem_during_writes_keeps_training_and_the_previous_step":
        "a failed shard/manifest write is logged and discarded, training continues, the previous step is kept",
    "test_two_jobs_with_the_same_name_and_root_never_mix":
        "the job key is the Slurm job id, not the job name",
    "test_external_sigkill_when_the_journal_shows_each_step":
        "journal intent before each step (SQLite WAL, synchronous=FULL) and recovery that finishes or rolls "
        "back every open plan",
    "test_slurmctld_stopped_and_restarted_under_the_daemon":
        "CLI backend retry with bounded backoff; the loop logs a failed cycle and goes on",
    "test_node_lost_while_a_plan_is_open":
        "protocol steps that tolerate a vanished/requeued job (hold re-observes, roll back releases)",
    "test_node_flapping_restarts_are_bounded":
        "hysteresis (min resize interval) and the per-job restart budget",
    "test_reconcile_loop_under_many_elastic_jobs":
        "two-call snapshot, one solve per cycle",
    "test_cli_bad_input_exits_2_with_one_line_and_does_nothing":
        "input validation before any Slurm call (spec, option split, #ELASTIC/#SBATCH checks, click types)",
    "test_the_installed_entry_point_refuses_like_the_library": "the same through the installed entry point",
    "test_malformed_comment_is_a_typed_error_and_the_job_is_never_touched":
        "strict canonical spec parsing; malformed elastic jobs are never planned",
    "test_malformed_manifest_is_refused_and_nothing_is_written":
        "manifest validation (types, names, duplicates) before any file is read",
    "test_no_subprocess_runs_through_a_shell_and_nothing_unpickles": "no shell, no pickle loaders in the package",
    "test_the_scan_catches_what_it_looks_for": "the scan itself",
    "test_a_pickle_bearing_checkpoint_is_refused_and_never_executed":
        "safetensors-only loading with layout check (no pickle) even when checksums are forged",
    "test_unprivileged_user_cannot_act_on_other_users_jobs":
        "check_may_act (root/SlurmUser/operator) for cluster-wide actions; user mode limited to own jobs; "
        "malformed comments never planned",
    "test_checkpoint_dirs_are_private_to_the_jobs_user": "0700 directories created by the job's own user",
}


# What the suite found and how it was fixed (kept by hand: a fix is a commit, not a figure of a run).
FINDINGS = [
    ("SIGKILL during retention left a committed step with missing shards (rmtree removed files before "
     "the manifest)", "train/store: retention removes the manifest first (commit bbe54d1)"),
    ("one temp file (LATEST or a shard) leaked per killed write, forever",
     "train/store: retention collects temp files of dead writers (commit 2eb68cc)"),
    ("`admin install-plugin --slurm-conf` on a non-UTF-8 file: UnicodeDecodeError traceback",
     "control/plugin: exit 2 with one line (commit 96fedec)"),
    ("`--signal 999` / SLURM_ELASTIC_SIGNAL=999: 'Error: 999 is not a valid Signals'",
     "train/protocol: the usual 'must name a signal such as USR2' message (commit 036d81e)"),
    ("metrics.jsonl in a checkpoint directory was created with the umask (0644)",
     "train/store: created 0600 like the job's other files (commit 8361e4d)"),
    ("a cycle that carries many plans runs them one after another (1-2 s each), so the first cycle after "
     "a burst of submissions exceeds its interval", "open: test_load is xfail with this reason"),
]

SAFEGUARD_CHECKS = [
    ("checksum check in CheckpointStore._read_verified removed",
     "test_random_bit_flips_and_truncations_are_detected fails (a zero-filled shard is restored)"),
    ("manifest-first un-commit in CheckpointStore.apply_retention removed",
     "test_sigkill_at_random_points_never_loses_a_committed_step fails (committed step with a missing shard)"),
]


def _func(nodeid: str) -> tuple[str, str, str]:
    path, _, rest = nodeid.partition("::")
    name, _, param = rest.partition("[")
    return Path(path).name, name, param.rstrip("]")


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]" if len(value) <= 25 else f"{len(value)} values"
    return str(value)


def render(run: dict[str, Any]) -> str:
    kind = "long (`--long`)" if run["long"] else "short (CI sizes; the long run was not made for this page)"
    lines = [
        "# Reliability and security",
        "",
        "Generated by `python3 benchmarks/reliability_report.py` from the last run of the reliability suite "
        "(`tests/reliability/`). Do not edit by hand: run the suite, then the script.",
        "",
        f"- run: {kind}, finished {run['finished_at']}, {run['duration_s']:.0f} s, pytest exit status "
        f"{run['exitstatus']}",
        f"- command: `{run['command']}`",
        "- short run (CI, every push): `python3 -m pytest tests/reliability -q`; "
        "long run: `python3 -m pytest tests/reliability -q --long`",
        "- replay the random faults of a run: `SLURM_ELASTIC_RELIABILITY_SEED=<seed>` (each test records its seed)",
        *[f"- note: {n}" for n in run.get("notes", [])],
        "",
        "Live tests (marked `slurm`) run on a private 4-node x 4-GPU Slurm 22.05 on loopback with "
        "`job_submit.lua` (the controller tests' `elastic_cluster`), as root; they are skipped where that "
        "cannot start.",
        "",
    ]
    rows = run["tests"]
    for file, title in SECTIONS:
        mine = [r for r in rows if _func(r["test"])[0] == file]
        if not mine:
            continue
        lines += [f"## {title}", ""]
        grouped: dict[str, list[dict[str, Any]]] = {}
        for r in mine:
            grouped.setdefault(_func(r["test"])[1], []).append(r)
        for name, group in grouped.items():
            outcomes = {}
            for r in group:
                outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
            lines += [f"### `{name}`", "",
                      f"Guards: {GUARDS.get(name, '(not listed)')}.", "",
                      f"Outcome: {', '.join(f'{n} {k}' for k, n in sorted(outcomes.items()))}; "
                      f"{sum(r.get('duration_s', 0) for r in group):.1f} s.", ""]
            if len(group) == 1 and not _func(group[0]["test"])[2]:
                for k, v in sorted(group[0]["figures"].items()):
                    lines.append(f"- {k}: {_fmt(v)}")
                lines.append("")
            else:
                keys = sorted({k for r in group for k in r["figures"]})
                lines.append("| case | outcome | " + " | ".join(keys) + " |")
                lines.append("|---|---|" + "---|" * len(keys))
                for r in group:
                    cells = [_fmt(r["figures"].get(k, "")).replace("|", "\\|").replace("\n", " ") for k in keys]
                    lines.append(f"| {_func(r['test'])[2]} | {r['outcome']} | " + " | ".join(cells) + " |")
                lines.append("")
            lines += [f"Command: `python3 -m pytest '{group[0]['test'].split('[')[0]}'"
                      f"{' --long' if run['long'] else ''}`", ""]
            for r in group:
                if r.get("rerun_command"):
                    lines += [f"These figures come from a separate rerun after the main run: `{r['rerun_command']}` "
                              f"(the main run's row was replaced).", ""]
    lines += ["## Findings", "", "| found | fix |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in FINDINGS]
    lines += ["", "## Safeguards removed on purpose", "",
              "Each was removed in a scratch worktree (never committed) and the named test run against it:", ""]
    lines += [f"- {a}: {b}." for a, b in SAFEGUARD_CHECKS]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--out", type=Path, default=DEFAULT_DOC)
    parser.add_argument("--merge", type=Path, action="append", default=[],
                        help="results of a separate rerun whose rows replace the same tests' rows (said so in the doc)")
    parser.add_argument("--note", action="append", default=[], help="a line about the run, printed under its summary")
    parser.add_argument("--json", action="store_true", help="print one JSON row per test instead")
    args = parser.parse_args(argv)
    if not args.results.exists():
        print(f"{args.results}: no results; run python3 -m pytest tests/reliability first", file=sys.stderr)
        return 2
    run = json.loads(args.results.read_text())
    for extra in args.merge:
        rerun = json.loads(extra.read_text())
        fresh = {r["test"]: {**r, "rerun_command": rerun["command"]} for r in rerun["tests"]}
        run["tests"] = [fresh.pop(r["test"], r) for r in run["tests"]] + list(fresh.values())
    if args.json:
        print(json.dumps([{"test": r["test"], "outcome": r["outcome"], "duration_s": r.get("duration_s"),
                           **r["figures"]} for r in run["tests"]], indent=1, default=str))
        return 0
    run["notes"] = args.note
    args.out.write_text(render(run))
    print(f"wrote {args.out} from {args.results} ({len(run['tests'])} tests, "
          f"{'long' if run['long'] else 'short'} run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
