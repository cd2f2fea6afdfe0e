"""Device prefetch: each step's per-replica batches moved to their devices ahead of time.

``Prefetcher(steps, devices, depth, copy_stream)`` iterates ``steps`` (one list of per-replica
pieces per step) and keeps ``depth`` steps in flight beyond the one being used.
On CUDA each piece is copied from pinned host memory with ``non_blocking=True``, on
one of two streams (``input.copy_stream``):

- ``compute`` (the default): the device's current stream, the one the step runs on, as
  a hand-written loop copies (``batch.to(device, non_blocking=True)``). The copy is
  queued behind what that stream was given before (in dlaunch's loop, which reads
  ahead after each step's launch, the step the device is running); the host does not
  wait for it, and the memory belongs to the stream that uses it.
- ``side``: a stream of its own per device, so the copy overlaps the step the device is
  running; the step's stream waits for it (an event), and the tensors are marked as
  used by that stream (``record_stream``) so that the caching allocator does not hand
  their memory out early. The price: once the batch is freed, and until the step that
  used it has ended, the allocator queries its event at every allocation
  (``process_events``), host time that a step bound by the host (small models, many
  kernels) can pay.

On CPU there is nothing to copy: the steps are only read ahead, in order.

Both rest on one rule: the step that uses a batch runs on its device's current stream as this thread sees it
(dlaunch's loop and replica threads set no stream; a thread starts on the default one). A step run under another
stream would have to wait for the current one itself.

All of it happens on the calling thread, so a collective that the source may
run (the FILE-shard agreement) keeps the same order on every rank.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Iterator, Sequence

import torch

from launcher.distribute.input_context import COPY_STREAMS
from launcher.distribute.values import map_structure
from launcher.input.split import like

_END = object()


class Prefetcher:
    """Iterate ``steps`` with pieces on ``devices``, ``depth`` steps ahead (0: fetch on demand); CUDA copies on
    ``copy_stream`` (``compute``: the step's own stream; ``side``: one of their own)."""

    def __init__(self, steps: Iterable[list[Any]], devices: Sequence[torch.device], depth: int = 1,
                 copy_stream: str = "compute"):
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        if copy_stream not in COPY_STREAMS:
            raise ValueError(f"`copy_stream` must be one of {COPY_STREAMS}, got {copy_stream!r}")
        self.steps, self.devices, self.depth, self.copy_stream = steps, list(devices), depth, copy_stream

    def __iter__(self) -> Iterator[list[Any]]:
        source = iter(self.steps)
        copier = None
        if any(d.type == "cuda" for d in self.devices):
            copier = _SideStreamCopier(self.devices) if self.copy_stream == "side" else _ComputeStreamCopier(self.devices)
        pending: collections.deque = collections.deque()
        while True:
            while len(pending) < self.depth + 1:  # the step about to be used, plus `depth` in flight
                pieces = next(source, _END)
                if pieces is _END:
                    break
                pending.append(copier.start(pieces) if copier else (pieces, None))
            if not pending:
                return
            pieces, ready = pending.popleft()
            yield copier.finish(pieces, ready) if copier else pieces


class _ComputeStreamCopier:
    """Host-to-device copies on each device's current stream: nothing to wait for, nothing to record."""

    def __init__(self, devices: Sequence[torch.device]):
        self.devices = list(devices)

    def start(self, pieces: list[Any]) -> tuple[list[Any], None]:
        moved = [map_structure(lambda t: _copy(t, device), piece) if device.type == "cuda" else piece
                 for piece, device in zip(pieces, self.devices)]
        return like(moved, pieces), None

    def finish(self, pieces: list[Any], _: None) -> list[Any]:
        return pieces


class _SideStreamCopier:
    """Host-to-device copies on one side stream per CUDA device."""

    def __init__(self, devices: Sequence[torch.device]):
        self.devices = list(devices)
        self.streams = {d: torch.cuda.Stream(device=d) for d in set(self.devices) if d.type == "cuda"}

    def start(self, pieces: list[Any]) -> tuple[list[Any], list[Any]]:
        moved, events = [], []
        for piece, device in zip(pieces, self.devices):
            if device.type != "cuda":
                moved.append(piece)
                events.append(None)
                continue
            stream = self.streams[device]
            with torch.cuda.stream(stream):
                moved.append(map_structure(lambda t: _copy(t, device), piece))
                event = torch.cuda.Event()
                event.record(stream)
            events.append(event)
        return like(moved, pieces), events

    def finish(self, pieces: list[Any], events: list[Any]) -> list[Any]:
        for piece, device, event in zip(pieces, self.devices, events):
            if event is None:
                continue
            consumer = torch.cuda.current_stream(device)
            consumer.wait_event(event)
            map_structure(lambda t: t.record_stream(consumer) if isinstance(t, torch.Tensor) and t.is_cuda else None, piece)
        return pieces


def _copy(t: Any, device: torch.device) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=True)
