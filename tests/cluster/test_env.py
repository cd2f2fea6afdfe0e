"""The environment the launcher gives its workers: every transport on loopback for one node, NCCL's hang tooling for nccl."""

from __future__ import annotations

import os
from pathlib import Path

from launcher.cluster.env import LOOPBACK_INTERFACE_VARIABLES, worker_environment
from launcher.config.compose import compose_and_validate
from launcher.config.plan import Plan
from launcher.launch.elastic import nccl_trace_prefix

PREFIX = "/runs/r/.dlaunch/nccl_trace_rank_"
NCCL = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": PREFIX,
}


def test_an_nccl_job_gets_async_error_handling_and_the_flight_recorder():
    extra = worker_environment(single_node=True, nccl_trace_prefix=PREFIX, environ={})
    assert {k: extra[k] for k in NCCL} == NCCL
    assert extra["GLOO_SOCKET_IFNAME"].startswith("lo") and extra["OMP_NUM_THREADS"] == "1"


def test_what_the_user_set_is_kept_under_any_of_its_names():
    user = {"NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_", "OMP_NUM_THREADS": "4"}
    extra = worker_environment(single_node=False, nccl_trace_prefix=PREFIX, environ=user)
    assert not set(NCCL) & set(extra), "each of these was set by the user, under this name or torch's other one"
    assert extra["OMP_NUM_THREADS"] == "4" and "GLOO_SOCKET_IFNAME" not in extra


def test_a_gloo_job_gets_no_nccl_settings():
    assert not any(k.startswith(("TORCH_NCCL", "TORCH_FR")) for k in worker_environment(single_node=True, environ={}))


def test_the_dumps_go_to_the_run_directory_when_the_backend_is_nccl(tmp_path):
    cuda = compose_and_validate(["strategy=mirrored", "cluster=1x2", "cluster.device=cuda"], cuda_devices=2)
    assert nccl_trace_prefix(Plan.resolve(cuda, 2), tmp_path) == str(tmp_path.resolve() / ".dlaunch" / "nccl_trace_rank_")
    cpu = compose_and_validate(["strategy=mirrored", "cluster=1x2"], cuda_devices=0)
    assert nccl_trace_prefix(Plan.resolve(cpu, 0), Path("r")) is None


def test_single_node_collectives_stay_on_loopback(monkeypatch):
    for name in LOOPBACK_INTERFACE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    env = worker_environment(single_node=True)
    assert {env[name] for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")} == {env["GLOO_SOCKET_IFNAME"]}
    assert env["GLOO_SOCKET_IFNAME"].startswith("lo")


def test_a_users_interface_wins_and_several_nodes_use_the_network(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert worker_environment(single_node=True)["NCCL_SOCKET_IFNAME"] == "ib0"
    assert not set(LOOPBACK_INTERFACE_VARIABLES) & set(worker_environment(single_node=False))


def test_each_emulated_node_of_a_cuda_job_sees_gpus_of_its_own():
    """cluster=2x4 on one 8-GPU machine: node 1's local ranks 0-3 are GPUs 4-7, not node 0's again."""
    from launcher.cluster.env import emulated_node_devices

    assert [emulated_node_devices(n, 4, {}) for n in (0, 1)] == [{"CUDA_VISIBLE_DEVICES": "0,1,2,3"},
                                                                  {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}]
    mine = {"CUDA_VISIBLE_DEVICES": "6,7,2,3"}  # the user's own choice: sliced, in its order
    assert [emulated_node_devices(n, 2, mine) for n in (0, 1)] == [{"CUDA_VISIBLE_DEVICES": "6,7"},
                                                                  {"CUDA_VISIBLE_DEVICES": "2,3"}]


def test_a_worker_started_by_srun_or_mpirun_takes_its_rank_on_the_node_from_them():
    """Rank 12 of a 2x8 job is local rank 4 (cuda:4), not cuda:12; RANK alone stands only where nothing else tells."""
    from launcher.cluster.env import WorkerEnv

    base = {"RANK": "12", "WORLD_SIZE": "16"}
    srun = WorkerEnv.from_environ({**base, "SLURM_LOCALID": "4", "SLURM_NTASKS_PER_NODE": "8"})
    mpirun = WorkerEnv.from_environ({**base, "OMPI_COMM_WORLD_LOCAL_RANK": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"})
    torchrun = WorkerEnv.from_environ({**base, "LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "8", "SLURM_LOCALID": "0"})
    assert [(e.local_rank, e.local_world_size) for e in (srun, mpirun, torchrun)] == [(4, 8)] * 3
    alone = WorkerEnv.from_environ(base)
    assert (alone.local_rank, alone.local_world_size) == (12, 16)


def test_the_rank_on_the_node_and_the_processes_on_it_come_from_one_launcher():
    """torchrun's LOCAL_RANK inside a SLURM allocation of one task per node: 8 processes here, not SLURM's 1."""
    from launcher.cluster.env import WorkerEnv

    env = WorkerEnv.from_environ({"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "SLURM_NTASKS_PER_NODE": "1"})
    assert (env.local_rank, env.local_world_size) == (3, 16)  # torchrun's size unset: the world, as before


def test_the_cpp_log_level_set_on_a_guess_of_several_nodes_is_unset_again_but_a_users_stays(monkeypatch):
    """The console script guesses several nodes from the command line; a job validated to one node (a shape given
    twice, cluster.nodes from the environment) must not hand its workers the quieted level."""
    from launcher.cluster import env as env_lib

    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    monkeypatch.setattr(env_lib, "_QUIETED", [])
    env_lib.quiet_cpp_warnings()
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    env_lib.unquiet_cpp_warnings()
    assert "TORCH_CPP_LOG_LEVEL" not in os.environ
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")  # the user's own: it stands either way
    env_lib.quiet_cpp_warnings()
    env_lib.unquiet_cpp_warnings()
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO"
