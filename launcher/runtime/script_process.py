"""The process a script expects, as ``python`` and ``torchrun`` give it: the root logger to configure, Hydra to
itself (its own ``@hydra.main``), ``init_process_group`` that joins the group dlaunch made, a native crash's stack.

``launcher.runtime.script`` enters these around ``runpy.run_path``; each leaves dlaunch's own state as it was.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import logging
import sys
from typing import Any, Iterator

from launcher.cluster import env as env_lib
from launcher.cluster.env import WorkerEnv
from launcher.runtime.progress import log


@contextlib.contextmanager
def logging_as_python() -> Iterator[None]:
    """The root logger is the script's, as under ``python`` and ``torchrun``: its ``logging.basicConfig(...)`` takes
    effect (its level and format, on every rank; the other ranks' lines reach their logs/ and the terminal tagged
    by the agent). dlaunch's own lines keep dlaunch's handlers meanwhile, on its ``dlaunch`` logger; afterwards
    the root logger is dlaunch's again."""
    root, ours = logging.getLogger(), logging.getLogger("dlaunch")
    handlers, level, own = list(root.handlers), root.level, (list(ours.handlers), ours.level, ours.propagate, ours.disabled)
    for handler in handlers:
        root.removeHandler(handler)
        ours.addHandler(handler)
    ours.setLevel(ours.level or level)
    ours.propagate = False
    root.setLevel(logging.WARNING)  # Python's default: a script that configures nothing sees its warnings only
    try:
        yield
    finally:
        for handler in list(root.handlers):  # the script's, now that it has ended
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        ours.handlers[:], ours.propagate, ours.disabled = own[0], own[2], own[3]  # dictConfig disables loggers
        ours.setLevel(own[1])


@contextlib.contextmanager
def native_crash_shown(env: WorkerEnv | None) -> Iterator[None]:
    """In dlaunch's own process (one process), a crash in native code (a segfault in an extension) ends dlaunch with
    the script, before any root cause: Python's faulthandler prints the script's stack first, as a worker's root cause
    shows its own."""
    if env is not None or faulthandler.is_enabled():
        yield
        return
    faulthandler.enable()
    try:
        yield
    finally:
        faulthandler.disable()


@contextlib.contextmanager
def hydra_set_aside() -> Iterator[None]:
    """A script with its own ``@hydra.main`` runs in dlaunch's process (one process) as under ``python``: dlaunch's
    Hydra state (its app, the job's config) is set aside for it, and back once it has ended."""
    singleton = sys.modules.get("hydra.core.singleton")
    if singleton is None:
        yield
        return
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import DictConfig

    saved = {instance: dict(vars(instance)) for instance in list(singleton.Singleton._instances.values())}
    for instance, state in saved.items():  # what the script's Hydra changes in place (its ConfigStore entries, the
        for name, value in state.items():  # job's runtime config) it changes in copies: dlaunch's stay as they were
            if isinstance(value, (dict, DictConfig)):
                setattr(instance, name, copy.deepcopy(value))
    GlobalHydra.instance().clear()
    try:
        yield
    finally:
        for instance, state in saved.items():
            vars(instance).clear()
            vars(instance).update(state)


@contextlib.contextmanager
def as_torchrun(env: WorkerEnv | None, timeout_s: float) -> Iterator[None]:
    """A torchrun script runs unmodified: its own ``init_process_group(...)`` joins the group dlaunch has already
    set up (the call returns it, once said in the log), and its ``destroy_process_group()`` leaves that group to
    dlaunch, which ends it with the other ranks after the script (destroying it here, with dlaunch's own
    groups' work in flight, deadlocked now and then inside gloo). In one process (no worker environment) the
    variables torchrun would set (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) are
    there, and the group the script makes is its own to end."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from launcher.launch.rendezvous import free_port

    original, destroy, ours = dist.init_process_group, dist.destroy_process_group, dist.is_initialized()
    said: list[bool] = []

    def left_to_dlaunch(group: Any = None) -> None:
        if ours and group is None:
            return None
        return destroy(group)

    def joined(*args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            return original(*args, **kwargs)
        if not said:
            said.append(True)
            log.info("the script's init_process_group(): dlaunch has set up the process group already (%s, %d "
                     "processes); the script uses it", dist.get_backend(), dist.get_world_size())
            _say_if_timeout_unused(kwargs.get("timeout", args[2] if len(args) > 2 else None), timeout_s)
        return None

    extra = {} if env is not None else env_lib.torchrun_single_process(free_port())
    with env_lib.worker_env_set(extra):
        # both names: `from torch.distributed.distributed_c10d import init_process_group` finds the second
        for module in (dist, c10d):
            module.init_process_group, module.destroy_process_group = joined, left_to_dlaunch
        try:
            yield
        finally:
            for module in (dist, c10d):
                module.init_process_group, module.destroy_process_group = original, destroy
            if not ours and dist.is_initialized():  # the script's own group of one, which it left open
                destroy()


def _say_if_timeout_unused(timeout: Any, timeout_s: float) -> None:
    """The group dlaunch made waits ``launch.collective_timeout_s`` for a collective, not the script's own timeout."""
    import torch.distributed as dist

    seconds = getattr(timeout, "total_seconds", lambda: None)()
    if seconds is not None and seconds != timeout_s and dist.get_rank() == 0:  # one line, not one per rank
        log.warning("the script's init_process_group(timeout=%s) does not apply: the group dlaunch set up waits "
                    "launch.collective_timeout_s=%g s for a collective; give launch.collective_timeout_s=%g for the "
                    "script's", timeout, timeout_s, seconds)
