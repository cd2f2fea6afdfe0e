"""Joining the torch.distributed process group a launcher prepared for this worker."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from launcher.cluster.env import WorkerEnv


def job_store(env: WorkerEnv, prefix: str, timeout_s: float) -> dist.Store:
    """A client of the job's store (the one the launcher's rendezvous hosts), its keys under ``prefix``."""
    client = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(prefix, client)


def default_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def comm_device(group: Any = None) -> torch.device:
    """Where a tensor for a collective of ``group`` (None: the default group) must be: the CPU where the group has
    a backend for it (gloo), else the rank's current CUDA device (nccl takes no CPU tensor)."""
    if "cpu:" in dist.get_backend_config(group):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def process_device(env: WorkerEnv | None, device_type: str | None = None) -> torch.device:
    """The device one process of a one-device-per-process job computes on."""
    kind = device_type or (env.device_type if env else None) or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        return torch.device("cuda", env.local_rank if env else 0)
    return torch.device("cpu")


def ensure_process_group(
    env: WorkerEnv | None, backend: str | None = None, timeout_s: float = 300.0, device_type: str | None = None
) -> bool:
    """Join the job's process group if this process is one of several workers.

    Returns True when a process group with more than one process is in place:
    one already initialized, or one built from the launcher's environment
    (dlaunch's elastic agent, or torchrun).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if env is None or env.world_size <= 1:
        return False
    device = process_device(env, device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend or default_backend(device.type),
        store=attempt_store(env, timeout),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    return True


def attempt_store(env: WorkerEnv, timeout: datetime.timedelta) -> dist.Store | None:
    """The agent's store, with a key space of this attempt's own (None: let ``env://`` build the store).

    torch.distributed.elastic keeps one store for every restart of the workers;
    without a prefix, a restarted worker could read a dead peer's address that
    its previous attempt left there, and wait on it.
    """
    if not env.agent_store:
        return None
    return job_store(env, f"dlaunch/{env.run_id}/attempt{env.attempt}", timeout.total_seconds())


LEAVE_WAIT_S = 10.0  # how long a rank that finished waits for its peers at the end, on gloo


def leave_group(in_step: bool = True, wait_s: float | None = LEAVE_WAIT_S) -> None:
    """Leave the process group in step with the others: no rank closes its connections while a peer still uses them.

    ``in_step=False``: the ranks did not stop at one agreed point (a script stops wherever a signal finds it), so a
    barrier here would meet a peer's gradient all-reduce and both would wait forever. The group is left as it is:
    the process ends with ``os._exit``, and its sockets close with it. ``wait_s``: how long a finished rank waits
    for the others on gloo (None: until the group's timeout, as a stop's ranks do)."""
    if not (dist.is_available() and dist.is_initialized() and in_step):
        return
    if dist.get_backend() == "gloo" and wait_s is not None:
        # Bounded: a peer still in a collective this rank never runs (a script whose ranks do uneven steps) would
        # otherwise hold this barrier, and itself, until launch.collective_timeout_s. Leaving closes this rank's
        # sockets, and the peer's collective fails at once (the launcher says why). A peer that is only slower
        # (rank 0's last evaluation) finds this rank gone at its own barrier here, which it passes by.
        try:
            dist.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=wait_s))
        except Exception:  # noqa: BLE001 - timed out, or a peer already gone: the group is left as it is (no
            return  # destroy, which would wait for the barrier still pending in gloo's thread); os._exit follows
    else:
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer already gone; destroying is all that is left
            pass
    dist.destroy_process_group()
