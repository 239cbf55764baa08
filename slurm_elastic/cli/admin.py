"""`slurm-elastic admin`: cluster-wide status, rebalancing and the controller daemon."""

from __future__ import annotations

import click

from slurm_elastic.cli._common import not_implemented


@click.group()
def admin() -> None:
    """Cluster-wide elastic control (operators; `status` is open to all).

    \b
    Examples:
      slurm-elastic admin status --json
      slurm-elastic admin rebalance --dry-run --explain
      slurm-elastic admin daemon --interval 10 --metrics-port 9464
    """


@admin.command("status")
def admin_status() -> None:
    """Nodes and elastic jobs with their current and target allocation."""
    not_implemented("admin status")


@admin.command("rebalance")
def admin_rebalance() -> None:
    """Run one reconcile cycle (snapshot, solve, plan, act)."""
    not_implemented("admin rebalance")


@admin.command("daemon")
def admin_daemon() -> None:
    """Run the reconcile loop until stopped."""
    not_implemented("admin daemon")
