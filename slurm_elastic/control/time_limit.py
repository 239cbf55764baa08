"""An elastic job through its time limits: Slurm's warning before the limit, the run's bound, the check at submit.

At `--signal-before` seconds before a job's time limit Slurm sends the checkpoint signal to
the batch shell alone (`--signal=B:SIG@N`); the job template passes it on to the ranks, which
commit as for a resize, and the job requeues itself (`scontrol requeue` of its own id, which
an owner may do on every Slurm from 22.05 on and needs no site setting, where a requeue by
exit code needs the site's `RequeueExit`). Once `--total-time` has passed since submission
the job commits at its limit but no longer requeues itself.

At submit, the job's time limit (its --time, else its partition's DefaultTime, else MaxTime, as Slurm
chooses it) must leave time to train before the warning, and a --time above the partition's MaxTime is
refused with one line: Slurm would leave such a job pending for ever (PartitionTimeLimit) or reject it.
A job in an advance reservation is told in one line when the reservation ends before its run would:
Slurm lets the running incarnation go on past the end, but one requeued after it stays pending
(reason Reservation), so the run ends at its first requeue after the window.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from slurm_elastic import settings
from slurm_elastic.cluster.partitions import PartitionTimes, parse_duration
from slurm_elastic.cluster.reservations import AdvanceReservation, blocking
from slurm_elastic.errors import SpecError

# Measured on the local cluster, a signalled commit of the digits MLP reached its ACK in 0.3 s and
# the launcher's end in 0.8 s (docs/training.md); a larger model adds its checkpoint at the
# writer's measured 1.1-1.4 GB/s per node. 120 s leaves room for ~100 GB per node and a loaded
# filesystem; a job that knows better sets --signal-before.
DEFAULT_SIGNAL_BEFORE_S = 120
MAX_SIGNAL_BEFORE_S = int(settings.LIMIT_WARNING_S.maximum or 0)   # sbatch takes --signal=...@0..65535
# sbatch(1): "the signal may be sent up to 60 seconds earlier than specified"; a limit shorter than
# the warning plus this would signal an incarnation as it starts.
SLURM_SIGNAL_EARLY_S = 60

# What the job template reads (job_templates/*.sbatch); set by the wrapper, kept by Slurm across requeues.
WARNING_ENV = str(settings.LIMIT_WARNING_S.env)
DEADLINE_ENV = str(settings.RUN_DEADLINE.env)

OPTIONS = {"signal-before": "signal_before", "total-time": "total_time"}   # elastic options, job-side only
TIMELIMIT_ENV = "SBATCH_TIMELIMIT"              # sbatch's variable for --time



@dataclass(frozen=True, slots=True)
class TimeLimitPolicy:
    """How an elastic job meets its time limit: the warning's lead (0: none) and the run's bound (None: none)."""

    signal_before_s: int = DEFAULT_SIGNAL_BEFORE_S
    total_time_s: int | None = None

    def sbatch_args(self, signal: str) -> tuple[str, ...]:
        """sbatch's option asking for the warning; `signal` in the form scancel takes ('USR2')."""
        return (f"--signal=B:{signal}@{self.signal_before_s}",) if self.signal_before_s else ()

    def env(self, submitted_at: float) -> dict[str, str]:
        """The variables the job template reads."""
        out = {WARNING_ENV: str(self.signal_before_s)} if self.signal_before_s else {}
        if self.total_time_s is not None:
            out[DEADLINE_ENV] = str(int(submitted_at + self.total_time_s))
        return out


def policy_from_options(options: Mapping[str, str]) -> TimeLimitPolicy:
    """The policy from the elastic options `signal_before` (seconds) and `total_time` (Slurm's time format)."""
    policy = TimeLimitPolicy()
    raw = options.get("signal_before")
    if raw is not None:
        if not re.fullmatch(r"\d{1,6}", raw.strip()):
            raise SpecError(f"--signal-before {raw!r}: expected whole seconds (0: no warning before the time limit)")
        seconds = int(raw)
        if seconds > MAX_SIGNAL_BEFORE_S:
            raise SpecError(f"--signal-before {seconds}: Slurm takes at most {MAX_SIGNAL_BEFORE_S} s")
        policy = TimeLimitPolicy(signal_before_s=seconds)
    if options.get("total_time") is not None:
        total = parse_duration(options["total_time"], "--total-time")
        if total is not None and total <= 0:
            raise SpecError(f"--total-time {options['total_time']!r} must be longer than 0")
        policy = TimeLimitPolicy(policy.signal_before_s, total)
    return policy


def check_partition_time(policy: TimeLimitPolicy, time_limit: str | None, partition: str | None,
                         partitions: Sequence[PartitionTimes]) -> None:
    """One line when the partition's limits defeat the job's time limits: a --time above its MaxTime, or
    (no --time) a DefaultTime or MaxTime that leaves no training before the warning. `partition`: the job's
    -p as given (a comma list: Slurm takes the first that can run it, so one that allows it is enough);
    None: the default partition. A partition not listed is Slurm's to refuse."""
    names = [p for p in (partition or "").split(",") if p]
    chosen = [p for p in partitions if p.name in names] if names else [p for p in partitions if p.is_default]
    if not chosen:
        return
    limit_s = parse_duration(time_limit, "--time") if time_limit is not None else None
    problems = []
    for part in chosen:
        if time_limit is not None:
            if limit_s is not None and part.max_s is not None and limit_s > part.max_s:
                problems.append(f"--time {time_limit} ({limit_s} s) is above partition {part.name}'s MaxTime "
                                f"({part.max_s} s): Slurm would never start it; give --time {part.max_s // 60} "
                                "or less (the job requeues itself at each limit; --total-time bounds the run)")
                continue
            return
        effective = part.default_s if part.default_s is not None else part.max_s
        if effective is None or not policy.signal_before_s:
            return
        needed = policy.signal_before_s + SLURM_SIGNAL_EARLY_S
        if effective > needed:
            return
        problems.append(f"partition {part.name}'s {'DefaultTime' if part.default_s is not None else 'MaxTime'} "
                        f"({effective} s) leaves no training before the checkpoint warning "
                        f"(--signal-before {policy.signal_before_s} s, which Slurm may send up to "
                        f"{SLURM_SIGNAL_EARLY_S} s early): give a --time above {needed} s that the partition "
                        "allows, or a smaller --signal-before")
    raise SpecError(problems[0])


def expected_limit_s(time_limit: str | None, partition: str | None,
                     partitions: Sequence[PartitionTimes]) -> float | None:
    """The time limit Slurm will give the job: its --time, else its partition's DefaultTime, else that
    partition's MaxTime (the first of a -p list; no -p: the default partition); None: unlimited or not
    known."""
    if time_limit is not None:
        return parse_duration(time_limit, "--time")
    names = [p for p in (partition or "").split(",") if p]
    part = next((p for p in partitions if (p.name == names[0] if names else p.is_default)), None)
    if part is None:
        return None
    return part.default_s if part.default_s is not None else part.max_s


def check_time_limit(policy: TimeLimitPolicy, time_limit: str | None) -> None:
    """One line when the job's own limit leaves no time before the warning (each incarnation would be
    signalled as it starts). `time_limit` is the job's --time as given; None: the partition's default,
    which the wrapper does not read."""
    if time_limit is None or not policy.signal_before_s:
        return
    limit_s = parse_duration(time_limit, "--time")
    if limit_s is None:
        return
    needed = policy.signal_before_s + SLURM_SIGNAL_EARLY_S
    if limit_s <= needed:
        raise SpecError(f"--time {time_limit} ({limit_s} s) leaves no training before the checkpoint warning "
                        f"(--signal-before {policy.signal_before_s} s, which Slurm may send up to "
                        f"{SLURM_SIGNAL_EARLY_S} s early): give more than {needed} s or a smaller --signal-before")


def reservation_notice(policy: TimeLimitPolicy, reservation: str | None,
                       reservations: Sequence[AdvanceReservation], now: float) -> str | None:
    """One line when the job's reservation ends before its run would (an unbounded run always outlives it).

    `reservation`: the job's --reservation as given (a comma list: Slurm runs it in one of them, so the
    latest end counts); a reservation not listed is Slurm's to refuse."""
    names = [r for r in (reservation or "").split(",") if r]
    ends = [r.end_at for r in reservations if r.name in names and r.end_at is not None]
    if not ends:
        return None
    end = max(ends)
    if policy.total_time_s is not None and now + policy.total_time_s <= end:
        return None
    left_min = max(int(end - now) // 60, 0)
    bound = (f"before its --total-time ({policy.total_time_s // 60} min)" if policy.total_time_s is not None
             else "though its run has no --total-time")
    return (f"reservation {','.join(names)} ends at {time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(end))} "
            f"(in {left_min} min), {bound}: a requeue after that (a time limit, a resize) cannot start the job "
            f"in it again and it stays pending (reason Reservation); give --total-time {left_min} or less to end "
            "the run at its last time limit before then")


def blocked_notice(time_limit_s: float | None, reservation: str | None,
                   reservations: Sequence[AdvanceReservation], now: float) -> str | None:
    """One line when reservations the job is not in keep it (and its requeues) off nodes: Slurm starts a
    job on a reservation's nodes only if its time limit ends before the window opens."""
    blocked = blocking({r.name: r for r in reservations}, reservation or "", now, time_limit_s)
    if not blocked:
        return None
    first = min(blocked.values(), key=lambda r: (r.start_at or 0.0, r.name))
    names = ", ".join(sorted({r.name for r in blocked.values()}))
    opens = ("now" if first.active or first.start_at is None or first.start_at <= now else
             time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(first.start_at)))
    limit = ("it has no time limit" if time_limit_s is None else
             f"its time limit ({int(time_limit_s) // 60} min) would end after that")
    return (f"reservation {names} holds {len(blocked)} node(s) from {opens} and {limit}: Slurm starts it and "
            "its requeues on them only after the reservation ends"
            + ("; a --time shorter than the time left lets it run there until then (it requeues itself at each "
               "limit)" if first.start_at is not None and first.start_at > now else ""))

