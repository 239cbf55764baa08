"""`slurm-elastic admin`: cluster-wide status, rebalancing, the controller daemon and the submit plugin."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import click

from slurm_elastic import settings
from slurm_elastic.cli._common import echo_json, elastic_errors
from slurm_elastic.cli.controller_options import controller_config, controller_options, rigid_policy
from slurm_elastic.cluster.model import ClusterState
from slurm_elastic.errors import SpecError

log = logging.getLogger(__name__)


def check_elastic_ids(state: ClusterState, job_ids: frozenset[int], *, user: str | None = None) -> None:
    """Bad input for commands given job ids: unknown, finished, not elastic, malformed or someone else's."""
    known = {j.job_id: j for j in state.jobs}
    for job_id in sorted(job_ids):
        job = known.get(job_id)
        if job is None:
            raise SpecError(f"job {job_id}: no such job in Slurm")
        if job.state.finished:
            raise SpecError(f"job {job_id} has ended ({job.state.value})")
        if job.spec_error:
            raise SpecError(f"job {job_id}: its elastic spec is malformed ({job.spec_error}); "
                            "slurm-elastic never touches it")
        if job.spec is None:
            raise SpecError(f"job {job_id} is not an elastic job (no elastic spec in its comment); "
                            "slurm-elastic only changes elastic jobs")
        if user is not None and job.user != user:
            raise SpecError(f"job {job_id} belongs to {job.user}, not {user}")


def _read_only_journal(fallback: Path | None = None) -> Any:
    """The daemon's journal when readable (hysteresis shows true), else `fallback`'s (a user's own watch
    journal, which saw the jobs only while a watch ran: not lifelong), else an empty one in memory, which
    knows no job's earlier sizes."""
    import os

    from slurm_elastic.control.journal import Journal
    from slurm_elastic.control.state_dir import JOURNAL_FILE, daemon_dir

    for directory in (daemon_dir(), fallback):
        if directory is None:
            continue
        path = directory / JOURNAL_FILE
        if path.exists() and os.access(path, os.R_OK | os.W_OK) and os.access(path.parent, os.W_OK):
            return Journal(path, lifelong=directory != fallback)
    return Journal(":memory:", lifelong=False)


def observer(backend: Any, config: Any, *, user: str | None = None) -> tuple[Any, str]:
    """A Reconciler for dry runs that decides as the controller that runs now would, and a line saying whose
    settings it uses: the running daemon's (from its heartbeat) if one runs, else `config` (in user mode,
    scoped to `user`, with the user's own watch journal)."""
    import dataclasses

    from slurm_elastic.control.reconcile import Reconciler
    from slurm_elastic.control.state_dir import daemon_dir, read_heartbeat, user_dir

    beat = read_heartbeat(daemon_dir())
    if beat is not None and beat.fresh():
        config = dataclasses.replace(config.with_settings(beat.settings), user=None, node_confirm_s=0)
        said = ", ".join(f"{k} {v}" for k, v in sorted(beat.settings.items())) or "its settings unannounced"
        line = f"deciding with the running daemon's settings (pid {beat.pid} on {beat.host}: {said})"
        return Reconciler(backend, _read_only_journal(), config), line
    config = dataclasses.replace(config, user=user, node_confirm_s=0)
    line = (f"no daemon running: deciding with these settings (hysteresis_s {config.min_resize_interval_s:g}, "
            f"restart_budget_per_hour {config.restart_budget_per_hour}, "
            f"ack_timeout_s {config.protocol.ack_timeout_s:g}, speed {'measured' if config.measured_speed else 'linear'})")
    return Reconciler(backend, _read_only_journal(user_dir() if user else None), config), line


@click.group()
def admin() -> None:
    """Cluster-wide elastic control (operators; `status` is open to all).

    \b
    Examples:
      slurm-elastic admin status --json
      slurm-elastic admin rebalance --dry-run --explain
      slurm-elastic admin daemon --interval 10 --metrics-port 9464
      slurm-elastic admin install-plugin --slurm-conf /etc/slurm/slurm.conf --dry-run
    """


@admin.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (nodes, jobs, targets).")
@elastic_errors
def admin_status(as_json: bool) -> None:
    """Nodes (state, GPUs free/total) and elastic jobs with their current and target allocation.

    The target is what one reconcile cycle would choose now (a dry run: nothing changes).

    \b
    Examples:
      slurm-elastic admin status
      slurm-elastic admin status --json | jq '.jobs[] | select(.gpus != .target_gpus)'
    """
    from slurm_elastic.cluster.select import select_backend
    from slurm_elastic.control.reconcile import ControllerConfig
    from slurm_elastic.control.state_dir import daemon_dir, read_heartbeat

    backend = select_backend()
    state = backend.snapshot()
    reconciler, deciding = observer(backend, ControllerConfig())
    report = reconciler.cycle(dry_run=True)
    beat = read_heartbeat(daemon_dir())
    nodes = [{"name": n.name, "state": n.state.value, "flags": sorted(f.value for f in n.flags),
              "available": n.available, "gpus_total": n.gpus, "gpus_free": n.free.gpus, "reason": n.reason}
             for n in state.nodes]
    jobs = {j["job_id"]: j for j in report.to_json()["jobs"]}  # type: ignore[index]
    rows = []
    for job in state.elastic_jobs:
        spec = job.spec
        assert spec is not None
        info = jobs.get(job.job_id, {})
        rows.append({"job_id": job.job_id, "user": job.user, "name": job.name, "state": job.state.value,
                     "held": job.held, "gpus": job.gpus, "min_gpus": spec.min_gpus, "max_gpus": spec.max_gpus,
                     "target_gpus": info.get("target_gpus"), "pinned": info.get("pinned"),
                     "why": info.get("why"),
                     "nodes": list(job.nodes), "restarts": job.restarts,
                     "last_restart": _last_restart(job, reconciler.journal),
                     "slurm_end": _slurm_end(job)})
    daemon = None if beat is None else {"pid": beat.pid, "host": beat.host, "at": beat.at, "fresh": beat.fresh()}
    # Drains made on jobs' reports (--drain-on-peer-loss), from the daemon's journal where it is readable.
    drains = [d.to_json() for d in reconciler.journal.drains()]
    payload = {"nodes": nodes, "jobs": rows, "malformed": report.to_json()["malformed"], "daemon": daemon,
               "plans": report.to_json()["plans"], "settings": reconciler.config.settings(), "deciding": deciding,
               "drains": drains}
    if as_json:
        echo_json(payload)
        return
    click.echo(f"{'NODE':<10} {'STATE':<24} {'GPUS FREE/TOTAL':>15}")
    for n in nodes:
        st = "+".join([str(n["state"])] + [str(f) for f in n["flags"]])  # type: ignore[union-attr]
        click.echo(f"{n['name']:<10} {st:<24} {n['gpus_free']:>7}/{n['gpus_total']:<7}")
    click.echo("")
    if not rows:
        click.echo("no elastic jobs")
    else:
        click.echo(f"{'JOBID':>8} {'USER':<10} {'STATE':<10} {'GPUS':>4} {'TARGET':>6} {'MIN-MAX':>9}  NOTE")
        for r in rows:
            note = "held" if r["held"] else (r["why"] or "")
            tgt = "-" if r["target_gpus"] is None else r["target_gpus"]
            click.echo(f"{r['job_id']:>8} {str(r['user'])[:10]:<10} {r['state']:<10} {r['gpus']:>4} {tgt:>6} "
                       f"{str(r['min_gpus']) + '-' + str(r['max_gpus']):>9}  {note}")
    for r in rows:
        if r["last_restart"] is not None:
            click.echo(f"job {r['job_id']}: last restart: {r['last_restart']['line']}")
        if r["slurm_end"] is not None:
            click.echo(f"job {r['job_id']}: {r['slurm_end']['line']}")
    for m in payload["malformed"]:  # type: ignore[union-attr]
        click.echo(f"job {m['job_id']}: malformed elastic spec, never touched: {m['error']}")
    for d in drains:
        until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(d["until"])))  # type: ignore[arg-type]
        click.echo(f"node {d['node']}: drained on job {d['job_id']}'s report ({d['user']}) until {until}")
    if daemon is None:
        click.echo("daemon: not running (no heartbeat)")
    else:
        click.echo(f"daemon: pid {daemon['pid']} on {daemon['host']}, "
                   f"{'alive' if daemon['fresh'] else 'stale heartbeat'}")
    click.echo(deciding)


def _owner_uid(job: Any) -> int | None:
    import pwd

    if job.user_id is not None:
        return int(job.user_id)
    try:
        return pwd.getpwnam(job.user).pw_uid
    except KeyError:
        return None


def _last_restart(job: Any, journal: Any) -> dict[str, object] | None:
    """The phases of the controller's last restart of `job` (control/phases.py), for `admin status`."""
    from slurm_elastic.control.phases import last_restart

    phases = last_restart(job, journal, owner_uid=_owner_uid(job))
    return None if phases is None else {**phases.to_json(), "line": phases.line()}


def _slurm_end(job: Any) -> dict[str, object] | None:
    """How the job's previous incarnation ended when Slurm ended it (a time limit, a preemption), for `admin status`."""
    from slurm_elastic.control.phases import slurm_end

    return slurm_end(job, owner_uid=_owner_uid(job))


@admin.command("rebalance")
@click.option("--dry-run", is_flag=True, help="Only print the plans; change nothing (open to all users).")
@click.option("--json", "as_json", is_flag=True, help="Print the cycle report as JSON.")
@click.option("--explain", is_flag=True, help="Say why each job gets what it gets.")
@click.option("--job", "job_ids", type=int, multiple=True, help="Act only on these elastic jobs (repeatable).")
@controller_options(settings.REBALANCE)
@elastic_errors
def admin_rebalance(dry_run: bool, as_json: bool, explain: bool, job_ids: tuple[int, ...], interval: float,
                    ack_timeout: float, hysteresis: float, restart_budget: int, signal_name: str) -> None:
    """Run one reconcile cycle: snapshot, problem, solve, plan (the diff), act.

    Acting needs root, the SlurmUser or a Slurm operator/admin, and the
    daemon's lock (if the daemon runs, send it SIGHUP instead).

    \b
    Examples:
      slurm-elastic admin rebalance --dry-run --explain
      sudo -u slurm slurm-elastic admin rebalance --json --ack-timeout 30
      slurm-elastic admin rebalance --job 1234 --job 1240
    """
    from slurm_elastic.cluster.select import select_backend
    from slurm_elastic.control.journal import Journal
    from slurm_elastic.control.permissions import check_may_act
    from slurm_elastic.control.reconcile import Reconciler
    from slurm_elastic.control.state_dir import JOURNAL_FILE, InstanceLock, daemon_dir

    del interval
    config = controller_config(ack_timeout, hysteresis, restart_budget, signal_name)
    backend = select_backend()
    ids = frozenset(job_ids) if job_ids else None
    if ids:
        check_elastic_ids(backend.snapshot(), ids)
    if dry_run:
        # The dry run must agree with what the daemon will do: while one runs, its settings win.
        reconciler, deciding = observer(backend, config)
        report = reconciler.cycle(dry_run=True, job_ids=ids)
        _print_report(report, as_json=as_json, explain=explain, deciding=deciding)
        return
    else:
        check_may_act("admin rebalance")
        directory = daemon_dir()
        with InstanceLock(directory, "slurm-elastic controller (admin daemon or rebalance)"):
            journal = Journal(directory / JOURNAL_FILE)
            report = Reconciler(backend, journal, config).cycle(job_ids=ids)
    _print_report(report, as_json=as_json, explain=explain)


def _print_report(report: Any, *, as_json: bool, explain: bool, deciding: str | None = None) -> None:
    payload = report.to_json()
    if deciding is not None:
        payload["deciding"] = deciding
    if explain and report.allocation is not None:
        from slurm_elastic.allocate import render_explanation

        payload["explain"] = render_explanation(report.allocation)
    if as_json:
        echo_json(payload)
        return
    if deciding is not None:
        click.echo(deciding)
    for o in report.recovered:
        click.echo(f"recovered plan {o.plan_id} of job {o.job_id}: {o.status} {o.note}".rstrip())
    if not report.plans:
        click.echo("no changes: every elastic job already has its allocation")
    for plan in report.plans:
        prefix = "would change" if report.dry_run else "changed"
        click.echo(f"{prefix} {plan.describe()}")
    for o in report.outcomes:
        click.echo(f"job {o.job_id}: plan {o.plan_id} {o.status}"
                   f"{'' if o.acked is None else (' (checkpoint acked)' if o.acked else ' (no ACK)')} {o.note}".rstrip())
    for job_id, why in sorted(report.waits.items()):
        click.echo(f"job {job_id}: not resized now: {why}")
    for job_id, err in sorted(report.malformed.items()):
        click.echo(f"job {job_id}: malformed elastic spec, never touched: {err}")
    if explain and "explain" in payload:
        click.echo("")
        click.echo(str(payload["explain"]).rstrip())


@admin.command("daemon")
@controller_options(settings.DAEMON)
@click.option("--max-cycles", type=click.IntRange(min=1), default=None, hidden=True)
@elastic_errors
def admin_daemon(interval: float, ack_timeout: float, hysteresis: float, restart_budget: int, signal_name: str,
                 metrics_port: int | None, metrics_addr: str, speed: str, drain_on_peer_loss: bool,
                 drain_expiry: float, rigid_partitions: str, rigid_yield_after: float, elastic_minimum: str,
                 elastic_guarantee: str, max_cycles: int | None) -> None:
    """Run the reconcile loop until stopped (SIGTERM/SIGINT stop, SIGHUP wakes a cycle).

    State (journal, lock, heartbeat) lives in $SLURM_ELASTIC_DAEMON_DIR
    (default /var/lib/slurm-elastic); `slurm-elastic admin unit` prints a
    systemd unit that runs this installation's daemon.

    \b
    Examples:
      slurm-elastic -v admin daemon --interval 10 --metrics-port 9464
      SLURM_ELASTIC_DAEMON_DIR=/tmp/se slurm-elastic admin daemon --interval 3 --hysteresis 0
    """
    from slurm_elastic.cluster.select import select_backend
    from slurm_elastic.cluster.watch import JobRequeuedBySlurm, NodeGained, NodeLost, Watcher
    from slurm_elastic.control.daemon import Loop
    from slurm_elastic.control.journal import Journal
    from slurm_elastic.control.metrics import ControllerMetrics
    from slurm_elastic.control.permissions import check_may_act
    from slurm_elastic.control.reconcile import Reconciler
    from slurm_elastic.control.state_dir import JOURNAL_FILE, InstanceLock, daemon_dir

    why = check_may_act("admin daemon")
    config = dataclasses.replace(controller_config(ack_timeout, hysteresis, restart_budget, signal_name),
                                 measured_speed=speed == "measured", drain_on_peer_loss=drain_on_peer_loss,
                                 drain_expiry_s=drain_expiry,
                                 rigid=rigid_policy(rigid_partitions, rigid_yield_after, elastic_minimum,
                                                    elastic_guarantee))
    backend = select_backend()
    directory = daemon_dir()
    with InstanceLock(directory, "slurm-elastic controller (admin daemon or rebalance)"):
        journal = Journal(directory / JOURNAL_FILE)
        metrics = ControllerMetrics() if metrics_port else None
        if metrics is not None and metrics_port:
            metrics.serve(metrics_port, metrics_addr)
        loop = Loop(Reconciler(backend, journal, config), interval_s=interval, heartbeat_dir=directory,
                    metrics=metrics)
        loop.install_signal_handlers()
        watcher = Watcher()

        def node_changed() -> bool:
            events = watcher.observe(backend.snapshot())
            return any(isinstance(e, (NodeLost, NodeGained, JobRequeuedBySlurm)) for e in events)

        if interval > 5:
            # Between full cycles a cheap look at the nodes wakes the loop on a loss or gain.
            loop.start_node_watch(node_changed, every_s=min(5.0, interval / 2))
        click.echo(f"slurm-elastic daemon: pid {__import__('os').getpid()}, state in {directory}, "
                   f"interval {interval:g}s, allowed as {why}", err=True)
        loop.run(max_cycles=max_cycles)


@admin.command("unit")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the unit here instead of standard output.")
@elastic_errors
def admin_unit(output: Path | None) -> None:
    """Print the systemd unit for the daemon, its ExecStart this installation's slurm-elastic.

    \b
    Examples:
      slurm-elastic admin unit > /etc/systemd/system/slurm-elastic.service
      systemctl daemon-reload && systemctl enable --now slurm-elastic
    """
    from slurm_elastic.control.plugin import unit_file_source

    text = unit_file_source()
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror}") from None


@admin.command("install-plugin")
@click.option("--slurm-conf", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The slurm.conf to enable JobSubmitPlugins=lua in; job_submit.lua goes beside it.")
@click.option("--dry-run", is_flag=True, help="Only print what would change.")
@elastic_errors
def admin_install_plugin(slurm_conf: Path, dry_run: bool) -> None:
    """Install job_submit.lua (validates elastic specs, forces --requeue) and enable it.

    Prints each change; then run `scontrol reconfigure` (or restart slurmctld).

    \b
    Examples:
      slurm-elastic admin install-plugin --slurm-conf /etc/slurm/slurm.conf --dry-run
      sudo slurm-elastic admin install-plugin --slurm-conf /etc/slurm/slurm.conf
    """
    from slurm_elastic.control.plugin import apply_install, plan_install

    change = plan_install(slurm_conf)
    for line in change.lines():
        click.echo(("would " if dry_run else "") + line)
    if dry_run:
        return
    apply_install(change)
    if change.lua_action != "unchanged" or change.conf_after is not None:
        click.echo("now run: scontrol reconfigure (slurmctld reads JobSubmitPlugins at start/reconfigure)")
