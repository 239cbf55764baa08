"""JobEnvironment and the protocol names: every Slurm/torchrun variable read in one place."""

from __future__ import annotations

import pytest

from slurm_elastic.errors import ElasticError
from slurm_elastic import jobfiles as protocol
from slurm_elastic.train.environment import (
    JobEnvironment,
    first_hostname,
    group_backend,
    node_address,
)


def test_slurm_variables() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_STEP_NUM_NODES": "3", "SLURM_TASKS_PER_NODE": "3(x2),1", "SLURM_JOB_ID": "1234",
           "SLURM_RESTART_COUNT": "2", "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_NAME": "train"}
    e = JobEnvironment.from_env(env)
    assert (e.rank, e.world_size, e.local_rank, e.node_rank, e.num_nodes) == (5, 7, 1, 2, 3)
    assert e.local_world_size == 1            # node 2 of "3(x2),1"
    assert e.restart_count == 2 and e.job_id == "1234" and e.launcher == "slurm"
    assert e.master_addr == "localhost"
    assert e.master_port == 0                 # rank 0 publishes the kernel's choice (train/rendezvous.py)
    with pytest.raises(ElasticError, match="publishes its port"):
        e.init_method
    assert JobEnvironment.from_env({**env, "SLURM_NODEID": "0"}).local_world_size == 3
    given = JobEnvironment.from_env({**env, "MASTER_PORT": "29123", "SLURMD_NODENAME": "n7", "SLURM_STEP_ID": "3"})
    assert given.init_method == "tcp://localhost:29123"
    assert given.node_name == "n7" and given.step_id == 3


def test_torchrun_variables_win_over_slurm() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "x",
           "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h",
           "MASTER_PORT": "29400", "GROUP_RANK": "1"}
    e = JobEnvironment.from_env(env)
    assert (e.rank, e.world_size, e.local_rank, e.num_nodes, e.node_rank) == (5, 8, 1, 2, 1)
    assert e.launcher == "torchrun" and e.init_method == "env://" and e.job_id == "77"


def test_no_launcher_is_a_single_process() -> None:
    e = JobEnvironment.from_env({})
    assert (e.rank, e.world_size, e.launcher, e.job_id) == (0, 1, "single", "local")


def test_bad_numbers_are_reported() -> None:
    with pytest.raises(ElasticError, match="SLURM_NTASKS"):
        JobEnvironment.from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "four", "SLURM_STEP_NODELIST": "localhost"})


def test_hostnames() -> None:
    assert first_hostname("") is None
    assert first_hostname("gpu17") == "gpu17"
    assert node_address("localhost") == "localhost"
    assert node_address(None) is None


def test_protocol_names() -> None:
    assert protocol.ack_file_name(42, 3) == "ACK-42-3"
    assert protocol.ack_path("/ck", protocol.job_key(42), 42, 0) == "/ck/42/ACK-42-0"
    assert protocol.step_dir_name(7) == "step-0000000007"
    assert protocol.parse_step_dir_name("step-0000000007") == 7
    assert protocol.parse_step_dir_name("step-7.tmp") is None
    for bad in ("", "../x", "a/b", ".hidden"):
        with pytest.raises(ValueError):
            protocol.job_key(bad)
    assert protocol.signal_name("SIGUSR2") == protocol.signal_name("usr2") == protocol.signal_name("12") == "USR2"
    with pytest.raises(ValueError):
        protocol.signal_name("NOPE")
    assert protocol.REQUEUE_EXIT_CODE == 85


def test_peer_lost_report_round_trips_and_refuses_nonsense() -> None:
    import json

    report = protocol.PeerLostReport(job_id="12", restart_count=1, step_id=0, world_size=4, detected_by="heartbeat",
                                     detected_at=1.5, lost=(protocol.LostRank(2, "n2"), protocol.LostRank(3, "n2")),
                                     lost_nodes=("n2",), surviving_nodes=("n1",), agreed_step=9, commit="done",
                                     committed_step=9, reason="step 9 is the last step all 2 survivors completed")
    assert protocol.PeerLostReport.parse(json.dumps(report.to_json())) == report
    name = protocol.peer_lost_file_name(12, 1, 0)
    assert protocol.parse_peer_lost_file_name(name) == ("12", 1, 0)
    assert protocol.parse_peer_lost_file_name("peer-lost-12-1.json") is None
    bad = [{**report.to_json(), "lost_nodes": ["../etc"]}, {**report.to_json(), "commit": "maybe"},
           {**report.to_json(), "lost": [{"rank": 9, "node": "n2"}]}, {**report.to_json(), "format": "x"}]
    for body in bad:
        with pytest.raises(ValueError):
            protocol.PeerLostReport.parse(json.dumps(body))
    with pytest.raises(ValueError, match="not JSON"):
        protocol.PeerLostReport.parse(b"{")


def test_contract_package_imports_only_the_stdlib() -> None:
    import subprocess
    import sys

    code = ("import sys, slurm_elastic.jobfiles; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'highspy', 'scipy') "
            "or m.startswith(('slurm_elastic.train', 'slurm_elastic.allocate', 'slurm_elastic.control', "
            "'slurm_elastic.cluster'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(("requested", "cuda", "formed"), [
    (None, False, "gloo"),
    (None, True, "cpu:gloo,cuda:nccl"),
    ("nccl", True, "cpu:gloo,cuda:nccl"),
    ("gloo", True, "gloo"),
    ("cuda:nccl", True, "cpu:gloo,cuda:nccl"),
    ("cpu:gloo,cuda:nccl", True, "cpu:gloo,cuda:nccl"),
])
def test_the_process_group_always_has_a_cpu_backend_for_the_sessions_own_collectives(requested, cuda, formed) -> None:
    """A group formed as plain "nccl" has no CPU backend, and the session's per-step agreement (a CPU
    tensor) would fail on every GPU job ("No backend type associated with device type cpu")."""
    import torch.distributed as dist

    assert group_backend(requested, cuda=cuda) == formed
    assert "cpu" in dist.distributed_c10d.BackendConfig(dist.Backend(formed)).get_device_backend_map()
