"""The storage writer a save goes through: DCP's ``FileSystemWriter``, or in a test one whose disk fills up; and
the plan it writes by (``RankZeroCopies``).

``DLAUNCH_TEST_DISK_FULL_AT_STEP=N`` (read by ``launcher.cluster.env``; ``N+``: every step from N on) makes the
save of step N fail as a full disk makes it fail: each data file receives half
of its first write, then ``OSError(ENOSPC)``. The rest is the real path: DCP
reports the failure on every rank, the half-written ``.step-N.partial`` is
left behind, and ``trainer.checkpoint.on_error`` decides whether the run ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import os
from pathlib import Path
from typing import Any, Iterator

from launcher.cluster.env import disk_full_at


def storage_writer(path: Path, step: int) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    writer = FileSystemWriter(path)
    if disk_full_at(step):
        writer.fs = _full_disk(FileSystem)()
    return writer


def _full_disk(base: type) -> type:
    class FullDisk(base):  # type: ignore[misc, valid-type]
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
            with super().create_stream(path, mode) as stream:
                yield _FillingStream(stream, Path(path)) if "w" in mode and str(path).endswith(".distcp") else stream

    return FullDisk


class _FillingStream(io.RawIOBase):
    """A file on a disk that fills up during the first write to it."""

    def __init__(self, raw: Any, path: Path):
        super().__init__()
        self._raw, self._path = raw, path

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._raw.write(view[: len(view) // 2])
        self._raw.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self._path))

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()


def planner(pinned: frozenset[str] = frozenset()) -> Any:
    """DCP's default save plan, except that each key in ``pinned`` that every rank holds whole is written from
    rank 0's copy.

    DCP writes a value that several ranks hold from one of them, spread over the ranks for balance. Buffers such
    as batch norm's running statistics are each rank's own (updated from its share of the batch; DDP hands rank
    0's to every rank at each forward, FSDP never), and rank 0's evaluation used rank 0's: a checkpoint that held
    rank 1's was not the model evaluated, nor the one a resumed run went on from. Parameters and optimizer state,
    the same on every rank, stay spread.
    """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class RankZeroCopies(DefaultSavePlanner):
        def create_global_plan(self, all_plans: list[Any]) -> Any:
            if pinned and len(all_plans) > 1:
                first = {item.index.fqn for item in all_plans[0].items if item.type == WriteItemType.TENSOR}
                kept = first & pinned
                all_plans = [all_plans[0], *(dataclasses.replace(plan, items=[
                    item for item in plan.items if not (item.type == WriteItemType.TENSOR and item.index.fqn in kept)])
                    for plan in all_plans[1:])]
            return super().create_global_plan(all_plans)

    return RankZeroCopies()
