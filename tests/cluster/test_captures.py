"""Every file in ../shared/slurm-json is read by some parser, and what each says agrees with the model.

A capture added later fails `test_every_capture_file_is_covered` until a parser (and a test)
handles it, so nothing in the shared captures is skipped silently.
"""

from __future__ import annotations

import re

import pytest

from slurm_elastic.cluster.parse_json import parse_jobs, parse_nodes
from slurm_elastic.cluster.parse_text import jobs_from_text, nodes_from_text, sinfo_table, squeue_table

from tests.cluster.captures import CAPTURES, PROJECT_CAPTURES, VERSIONS, capture_dir, load, text

# file name pattern -> how it is read (the tests in this package check the results)
READERS = {
    r"squeue\.json": "parse_jobs",
    r"scontrol-show-job-[a-z-]+\.json": "parse_jobs",
    r"sinfo\.json": "parse_nodes",
    r"scontrol-show-nodes\.json": "parse_nodes",
    r"scontrol-show-job-[a-z-]+\.txt": "jobs_from_text",
    r"scontrol-show-node\.txt": "nodes_from_text",
    r"squeue\.txt": "squeue_table",
    r"sinfo\.txt": "sinfo_table",
    r"verify\.txt": "capture log: no FAIL line",
}


def test_every_capture_file_is_covered() -> None:
    capture_dir("22.05")
    files = sorted(p for p in CAPTURES.rglob("*") if p.is_file() and p.name != "README.md")
    assert files, f"no captures under {CAPTURES}"
    uncovered = [str(p.relative_to(CAPTURES)) for p in files
                 if not any(re.fullmatch(rx, p.name) for rx in READERS)]
    assert not uncovered, f"capture files no parser reads: {uncovered}"
    assert {p.parent.name for p in files} == set(VERSIONS)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_file_parses(version: str) -> None:
    d = capture_dir(version)
    for path in sorted(d.iterdir()):
        name = path.name
        if name.endswith(".json") and ("squeue" in name or "show-job" in name):
            assert parse_jobs(load(version, name))
        elif name.endswith(".json"):
            assert len(parse_nodes(load(version, name))) == 4
        elif name.startswith("scontrol-show-job"):
            assert len(jobs_from_text(text(version, name))) == 1
        elif name == "scontrol-show-node.txt":
            assert len(nodes_from_text(text(version, name))) == 4
        elif name == "squeue.txt":
            assert len(squeue_table(text(version, name))) == 3
        elif name == "sinfo.txt":
            assert len(sinfo_table(text(version, name))) == 4
        elif name == "verify.txt":
            log = text(version, name)
            assert "PASS" in log and not re.search(r"^FAIL", log, flags=re.MULTILINE)


@pytest.mark.parametrize("version", VERSIONS)
def test_plain_tables_agree_with_the_model(version: str) -> None:
    jobs = {j.job_id: j for j in parse_jobs(load(version, "squeue.json"))}
    for row in squeue_table(text(version, "squeue.txt")):
        job = jobs[row.job_id]
        assert (row.state, row.user, row.name, row.partition, row.num_nodes, row.nodes, row.reason) == \
            (job.state, job.user, job.name, job.partition, job.num_nodes, job.nodes, job.reason)
    nodes = parse_nodes(load(version, "sinfo.json" if version == "22.05" else "scontrol-show-nodes.json"))
    assert sinfo_table(text(version, "sinfo.txt")) == {n.name: (n.state, n.flags) for n in nodes}


# The project's own captures (tests/cluster/slurm-json) and the tests that read them.
PROJECT_READERS = {
    r"squeue-[a-z-]+\.json": "test_parse_json (held, reason, memory per node)",
    r"scontrol-show-job-mem-per-gpu-running\.json": "test_parse_json::test_mem_per_gpu_job_from_scontrol_json",
    r"scontrol-show-job-[a-z-]+\.txt": "test_parse_text::test_version_differences_in_text_give_the_json_model",
    r"squeue-format\.txt": "test_pyslurm_backend (the TRES strings the pyslurm backend reads with squeue -O)",
    r"finished-job-actions\.txt": "test_cli_backend::test_finished_and_unknown_job_errors_as_slurm_words_them",
}


def test_every_project_capture_is_covered() -> None:
    files = sorted(p for p in PROJECT_CAPTURES.rglob("*") if p.is_file() and p.suffix in (".json", ".txt"))
    assert {p.parent.name for p in files} == set(VERSIONS)
    uncovered = [str(p.relative_to(PROJECT_CAPTURES)) for p in files
                 if not any(re.fullmatch(rx, p.name) for rx in PROJECT_READERS)]
    assert not uncovered, f"project capture files no test reads: {uncovered}"
    for version in VERSIONS:  # the same scenario on every version (scontrol --json only from 23.02)
        names = {p.name for p in files if p.parent.name == version}
        assert len(names) == (8 if version == "22.05" else 9), (version, sorted(names))


PRIORITIES = {"22.05": {1: 4294901757, 2: 4294901758, 3: 0}, "24.11": {1: 1, 2: 1, 3: 0}, "26.05": {1: 1, 2: 1, 3: 0}}


@pytest.mark.parametrize("version", VERSIONS)
def test_priority_and_time_limit_are_read_as_squeue_gives_them(version: str) -> None:
    # Pending rigid jobs are ordered by Slurm's priority (allocate/from_state.py); held ones have 0.
    jobs = {j.job_id: j for j in parse_jobs(load(version, "squeue.json"))}
    assert {i: j.priority for i, j in jobs.items()} == PRIORITIES[version]
    assert all(j.time_limit_s is None for j in jobs.values())          # TimeLimit=UNLIMITED in every capture
    running = jobs_from_text(text(version, "scontrol-show-job-running.txt"))[0]
    assert running.priority == PRIORITIES[version][1]
