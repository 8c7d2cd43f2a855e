"""Launcher conventions -> LaunchEnv, without processes."""

from __future__ import annotations

import pytest

from phalanx.comm.env import discover_env, first_slurm_host


def test_no_launcher_is_a_world_of_one() -> None:
    env = discover_env({})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (0, 1, 0, "none")


def test_phalanx_run_environment() -> None:
    env = discover_env(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "1234",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "PHALANX_RESTART_COUNT": "2",
            "PHALANX_RUN_ID": "x",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert (env.node_rank, env.master_addr, env.master_port) == (1, "10.0.0.1", 1234)
    assert env.agent_store and env.restart_count == 2 and env.source == "phalanx"


def test_torchrun_and_kubeflow_sources() -> None:
    base = {"RANK": "0", "WORLD_SIZE": "2"}
    assert discover_env({**base, "TORCHELASTIC_RUN_ID": "r"}).source == "torchrun"
    kube = discover_env({**base, "PET_NNODES": "2", "MASTER_ADDR": "job-master-0"})
    assert kube.source == "kubeflow" and kube.local_world_size == 1 and kube.node_rank == 0


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node07", "node07"), ("gpu[03-05,9],cpu1", "gpu03"), ("a[1,2]", "a1"), ("x-1,x-2", "x-1")],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


def test_slurm_environment() -> None:
    env = discover_env(
        {
            "SLURM_PROCID": "3",
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_TASKS_PER_NODE": "2(x2)",
            "SLURM_NODELIST": "trn[12-13]",
            "SLURM_JOB_ID": "123456",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.node_rank, env.master_addr, env.source) == (1, "trn12", "slurm")
    assert env.master_port == 20000 + 123456 % 20000


def test_openmpi_environment() -> None:
    env = discover_env(
        {
            "OMPI_COMM_WORLD_RANK": "6",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "MASTER_ADDR": "h0",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.node_rank) == (6, 8, 2, 1)
    assert env.source == "openmpi" and env.master_addr == "h0"


def test_bad_integer_names_the_variable() -> None:
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        discover_env({"RANK": "0", "WORLD_SIZE": "two"})
