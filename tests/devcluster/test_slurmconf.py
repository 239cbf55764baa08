"""slurm.conf / gres.conf / cgroup.conf as rendered for 22.05 and for 23.11 and later."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.devcluster.layout import ClusterLayout
from slurm_elastic.devcluster.slurmconf import (
    SPARE_REASON,
    render_cgroup_conf,
    render_gres_conf,
    render_slurm_conf,
)
from slurm_elastic.devcluster.version import SlurmVersion

V22 = SlurmVersion(22, 5, 8)
V24 = SlurmVersion(24, 11, 5)
V26 = SlurmVersion(26, 5, 5)


def _layout(**kwargs: object) -> ClusterLayout:
    return ClusterLayout(state_dir=Path("/srv/dc"), slurm_version="22.05.8", **kwargs)  # type: ignore[arg-type]


def _settings(text: str) -> dict[str, str]:
    pairs = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and not line.startswith(("NodeName=", "PartitionName=")):
            key, _, value = line.partition("=")
            pairs[key] = value
    return pairs


@pytest.mark.parametrize("version", [V22, V24, V26])
def test_slurm_conf_has_the_settings_every_version_needs(version: SlurmVersion) -> None:
    conf = _settings(render_slurm_conf(_layout(), version))
    assert conf["SlurmdParameters"] == "config_overrides"
    # slurmds and slurmctld bind 127.0.0.1 only (without NoCtldInAddrAny slurmctld listens on 0.0.0.0).
    assert conf["CommunicationParameters"].split(",") == ["NoInAddrAny", "NoCtldInAddrAny"]
    assert conf["ProctrackType"] == "proctrack/linuxproc"
    assert conf["TaskPlugin"] == "task/none"
    assert conf["SelectType"] == "select/cons_tres"
    assert conf["SelectTypeParameters"] == "CR_Core_Memory"
    assert conf["GresTypes"] == "gpu"
    assert conf["AuthType"] == "auth/munge"
    assert conf["AuthInfo"] == "socket=" + str(_layout().munge_socket)
    assert conf["JobRequeue"] == "1"
    assert conf["ReturnToService"] == "2"
    assert conf["SlurmdTimeout"] == "10"
    assert conf["MinJobAge"] == "300"
    assert conf["SlurmdSpoolDir"] == "/srv/dc/spool/%n"
    assert conf["SlurmdPidFile"].endswith("slurmd-%n.pid")
    assert conf["SlurmdLogFile"].endswith("slurmd-%n.log")
    assert "JobSubmitPlugins" not in conf


def test_slurmd_timeout_is_the_layouts() -> None:
    assert _settings(render_slurm_conf(_layout(slurmd_timeout=300), V22))["SlurmdTimeout"] == "300"


def test_cgroup_conf_only_from_23_11() -> None:
    assert render_cgroup_conf(V22) is None
    assert render_cgroup_conf(SlurmVersion(23, 2, 7)) is None
    for version in (SlurmVersion(23, 11, 0), V24, V26):
        text = render_cgroup_conf(version)
        assert text is not None and "CgroupPlugin=disabled" in text.splitlines()


def test_one_node_line_per_node_with_its_own_port_and_spares_down() -> None:
    text = render_slurm_conf(_layout(nodes=3, spares=2, gpus_per_node=2, cpus_per_node=16, memory_mb=32000,
                                     port_base=7000), V22)
    nodes = [line for line in text.splitlines() if line.startswith("NodeName=")]
    assert [line.split()[0] for line in nodes] == [f"NodeName=n{i}" for i in range(1, 6)]
    assert [line.split("Port=")[1].split()[0] for line in nodes] == ["7004", "7005", "7006", "7007", "7008"]
    assert "SlurmctldPort=7000" in text.splitlines()
    for line in nodes:
        assert "NodeAddr=127.0.0.1" in line and "NodeHostname=localhost" in line
        assert "CPUs=16 RealMemory=32000 Gres=gpu:2" in line
    assert ["State=DOWN" in line for line in nodes] == [False, False, False, True, True]
    assert SPARE_REASON in nodes[-1]
    partition = [line for line in text.splitlines() if line.startswith("PartitionName=")]
    assert partition == ["PartitionName=gpu Nodes=n1,n2,n3,n4,n5 Default=YES MaxTime=INFINITE State=UP"]


def test_gpu_less_nodes_have_no_gres() -> None:
    layout = _layout(gpus_per_node=0, spares=0)
    assert "Gres=" not in render_slurm_conf(layout, V22)
    assert [line for line in render_gres_conf(layout).splitlines() if line.startswith("NodeName")] == []


def test_gres_conf_names_one_device_file_per_gpu() -> None:
    layout = _layout(nodes=2, spares=1, gpus_per_node=4)
    lines = render_gres_conf(layout).splitlines()
    assert "AutoDetect=off" in lines
    assert "NodeName=n1 Name=gpu File=/srv/dc/dev/n1gpu[0-3]" in lines
    assert "NodeName=n3 Name=gpu File=/srv/dc/dev/n3gpu[0-3]" in lines
    single = render_gres_conf(_layout(nodes=1, spares=0, gpus_per_node=1)).splitlines()
    assert "NodeName=n1 Name=gpu File=/srv/dc/dev/n1gpu0" in single
    assert layout.gpu_files("n2") == tuple(Path(f"/srv/dc/dev/n2gpu{i}") for i in range(4))


def test_job_submit_lua_turns_the_plugin_on() -> None:
    conf = _settings(render_slurm_conf(_layout(job_submit_lua=True), V24))
    assert conf["JobSubmitPlugins"] == "lua"
    assert _layout().job_submit_lua_path == Path("/srv/dc/etc/job_submit.lua")


def test_no_preemption_unless_asked() -> None:
    text = render_slurm_conf(_layout(), V22)
    assert "Preempt" not in text and "urgent" not in text


@pytest.mark.parametrize("mode", ["REQUEUE", "CANCEL"])
def test_preemption_puts_a_higher_tier_partition_over_the_same_nodes(mode: str) -> None:
    text = render_slurm_conf(_layout(preempt_mode=mode, grace_time_s=45), V24)
    conf = _settings(text)
    assert conf["PreemptType"] == "preempt/partition_prio"
    assert conf["PreemptMode"] == mode
    # The job's own --signal, not SIGTERM, at preemption: 24.11 on in PreemptParameters, 22.05 in SchedulerParameters.
    assert conf["PreemptParameters"] == "send_user_signal"
    assert "preempt_send_user_signal" not in conf["SchedulerParameters"]
    old = _settings(render_slurm_conf(_layout(preempt_mode=mode), V22))
    assert "PreemptParameters" not in old and old["SchedulerParameters"].endswith(",preempt_send_user_signal")
    parts = {line.split()[0]: dict(f.split("=", 1) for f in line.split()) for line in text.splitlines()
             if line.startswith("PartitionName=")}
    gpu, urgent = parts["PartitionName=gpu"], parts["PartitionName=urgent"]
    assert (gpu["PriorityTier"], gpu["PreemptMode"], gpu["GraceTime"]) == ("1", mode, "45")
    assert (urgent["PriorityTier"], urgent["PreemptMode"]) == ("2", "OFF")
    assert urgent["Nodes"] == gpu["Nodes"] and "Default" not in urgent


@pytest.mark.parametrize(("kwargs", "says"), [({"preempt_mode": "SUSPEND"}, "--preempt-mode must be REQUEUE or CANCEL"),
                                              ({"preempt_mode": "REQUEUE", "grace_time_s": -1}, "--grace-time"),
                                              ({"preempt_mode": "REQUEUE", "partition": "urgent"}, "cannot be named")])
def test_a_bad_preemption_layout_is_refused(kwargs: dict, says: str) -> None:
    from slurm_elastic.errors import ClusterSetupError

    with pytest.raises(ClusterSetupError, match=says):
        _layout(**kwargs)
