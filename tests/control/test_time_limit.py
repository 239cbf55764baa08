"""The time-limit options at submit: Slurm's warning asked for, the run's deadline passed to the job, impossible limits refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.cluster.cli_backend import sbatch_args
from slurm_elastic.cluster.shape import RequestShape
from slurm_elastic.control import time_limit
from slurm_elastic.control.submit import describe_submission, parse_command_line
from slurm_elastic.errors import SpecError

SITE = {"SLURM_ELASTIC_CKPT_DIR": "/scratch/site/ckpt"}


def _script(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "job.sbatch"
    path.write_text("\n".join(["#!/bin/bash", *lines, "srun true", ""]))
    return str(path)


def _sbatch(request) -> list[str]:
    return sbatch_args(describe_submission(request, RequestShape(nodes=1, gpus_per_node=2, cpus_per_gpu=1, mem_per_gpu_mb=1024)))


def test_every_job_asks_for_the_checkpoint_signal_before_its_limit_by_default(tmp_path: Path) -> None:
    request = parse_command_line(["--gpus=2-8", _script(tmp_path)], environ=SITE)
    argv = _sbatch(request)
    assert f"--signal=B:USR2@{time_limit.DEFAULT_SIGNAL_BEFORE_S}" in argv
    assert request.env[time_limit.WARNING_ENV] == str(time_limit.DEFAULT_SIGNAL_BEFORE_S)
    assert time_limit.DEADLINE_ENV not in request.env     # no --total-time: requeued at every limit
    export = next(a for a in argv if a.startswith("--export="))
    assert f"{time_limit.WARNING_ENV}={time_limit.DEFAULT_SIGNAL_BEFORE_S}" in export


def test_the_signal_is_the_configured_checkpoint_signal(tmp_path: Path) -> None:
    request = parse_command_line(["--gpus=2-8", "--signal-before=300", _script(tmp_path)],
                                 environ={**SITE, "SLURM_ELASTIC_SIGNAL": "SIGUSR1"})
    assert "--signal=B:USR1@300" in _sbatch(request)


def test_an_elastic_line_sets_the_lead_and_the_command_line_wins(tmp_path: Path) -> None:
    script = _script(tmp_path, "#ELASTIC --gpus 1-4 --signal-before 600")
    assert "--signal=B:USR2@600" in _sbatch(parse_command_line([script], environ=SITE))
    assert "--signal=B:USR2@90" in _sbatch(parse_command_line(["--signal-before=90", script], environ=SITE))


def test_zero_asks_for_no_warning(tmp_path: Path) -> None:
    request = parse_command_line(["--gpus=1-4", "--signal-before=0", "--time=1", _script(tmp_path)], environ=SITE)
    assert not any(a.startswith("--signal") for a in _sbatch(request))
    assert time_limit.WARNING_ENV not in request.env


def test_total_time_becomes_a_deadline_from_submission(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("slurm_elastic.control.submit.time.time", lambda: 1_000_000.0)
    request = parse_command_line(["--gpus=1-4", "--total-time=1-02:03:04", _script(tmp_path)], environ=SITE)
    assert request.env[time_limit.DEADLINE_ENV] == str(1_000_000 + ((24 + 2) * 60 + 3) * 60 + 4)


@pytest.mark.parametrize(("text", "seconds"), [("90", 5400), ("3:30", 210), ("1:02:03", 3723), ("2-3", 183600),
                                               ("2-3:04", 183840), ("2-3:04:05", 183845), ("UNLIMITED", None),
                                               ("infinite", None)])
def test_slurm_time_formats(text: str, seconds: int | None) -> None:
    assert time_limit.parse_duration(text, "--time") == seconds


@pytest.mark.parametrize(("args", "says"), [
    (["--time=2"], "--time 2 (120 s) leaves no training before the checkpoint warning"),
    (["--time=3:00", "--signal-before=200"], "--time 3:00 (180 s) leaves no training"),
    (["--signal-before=70000"], "Slurm takes at most 65535 s"),
    (["--signal-before=-5"], "expected whole seconds"),
    (["--total-time=soon"], "--total-time 'soon': expected minutes"),
    (["--total-time=0"], "must be longer than 0"),
    (["--signal=B:USR1@60"], "--signal: the warning before the time limit is slurm-elastic's"),
])
def test_a_limit_that_cannot_work_is_refused_in_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    with pytest.raises(SpecError) as exc:
        parse_command_line(["--gpus=1-4", *args, _script(tmp_path)], environ=SITE)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_the_limit_is_read_where_sbatch_reads_it(tmp_path: Path) -> None:
    short = _script(tmp_path, "#SBATCH --time=2")
    with pytest.raises(SpecError, match="--time 2 "):
        parse_command_line(["--gpus=1-4", short], environ=SITE)
    # sbatch takes the command line over SBATCH_TIMELIMIT over the script.
    parse_command_line(["--gpus=1-4", "--time=1:00:00", short], environ=SITE)
    parse_command_line(["--gpus=1-4", short], environ={**SITE, "SBATCH_TIMELIMIT": "60"})
    with pytest.raises(SpecError, match="--time 1 "):
        parse_command_line(["--gpus=1-4", _script(tmp_path)], environ={**SITE, "SBATCH_TIMELIMIT": "1"})


def test_a_signal_option_in_the_script_or_environment_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="line 2: #SBATCH --signal"):
        parse_command_line(["--gpus=1-4", _script(tmp_path, "#SBATCH --signal=USR1@60")], environ=SITE)
    with pytest.raises(SpecError, match="SBATCH_SIGNAL is set"):
        parse_command_line(["--gpus=1-4", _script(tmp_path)], environ={**SITE, "SBATCH_SIGNAL": "USR1@60"})


def test_a_bad_checkpoint_signal_is_refused_at_submit(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="must name a signal"):
        parse_command_line(["--gpus=1-4", _script(tmp_path)], environ={**SITE, "SLURM_ELASTIC_SIGNAL": "NOPE"})


# What Slurm 22.05's `scontrol -o show partition` printed on the local cluster (abridged to the fields it
# has on every version), and a site's partition with limits.
PARTITIONS = (
    "PartitionName=gpu AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A "
    "DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED "
    "MaxTime=UNLIMITED MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=n[1-4] State=UP\n"
    "PartitionName=short AllowGroups=ALL Default=NO QoS=N/A DefaultTime=00:02:00 MaxTime=1-00:00:00 State=UP\n")


def test_scontrol_partition_lines_give_each_partitions_default_and_max_time() -> None:
    gpu, short = time_limit.PartitionTimes("gpu", None, None, True), time_limit.PartitionTimes("short", 120, 86400)
    from slurm_elastic.cluster.partitions import parse_partitions
    assert parse_partitions(PARTITIONS) == (gpu, short)


def _submit_beside_a_short_partition(tmp_path: Path, args: list[str], environ: dict[str, str] | None = None,
                                     script: tuple[str, ...] = ()):
    from slurm_elastic.cluster.memory import InMemorySlurm
    from slurm_elastic.control.submit import submit

    slurm = InMemorySlurm(nodes=2)
    slurm.partition_limits["short"] = (120, 86400)
    request = parse_command_line(["--gpus=1-4", *args, _script(tmp_path, *script)], environ={**SITE, **(environ or {})})
    try:
        return submit(slurm, request)[1], slurm
    except SpecError as exc:
        assert slurm.jobs == {}                      # nothing submitted
        return exc, slurm


@pytest.mark.parametrize("args, environ, script, says", [
    (["--time=2-00:00:00", "--partition=short"], {}, (), "above partition short's MaxTime (86400 s)"),
    (["--partition=short"], {}, (),
     "partition short's DefaultTime (120 s) leaves no training before the checkpoint warning"),
    # sbatch reads SBATCH_PARTITION before the script's -p
    (["--time=2-00:00:00"], {"SBATCH_PARTITION": "short"}, ("#SBATCH -p gpu",), "above partition short's MaxTime"),
])
def test_a_time_limit_the_partition_defeats_is_refused_at_submit_and_nothing_is_submitted(
        tmp_path: Path, args: list[str], environ: dict[str, str], script: tuple[str, ...], says: str) -> None:
    got, _ = _submit_beside_a_short_partition(tmp_path, args, environ, script)
    assert isinstance(got, SpecError) and says in str(got), got


@pytest.mark.parametrize("args", [
    ["--time=1-00:00:00", "--partition=short"],        # at MaxTime
    ["--time=30", "--partition=short"],                # --time overrides the short DefaultTime
    [],                                                # the default partition: no limits
    ["--time=2-00:00:00", "--partition=short,gpu"],    # Slurm takes gpu, which allows it
    ["--time=2-00:00:00", "--partition=elsewhere"],    # a partition not listed: Slurm's to refuse
])
def test_a_time_limit_the_partition_allows_is_submitted(tmp_path: Path, args: list[str]) -> None:
    got, slurm = _submit_beside_a_short_partition(tmp_path, args)
    assert got in slurm.jobs, got


# What Slurm 22.05's `scontrol -o show reservation` printed on the local cluster for an active and an
# ended reservation; with none it prints the other line.
RESERVATIONS = (
    "ReservationName=r1 StartTime=2026-12-05T05:04:58 EndTime=2026-12-05T05:07:58 Duration=00:03:00 Nodes=n1 "
    "NodeCnt=1 CoreCnt=8 Features=(null) PartitionName=(null) Flags=SPEC_NODES TRES=cpu=8 Users=root "
    "Groups=(null) Accounts=(null) Licenses=(null) State=INACTIVE BurstBuffer=(null) Watts=n/a MaxStartDelay=(null)\n"
    "ReservationName=maint StartTime=2026-12-06T08:00:00 EndTime=2026-12-06T20:00:00 Duration=12:00:00 "
    "Nodes=n[1-4] NodeCnt=4 Flags=MAINT,SPEC_NODES State=INACTIVE\n")


def _at(text: str) -> float:
    import time
    return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))


def test_scontrol_reservation_lines_give_each_reservations_window() -> None:
    from slurm_elastic.cluster.reservations import AdvanceReservation, parse_reservations
    assert parse_reservations(RESERVATIONS) == (
        AdvanceReservation("r1", _at("2026-12-05T05:04:58"), _at("2026-12-05T05:07:58"), ("n1",), active=False),
        AdvanceReservation("maint", _at("2026-12-06T08:00:00"), _at("2026-12-06T20:00:00"),
                           ("n1", "n2", "n3", "n4"), active=False))
    active = RESERVATIONS.splitlines()[0].replace("State=INACTIVE", "State=ACTIVE")
    assert parse_reservations(active)[0].active
    assert parse_reservations("No reservations in the system\n") == ()


@pytest.mark.parametrize("args, says", [
    # no --total-time: the run outlives any reservation
    (["--reservation=maint"], "reservation maint ends at 2026-12-06T20:00:00 (in 720 min), though its run has no "
                              "--total-time"),
    (["--reservation=maint", "--total-time=13:00:00"], "before its --total-time (780 min)"),
    (["--reservation=maint", "--total-time=12:00:00"], None),       # ends with the reservation
    (["--reservation=maint,r1", "--total-time=11:00:00"], None),    # Slurm may run it in either: the later end counts
    (["--reservation=elsewhere"], None),                            # not listed: Slurm's to refuse
    ([], None),
])
def test_a_reservation_that_ends_before_the_run_is_said_in_one_line_at_submit(
        tmp_path: Path, args: list[str], says: str | None) -> None:
    from slurm_elastic.cluster.reservations import parse_reservations
    from slurm_elastic.control.submit import submission_notices

    class Reserved:   # the part of a backend the notice reads
        def reservations(self):
            return parse_reservations(RESERVATIONS)

    request = parse_command_line(["--gpus=1-4", *args, _script(tmp_path)], environ=SITE)
    # (the other line, on reservations it is not in, is the next test's)
    notices = [n for n in submission_notices(Reserved(), request, now=_at("2026-12-06T08:00:00")) if " ends at " in n]
    if says is None:
        assert notices == []
    else:
        assert len(notices) == 1 and says in notices[0], notices
        assert "cannot start the job in it again" in notices[0] and "give --total-time 720 or less" in notices[0]


@pytest.mark.parametrize("args, now, says", [
    # an unlimited job never starts on a reservation's nodes while it is to come
    ([], "2026-12-01T08:00:00", "reservation maint holds 4 node(s) from 2026-12-06T08:00:00 and it has no time limit"),
    (["--time=60"], "2026-12-06T07:30:00", "its time limit (60 min) would end after that"),
    (["--time=60"], "2026-12-06T06:00:00", None),                    # ends before the window opens
    (["--time=60"], "2026-12-06T09:00:00", "from now"),              # inside the window
    (["--time=60"], "2026-12-06T20:00:00", None),                    # over
    (["--time=60", "--reservation=maint"], "2026-12-06T07:30:00", None),   # its own
])
def test_reservations_a_job_is_not_in_are_said_in_one_line_at_submit(
        tmp_path: Path, args: list[str], now: str, says: str | None) -> None:
    from slurm_elastic.cluster.reservations import parse_reservations
    from slurm_elastic.control.submit import submission_notices

    class Reserved:
        def reservations(self):
            return parse_reservations(RESERVATIONS.splitlines()[1])

    request = parse_command_line(["--gpus=1-4", *args, _script(tmp_path)], environ=SITE)
    notices = [n for n in submission_notices(Reserved(), request, now=_at(now)) if " ends at " not in n]
    if says is None:
        assert notices == []
    else:
        assert len(notices) == 1 and says in notices[0], notices
        assert "only after the reservation ends" in notices[0]


def test_the_reservation_is_read_where_sbatch_reads_it(tmp_path: Path) -> None:
    script = _script(tmp_path, "#SBATCH --reservation=in-script")
    assert parse_command_line(["--gpus=1-4", script], environ=SITE).reservation == "in-script"
    env = {**SITE, "SBATCH_RESERVATION": "from-env"}
    assert parse_command_line(["--gpus=1-4", script], environ=env).reservation == "from-env"
    assert parse_command_line(["--gpus=1-4", "--reservation=given", script], environ=env).reservation == "given"
    assert parse_command_line(["--gpus=1-4", _script(tmp_path)], environ=SITE).reservation is None
