"""Loading workloads: Pollux profiles and traces, the generic CSV, sacct exports, and clear errors for bad files."""

from __future__ import annotations

import shutil

import pytest

from slurm_elastic.errors import TraceError
from slurm_elastic.sim.generic import load_generic
from slurm_elastic.sim.jobs import packed_placement
from slurm_elastic.sim.pollux import ApplicationProfile, load_workload
from slurm_elastic.sim.sacct import load_sacct
from slurm_elastic.sim.workload import load_any, sniff

from tests.sim.conftest import DATA


# -- Pollux ---------------------------------------------------------------------------------------
def test_pollux_workload_loads_all_jobs(pollux):
    jobs = load_workload(pollux / "workloads" / "workload-1.csv")
    assert len(jobs) == 160
    assert [j.submit_s for j in jobs] == sorted(j.submit_s for j in jobs)
    ncf = next(j for j in jobs if j.application == "ncf")
    assert ncf.max_gpus == 1  # ncf stays at one GPU, as in the original simulator
    cifar = next(j for j in jobs if j.application == "cifar10")
    assert cifar.max_gpus == min(64, int(cifar.speed.batch_size // cifar.speed.profile.min_local_bsz))


def test_pollux_speed_uses_measured_placements(pollux):
    profile = ApplicationProfile.load(pollux / "applications" / "cifar10")
    rows = [line.split(",") for line in (pollux / "applications" / "cifar10" / "placements.csv").read_text().split()[1:]]
    placement, bsz, step = rows[0][0], float(rows[0][1]), float(rows[0][2])
    got, _ = profile.step_times(tuple(int(c) for c in placement), bsz)
    assert got == pytest.approx(step)
    # rotations of a placement are the same placement
    assert profile.step_times((1, 2), 64.0) == profile.step_times((2, 1), 64.0)
    # an unmeasured multi-node placement interpolates to a finite, positive step time
    step16, sync16 = profile.step_times((4,) * 16, 64.0)
    assert step16 > 0 and 0 <= sync16 <= step16


def test_pollux_work_is_iterations_of_the_last_epoch(pollux):
    profile = ApplicationProfile.load(pollux / "applications" / "bert")
    rows = (pollux / "applications" / "bert" / "validation-384.csv").read_text().split()
    last = rows[profile.epochs].split(",")  # header + one row per epoch; bert trains 2 epochs
    assert profile.work_iterations(384) == pytest.approx(float(last[1]))
    lo, hi = profile.work_iterations(192), profile.work_iterations(384)
    assert min(lo, hi) <= profile.work_iterations(288) <= max(lo, hi)


def test_yolov3_uses_gradient_accumulation_past_8_per_gpu(pollux):
    profile = ApplicationProfile.load(pollux / "applications" / "yolov3")
    assert profile.max_local_bsz == 8
    step, sync = profile.step_times((1,), 8.0)
    # batch 16 on one GPU: two micro-batches of 8, the first without gradient sync
    assert profile.iteration_time((1,), 16) == pytest.approx(step + (step - sync))


def _copy_apps(pollux, tmp_path, names=("cifar10",)):
    apps = tmp_path / "applications"
    for name in names:
        shutil.copytree(pollux / "applications" / name, apps / name)
    (tmp_path / "workloads").mkdir()
    return tmp_path / "workloads"


def test_pollux_missing_column(pollux, tmp_path):
    wl = _copy_apps(pollux, tmp_path) / "w.csv"
    wl.write_text("name,time,application,batch_size\ncifar10-0,0,cifar10,128\n")
    with pytest.raises(TraceError, match="missing column.*num_replicas"):
        load_workload(wl)


def test_pollux_negative_time(pollux, tmp_path):
    wl = _copy_apps(pollux, tmp_path) / "w.csv"
    wl.write_text("name,time,application,num_replicas,batch_size\ncifar10-0,-5,cifar10,1,128\n")
    with pytest.raises(TraceError, match=r"w.csv:2: column time must be >= 0"):
        load_workload(wl)


def test_pollux_unknown_application(pollux, tmp_path):
    wl = _copy_apps(pollux, tmp_path) / "w.csv"
    wl.write_text("name,time,application,num_replicas,batch_size\nresnet-0,0,resnet,1,128\n")
    with pytest.raises(TraceError, match="unknown application 'resnet'.*cifar10"):
        load_workload(wl)


def test_pollux_profile_with_missing_column(pollux, tmp_path):
    wl = _copy_apps(pollux, tmp_path) / "w.csv"
    (tmp_path / "applications" / "cifar10" / "placements.csv").write_text("placement,local_bsz\n1,32\n")
    wl.write_text("name,time,application,num_replicas,batch_size\ncifar10-0,0,cifar10,1,128\n")
    with pytest.raises(TraceError, match="placements.csv: missing column.*step_time"):
        load_workload(wl)


# -- generic CSV ----------------------------------------------------------------------------------
def test_generic_csv(tmp_path):
    path = tmp_path / "g.csv"
    path.write_text("name,submit_s,gpus,min_gpus,max_gpus,duration_s,gpu_seconds,speedup\n"
                    "a,0,2,1,4,100,,1:1;2:2;4:3\n"
                    "b,30,4,,,,800,\n")
    a, b = load_generic(path)
    assert (a.min_gpus, a.max_gpus) == (1, 4) and not b.elastic
    assert a.runtime_at((2,)) == pytest.approx(100)
    assert a.runtime_at((4,)) == pytest.approx(200 / 3)
    assert b.runtime_at(packed_placement(4, 4)) == pytest.approx(200)


@pytest.mark.parametrize("body, message", [
    ("submit_s,duration_s\n0,10\n", "missing column.*gpus"),
    ("submit_s,gpus\n0,1\n", "duration_s or gpu_seconds"),
    ("submit_s,gpus,duration_s\n-1,1,10\n", "column submit_s must be >= 0"),
    ("submit_s,gpus,duration_s\n0,1.5,10\n", "gpus must be an integer"),
    ("submit_s,gpus,duration_s\n0,1,abc\n", "duration_s is not a number"),
    ("submit_s,gpus,min_gpus,duration_s\n0,1,2,10\n", r"gpus 1 must lie in \[min_gpus 2"),
    ("submit_s,gpus,duration_s,speedup\n0,1,10,2:1:3\n", "bad speedup point"),
    ("submit_s,gpus,duration_s,speedup\n0,1,10,1:1,2:2\n", "more fields than the header"),
])
def test_generic_bad_files(tmp_path, body, message):
    path = tmp_path / "g.csv"
    path.write_text(body)
    with pytest.raises(TraceError, match=message):
        load_generic(path)


# -- sacct --------------------------------------------------------------------------------------
def test_sacct_sample_import():
    imported = load_sacct(DATA / "sacct-4x4.txt")
    jobs = {j.key: j for j in imported.jobs}
    header, *rows = (DATA / "sacct-4x4.txt").read_text().splitlines()
    ended_gpu = [r for r in rows if "gres/gpu" in r.split("|")[8] and r.split("|")[11].split()[0]
                 not in ("RUNNING", "PENDING")]
    assert len(jobs) == len(ended_gpu)
    assert imported.skipped == {"no GPUs (CPU-only jobs do not compete for GPUs here)": 1, "never ran": 1,
                                "state RUNNING": 1, "state PENDING": 1}
    assert min(j.submit_s for j in jobs.values()) == 0
    # a rigid job replays at its allocated size for exactly its recorded run time
    row = next(r.split("|") for r in rows if r.startswith("1002|"))
    assert not jobs["1002"].elastic
    assert jobs["1002"].runtime_at((1,)) == pytest.approx(_seconds(row[7]))
    assert jobs["1002"].cpus_per_gpu == 4 and jobs["1002"].mem_per_gpu_mb == 16 * 1024
    # an elastic spec in the Comment gives the range
    elastic = [r.split("|") for r in rows if "elastic:v1" in r]
    for r in elastic:
        assert jobs[r[0]].elastic
    # failed / timed-out jobs are replayed too: their runs used the GPUs
    assert "1006" in jobs and "1017" in jobs


def test_sacct_modes():
    everything = load_sacct(DATA / "sacct-4x4.txt", elastic="all").jobs
    assert all(j.min_gpus == 1 and j.max_gpus == 2 * j.requested_gpus for j in everything)
    rigid = load_sacct(DATA / "sacct-4x4.txt", elastic="none").jobs
    assert not any(j.elastic for j in rigid)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("|ReqTRES", ""), "missing column.*ReqTRES"),
    (lambda t: t.replace("2026-11-23T08:20:00|2026", "yesterday|2026", 1), "not a sacct time"),
    (lambda t: t.replace("gres/gpu=1,mem=16G", "gres/gpu=one,mem=16G", 1), "bad TRES value"),
    (lambda t: t.replace("gpus=1-2 step=1", "gpus=1-2 step=0", 1), "job 1009"),
])
def test_sacct_bad_files(tmp_path, edit, message):
    path = tmp_path / "sacct.txt"
    path.write_text(edit((DATA / "sacct-4x4.txt").read_text()))
    with pytest.raises(TraceError, match=message):
        load_sacct(path)


def test_format_sniffing(tmp_path, pollux):
    assert sniff(DATA / "sacct-4x4.txt") == "sacct"
    assert sniff(pollux / "workloads" / "workload-1.csv") == "pollux"
    other = tmp_path / "x.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="unknown workload format"):
        load_any(other)


def _seconds(elapsed: str) -> float:
    days, _, hms = elapsed.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + s
