"""`slurm-elastic cluster`: the embedded local multi-node Slurm on loopback."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import click

from slurm_elastic.cli._common import echo_json, elastic_errors
from slurm_elastic.devcluster import ClusterAlreadyUp, ClusterStatus, LocalCluster, UnknownNode
from slurm_elastic.devcluster.local import require_root
from slurm_elastic.devcluster.layout import (
    CLUSTER_DIR_ENV,
    DEFAULT_PORT_BASE,
    DEFAULT_GRACE_TIME_S,
    DEFAULT_SLURMD_TIMEOUT_S,
    MAX_GRACE_TIME_S,
    MAX_SLURMD_TIMEOUT_S,
    PREEMPT_PARTITION,
    UnusableStateDir,
)

F = TypeVar("F", bound=Callable[..., Any])

state_dir_option = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help=f"Where the cluster keeps its configuration, logs and state "
    f"[default: ${CLUSTER_DIR_ENV}, else $XDG_STATE_HOME/slurm-elastic/cluster].",
)


def _cluster(state_dir: Path | None) -> LocalCluster:
    return LocalCluster(state_dir)


def _existing(state_dir: Path | None, *, readable_layout: bool = True) -> LocalCluster:
    local = _cluster(state_dir)
    if not local.exists():
        raise click.UsageError(f"no local cluster in {local.state_dir}; start one with `slurm-elastic cluster up`")
    if readable_layout:
        local.layout  # a garbled cluster.json is one line here, before any command acts on it
    return local


def _bad_input(func: F) -> F:
    """Conflicts the user fixes by changing the command (unknown node, already up) exit 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (UnknownNode, ClusterAlreadyUp, UnusableStateDir) as exc:
            raise click.UsageError(str(exc)) from None

    return wrapper  # type: ignore[return-value]


def _echo_table(status: ClusterStatus) -> None:
    state = "up" if status.running else "stopped"
    click.echo(f"Slurm {status.slurm_version} local cluster ({state}), SLURM_CONF={status.slurm_conf}")
    click.echo(f"{'NODE':<6} {'STATE':<24} {'GPUS':>4} {'CPUS':>4} {'MEM_MB':>7} {'PORT':>5}  SLURMD")
    for node in status.nodes:
        slurmd = f"pid {node.slurmd_pid}" if node.started else ("spare, not started" if node.spare else "not running")
        click.echo(
            f"{node.name:<6} {node.state:<24} {node.gpus:>4} {node.cpus:>4} {node.memory_mb:>7} "
            f"{node.port:>5}  {slurmd}"
        )


@click.group()
def cluster() -> None:
    """A real multi-node Slurm on 127.0.0.1 for the demo, tests and newcomers.

    One slurmctld, one `slurmd -N nX` per node and a private munged, all
    started as root, with fake GPUs (Gres=gpu:N backed by character devices).
    Spare nodes are configured but not started: `node-up` on a spare is a
    node gained; `node-down` SIGKILLs a node's slurmd (a real node failure).

    \b
    Examples:
      sudo slurm-elastic cluster up
      eval "$(slurm-elastic cluster env)"     # or: export SLURM_CONF=...
      slurm-elastic cluster status --json
      slurm-elastic cluster node-down n2      # DOWN in sinfo ~30 s later
      slurm-elastic cluster node-up n2
      slurm-elastic cluster node-up n5        # start a spare: a node gained
      slurm-elastic cluster down
    """


@cluster.command("up")
@state_dir_option
@click.option("--nodes", type=click.IntRange(1, 64), default=4, show_default=True, help="Nodes started now.")
@click.option(
    "--spares", type=click.IntRange(0, 64), default=2, show_default=True,
    help="Extra nodes configured DOWN, started by node-up.",
)
@click.option("--gpus", "gpus_per_node", type=click.IntRange(0, 64), default=4, show_default=True,
              help="GPUs per node.")
@click.option("--cpus", "cpus_per_node", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="CPUs per node.")
@click.option("--mem-mb", "memory_mb", type=click.IntRange(100), default=16000, show_default=True,
              help="RealMemory per node (MB).")
@click.option("--port-base", type=click.IntRange(1024, 65000), default=DEFAULT_PORT_BASE, show_default=True,
              help="slurmctld port; node i listens on port-base+3+i.")
@click.option("--job-submit-lua", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="Install this job_submit.lua and set JobSubmitPlugins=lua.")
@click.option("--timeout", type=click.FloatRange(1), default=60.0, show_default=True,
              help="Seconds to wait for IDLE nodes.")
@click.option("--slurmd-timeout", type=click.IntRange(1, MAX_SLURMD_TIMEOUT_S), default=DEFAULT_SLURMD_TIMEOUT_S,
              show_default=True,
              help="SlurmdTimeout: seconds before Slurm calls a silent node DOWN (many sites run 300).")
@click.option("--expedited-requeue", is_flag=True,
              help="SlurmctldParameters=enable_expedited_requeue (Slurm 25.11 on): jobs may use --requeue=expedite.")
@click.option("--preempt-mode", type=click.Choice(["requeue", "cancel"], case_sensitive=False), default=None,
              help=f"Configure Slurm preemption: jobs of partition '{PREEMPT_PARTITION}' preempt the default "
                   "partition's (PreemptType=preempt/partition_prio, this PreemptMode).")
@click.option("--grace-time", "grace_time_s", type=click.IntRange(0, MAX_GRACE_TIME_S), default=DEFAULT_GRACE_TIME_S,
              show_default=True, help="GraceTime of the preempted partition: seconds a preempted job gets to leave.")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON instead of the export line.")
@elastic_errors
@_bad_input
def cluster_up(
    state_dir: Path | None,
    nodes: int,
    spares: int,
    gpus_per_node: int,
    cpus_per_node: int,
    memory_mb: int,
    port_base: int,
    job_submit_lua: Path | None,
    timeout: float,
    slurmd_timeout: int,
    expedited_requeue: bool,
    preempt_mode: str | None,
    grace_time_s: int,
    as_json: bool,
) -> None:
    """Start munged, slurmctld and the slurmd of each node; return when all are IDLE.

    Prints the `export SLURM_CONF=...` line (also written to <state-dir>/env).

    \b
    Examples:
      slurm-elastic cluster up
      slurm-elastic cluster up --nodes 8 --spares 2 --gpus 8
      slurm-elastic cluster up --slurmd-timeout 300   # a site's usual node timeout
    """
    started = time.monotonic()
    status = _cluster(state_dir).up(
        nodes=nodes,
        spares=spares,
        gpus_per_node=gpus_per_node,
        cpus_per_node=cpus_per_node,
        memory_mb=memory_mb,
        port_base=port_base,
        job_submit_lua=job_submit_lua,
        timeout=timeout,
        slurmd_timeout=slurmd_timeout,
        expedited_requeue=expedited_requeue,
        preempt_mode=(preempt_mode or "").upper(),
        grace_time_s=grace_time_s,
    )
    elapsed = time.monotonic() - started
    if as_json:
        echo_json({**status.to_dict(), "up_s": round(elapsed, 3)})
        return
    serving = sum(1 for node in status.nodes if node.serving)
    click.echo(
        f"# Slurm {status.slurm_version}: {serving} nodes idle, {len(status.nodes) - serving} spare, "
        f"up in {elapsed:.2f} s; env file {status.env_file}",
        err=True,
    )
    click.echo(f"export SLURM_CONF={status.slurm_conf}")


@cluster.command("down")
@state_dir_option
@elastic_errors
def cluster_down(state_dir: Path | None) -> None:
    """Cancel all jobs, stop every daemon, and check that no process of the cluster is left.

    \b
    Example:
      slurm-elastic cluster down
    """
    # down stops what runs here even when cluster.json is garbled (else nothing could stop it).
    require_root("down", "its daemons are root's")  # before reading a state dir only root may read
    local = _existing(state_dir, readable_layout=False)
    started = time.monotonic()
    stopped = local.down()
    if stopped:
        click.echo(f"stopped {len(stopped)} processes in {time.monotonic() - started:.2f} s; nothing left running")
    else:
        click.echo(f"the local cluster in {local.state_dir} was not running")


@cluster.command("status")
@state_dir_option
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable: slurm_conf, slurm_version, state_dir, nodes[].")
@elastic_errors
def cluster_status(state_dir: Path | None, as_json: bool) -> None:
    """Show each node's Slurm state, GPUs and whether its slurmd runs.

    \b
    Example:
      slurm-elastic cluster status --json
    """
    status = _existing(state_dir).status()
    if as_json:
        echo_json(status.to_dict())
    else:
        _echo_table(status)


@cluster.command("env")
@state_dir_option
@elastic_errors
def cluster_env(state_dir: Path | None) -> None:
    """Print `export SLURM_CONF=...` for the shell.

    \b
    Example:
      eval "$(slurm-elastic cluster env)" && sinfo
    """
    local = _existing(state_dir)
    for key, value in local.env().items():
        click.echo(f"export {key}={value}")


@cluster.command("node-down")
@state_dir_option
@click.argument("name")
@click.option("--mark-down", is_flag=True, help="Also set the node DOWN at once (scontrol), as an admin would.")
@click.option("--freeze", is_flag=True, help="SIGSTOP instead of SIGKILL: a hung node, whose connections stay open.")
@elastic_errors
@_bad_input
def cluster_node_down(state_dir: Path | None, name: str, mark_down: bool, freeze: bool) -> None:
    """SIGKILL node NAME's slurmd and its jobs' processes: a real node failure.

    Slurm marks the node DOWN on its own once SlurmdTimeout runs out (about
    30 s with the default 10 s); `--requeue` jobs on it go back to PENDING.
    With --freeze they are stopped, not killed (`node-down` again kills them).

    \b
    Examples:
      slurm-elastic cluster node-down n2
      slurm-elastic cluster node-down --freeze n2    # then: node-down n2 && node-up n2
    """
    require_root("node-down", "its daemons are root's")
    local = _existing(state_dir)
    pid = local.node_down(name, mark_down=mark_down, freeze=freeze)
    when = "now" if mark_down else f"once SlurmdTimeout ({local.layout.slurmd_timeout} s) runs out"
    click.echo(f"{'froze' if freeze else 'killed'} slurmd of {name} (pid {pid}); Slurm marks it DOWN {when}")


@cluster.command("node-up")
@state_dir_option
@click.argument("name")
@click.option("--no-wait", is_flag=True, help="Return right after starting slurmd.")
@click.option("--timeout", type=click.FloatRange(1), default=30.0, show_default=True)
@elastic_errors
@_bad_input
def cluster_node_up(state_dir: Path | None, name: str, no_wait: bool, timeout: float) -> None:
    """Start node NAME's slurmd (again, or a spare's for the first time: a node gained).

    \b
    Examples:
      slurm-elastic cluster node-up n2
      slurm-elastic cluster node-up n5      # a spare: the cluster gains a node
    """
    require_root("node-up", "slurmd runs jobs as their users")
    local = _existing(state_dir)
    started = time.monotonic()
    pid = local.node_up(name, wait=not no_wait, timeout=timeout)
    state = "started" if no_wait else f"in service after {time.monotonic() - started:.2f} s"
    click.echo(f"{name}: slurmd pid {pid}, {state}")

