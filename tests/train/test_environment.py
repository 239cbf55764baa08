"""JobEnvironment and the protocol names: every Slurm/torchrun variable read in one place."""

from __future__ import annotations

import pytest

from slurm_elastic.errors import ElasticError
from slurm_elastic.train import protocol
from slurm_elastic.train.environment import (
    JobEnvironment,
    derived_port,
    first_hostname,
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
    assert e.master_addr == "localhost" and e.master_port == derived_port("1234", 2)
    assert e.init_method == f"tcp://localhost:{e.master_port}"
    assert JobEnvironment.from_env({**env, "SLURM_NODEID": "0"}).local_world_size == 3


def test_port_is_shared_by_all_ranks_and_moves_with_the_restart() -> None:
    assert derived_port("991", 0) == derived_port("991", 0)
    assert derived_port("991", 0) != derived_port("991", 1)
    assert 20000 <= derived_port("4294967295", 7) < 30000


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


def test_protocol_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, slurm_elastic.train.protocol; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
