"""Render slurm.conf, gres.conf and cgroup.conf for a local cluster (pure text, no side effects)."""

from __future__ import annotations

from slurm_elastic.devcluster.layout import PREEMPT_PARTITION, ClusterLayout
from slurm_elastic.devcluster.version import SlurmVersion

SPARE_REASON = "spare: not started (slurm-elastic cluster node-up NAME)"


def render_slurm_conf(layout: ClusterLayout, version: SlurmVersion) -> str:
    """slurm.conf for one slurmctld and one `slurmd -N nX` per node, all on 127.0.0.1.

    The settings are the ones recorded in slurm-versions.md as working on
    22.05, 24.11 and 26.05; nothing here differs by version (cgroup.conf does).
    """
    d = layout
    lines = [
        "# Written by `slurm-elastic cluster up`; regenerated on every `up`.",
        f"# Slurm {version}",
        f"ClusterName={d.cluster_name}",
        # localhost is accepted as the controller name on every version even when
        # the machine's own hostname does not resolve.
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={d.ctld_port}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={d.munge_socket}",
        f"StateSaveLocation={d.ctld_state_dir}",
        f"SlurmctldPidFile={d.ctld_pid}",
        f"SlurmctldLogFile={d.ctld_log}",
        f"SlurmdSpoolDir={d.spool_root}/%n",
        f"SlurmdPidFile={d.run_dir}/slurmd-%n.pid",
        f"SlurmdLogFile={d.log_dir}/slurmd-%n.log",
        # Nodes may claim more CPUs and memory than the host has.
        "SlurmdParameters=config_overrides",
        # Every daemon binds 127.0.0.1 only: NoInAddrAny covers the slurmds (so several
        # share one host), NoCtldInAddrAny slurmctld, which otherwise listens on 0.0.0.0.
        "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        "GresTypes=gpu",
        "SchedulerType=sched/backfill",
        # The main loop runs every 60 s by default; a short interval lets a
        # released or requeued job start within seconds on this small cluster.
        "SchedulerParameters=batch_sched_delay=0,sched_interval=5,bf_interval=5"
        + (",preempt_send_user_signal" if d.preemption and not _has_preempt_parameters(version) else ""),
        "JobRequeue=1",
        # A DOWN node returns to service as soon as its slurmd registers again.
        "ReturnToService=2",
        f"SlurmdTimeout={d.slurmd_timeout}",
        "SlurmctldTimeout=30",
        # Keep finished jobs visible to squeue/scontrol for 5 minutes.
        "MinJobAge=300",
        "MpiDefault=none",
        "MailProg=/bin/true",
        # No accounting: the defaults (none) are spelled differently across
        # versions, so they are left unset.
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    if d.job_submit_lua:
        lines.append("JobSubmitPlugins=lua")
    if d.expedited_requeue:
        # Lets jobs ask for `--requeue=expedite` (25.11 on): without it slurmctld refuses such a submission.
        lines.append("SlurmctldParameters=enable_expedited_requeue")
    if d.preemption:
        lines += [
            "PreemptType=preempt/partition_prio",
            f"PreemptMode={d.preempt_mode}",
        ]
        if _has_preempt_parameters(version):
            # A preempted job gets its own --signal (an elastic job's checkpoint signal) at once, not
            # SIGTERM, which would end the ranks before they commit (22.05: preempt_send_user_signal above).
            lines.append("PreemptParameters=send_user_signal")
    lines.append("")
    for node in d.node_specs:
        line = (
            f"NodeName={node.name} NodeAddr=127.0.0.1 NodeHostname=localhost Port={node.port} "
            f"CPUs={node.cpus} RealMemory={node.memory_mb}"
        )
        if node.gpus:
            line += f" Gres=gpu:{node.gpus}"
        if node.spare:
            # A spare shows as DOWN until `node-up` starts its slurmd, which
            # (ReturnToService=2) brings it to IDLE: a node gained.
            line += f' State=DOWN Reason="{SPARE_REASON}"'
        lines.append(line)
    partition = f"PartitionName={d.partition} Nodes={','.join(d.node_names)} Default=YES MaxTime=INFINITE State=UP"
    if d.preemption:
        partition += f" PriorityTier=1 PreemptMode={d.preempt_mode} GraceTime={d.grace_time_s}"
    lines.append(partition)
    if d.preemption:
        lines.append(f"PartitionName={PREEMPT_PARTITION} Nodes={','.join(d.node_names)} MaxTime=INFINITE State=UP "
                     "PriorityTier=2 PreemptMode=OFF")
    return "\n".join(lines) + "\n"


def _has_preempt_parameters(version: SlurmVersion) -> bool:
    """22.05's slurmctld refuses the PreemptParameters key (seen: fatal at start); 24.11 and 26.05 have it."""
    return (version.major, version.minor) >= (23, 2)


def render_gres_conf(layout: ClusterLayout) -> str:
    """gres.conf with one character-device file per GPU, so Slurm sets CUDA_VISIBLE_DEVICES too."""
    lines = ["# Written by `slurm-elastic cluster up`.", "AutoDetect=off"]
    for node in layout.node_specs:
        if node.gpus:
            index = f"[0-{node.gpus - 1}]" if node.gpus > 1 else "0"
            files = f"{layout.dev_dir}/{node.name}gpu{index}"
            lines.append(f"NodeName={node.name} Name=gpu File={files}")
    return "\n".join(lines) + "\n"


def render_cgroup_conf(version: SlurmVersion) -> str | None:
    """cgroup.conf for Slurm >= 23.11 (else slurmd autodetects cgroups and may fail); None before."""
    if not version.needs_cgroup_conf:
        return None
    return "# Written by `slurm-elastic cluster up`.\nCgroupPlugin=disabled\n"
