"""Where a rank's own code is: the innermost frame of user code (a recipe, a script, a library of the user's) in a
thread, for the heartbeat's record of a rank that hangs. dlaunch's, torch's and the standard library's frames are
not the user's; the shipped recipes are."""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from pathlib import Path
from types import FrameType, TracebackType

import torch

from launcher.launch import forked_server

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # as frames name their files
_RECIPES_DIR = os.path.join(_PACKAGE_DIR, "recipes")  # shipped recipes are user code
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
AUTOGRAD_DIR = os.path.join(_TORCH_DIR, "autograd")
_NOT_USER = (_PACKAGE_DIR, _TORCH_DIR, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])
_DISTRIBUTED_DIR = os.path.join(_TORCH_DIR, "distributed")
# A worker forked from a server that was forked from a running program (``launch/forked_server.py``) still has that
# program's frames below its own: the frames from here outwards are not the rank's.
_FORKED_SERVER = forked_server._serve.__code__
_C10D = os.path.join(_DISTRIBUTED_DIR, "distributed_c10d.py")
_WAITING = frozenset({  # torch.distributed's calls that return only once the other ranks have joined in
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single",
    "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "monitored_barrier", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send"})


def at(main_thread: int) -> tuple[str, str]:
    """``where`` and ``collective`` of the main thread, from one look at every thread's frames."""
    frames = sys._current_frames()
    return where(main_thread, frames), collective(main_thread, frames)


def where(main_thread: int, frames: dict[int, FrameType] | None = None) -> str:
    """The innermost frame of user code in the main thread, or in a thread running dlaunch's code (a replica)."""
    frames = sys._current_frames() if frames is None else frames
    me = threading.get_ident()
    others = [f for ident, f in frames.items() if ident not in (main_thread, me) and _runs_dlaunch(f)]
    for frame in [frames.get(main_thread), *others]:
        found = innermost(frame)
        if found:
            return found
    return ""


def collective(thread: int, frames: dict[int, FrameType] | None = None) -> str:
    """The collective of ``torch.distributed`` (``all_reduce``) that a thread is in, called from outside
    ``torch.distributed`` ("": none)."""
    frame, found = (sys._current_frames() if frames is None else frames).get(thread), ""
    while frame is not None and frame.f_code.co_filename.startswith(_DISTRIBUTED_DIR):
        if frame.f_code.co_filename == _C10D and frame.f_code.co_name in _WAITING:
            found = frame.f_code.co_name  # the outermost: all_gather_object, not the all_gather it calls
        frame = frame.f_back
    return found


def in_traceback(tb: TracebackType | None) -> str:
    """The innermost frame of user code an exception passed through: where a collective that failed was called."""
    found = ""
    while tb is not None:
        if tb.tb_frame.f_code is _FORKED_SERVER:
            found = ""  # what ran above it is the process the server was forked from
        elif is_user_file(tb.tb_frame.f_code.co_filename):
            found = f"{tb.tb_frame.f_code.co_name} ({Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno})"
        tb = tb.tb_next
    return found


def is_user_file(filename: str) -> bool:
    return filename.startswith(_RECIPES_DIR) or not (filename.startswith(_NOT_USER) or filename.startswith("<"))


def innermost(frame: FrameType | None) -> str:
    """The innermost frame of user code from ``frame`` outwards: ``main (train.py:63)`` ("": none)."""
    while frame is not None and frame.f_code is not _FORKED_SERVER:  # above it: the process it was forked from
        if is_user_file(frame.f_code.co_filename):
            return f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})"
        frame = frame.f_back
    return ""


def _runs_dlaunch(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PACKAGE_DIR) and not frame.f_code.co_filename.startswith(_RECIPES_DIR):
            return True
        frame = frame.f_back
    return False
