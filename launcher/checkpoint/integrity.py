"""Each checkpoint file's size and sha256, recorded at the save and checked before a resume.

Every rank reads back the ``.distcp`` files it wrote, rank 0 gathers their
digests and reads the rest (DCP's ``.metadata``, any file no rank claimed), and
``manifest.json`` lists them all under ``files``. Before
a run resumes, the launcher checks sizes and digests (several files at once, on
threads), so a truncated, bit-flipped or missing file is found before any worker
starts; workers, which load the checkpoint the launcher chose, recheck sizes only.

Why sha256: on the development machine (AMD EPYC with SHA extensions, one
100 MiB file, best of 5, page cache warm; ``docs/RELIABILITY.md``) sha256
took 84 ms (1.2 GB/s), zlib.crc32 56 ms, hashlib.blake2b 261 ms, reading
alone 18 ms. crc32 would save about 30 ms per 100 MiB; sha256 buys a digest
that no change to the bytes can keep, so it is the one recorded.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ALGORITHM = "sha256"
_CHUNK = 1 << 20
_NOT_RECORDED = frozenset({"manifest.json"})  # written after the digests, and checked by its own parse
# Threads that compute digests at once: this process's cores (macOS has no affinity: all of them), at most 8.
_READERS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def digest(path: Path, stop: threading.Event | None = None) -> str:
    """``path``'s sha256; ``stop``: give up (``Abandoned``) within a chunk once it is set."""
    h = hashlib.new(ALGORITHM)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            if stop is not None and stop.is_set():
                raise Abandoned(path)
            h.update(view[:n])
    return h.hexdigest()


class Abandoned(Exception):
    """A digest no longer needed: another file was found damaged, or the check was interrupted."""


def fingerprint(directory: Path, known: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """``{file name: {"size": bytes, "sha256": hex}}`` for every file a save left in ``directory``; those in
    ``known`` (the other ranks' own files, read back by them) are not read again."""
    known = known or {}
    here = {p.name: known.get(p.name) or record(p) for p in directory.iterdir()
            if p.is_file() and p.name not in _NOT_RECORDED}
    return dict(sorted({**known, **here}.items()))  # one this rank cannot see yet (a lagging file system) still counts


def own_files(directory: Path, rank: int) -> dict[str, dict[str, Any]]:
    """The records of the files DCP's writer names for ``rank`` (``__RANK_N.distcp``): each rank reads back what
    it wrote, in parallel with the others and from its own page cache, so a save's digests take 1/N of the time."""
    return {p.name: record(p) for p in sorted(directory.glob(f"__{rank}_*.distcp"))}


def record(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, ALGORITHM: digest(path)}


def damage(directory: Path, files: dict[str, Any], full: bool = True) -> str | None:
    """Why ``directory`` no longer holds the files its manifest lists (None: it does).

    ``full``: compare digests too, not only sizes. Every size is checked first; then the digests are computed by
    several threads at once (hashlib and file reads release the GIL), so a checkpoint of many ranks' files is
    checked at the disk's speed rather than one core's.
    """
    for name, record in sorted(files.items()):
        why = _size_mismatch(directory / name, record.get("size"))
        if why:
            return why
    hashed = [(directory / name, record[ALGORITHM]) for name, record in sorted(files.items()) if ALGORITHM in record]
    if not full or not hashed:
        return None
    stop = threading.Event()  # set on the way out: a damaged file found, or Ctrl-C, ends the other threads' reads
    pool = ThreadPoolExecutor(max_workers=min(_READERS, len(hashed)))
    try:
        return next((why for why in pool.map(lambda item: _digest_mismatch(item, stop), hashed) if why), None)
    finally:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)


def _size_mismatch(path: Path, expected: Any) -> str | None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path.name} is missing"
    except OSError as exc:
        return f"{path.name} cannot be read ({exc.strerror})"
    if size != expected:
        how = "truncated" if isinstance(expected, int) and size < expected else "changed"
        return f"{path.name} is {size} bytes, the manifest says {expected} ({how})"
    return None


def _digest_mismatch(item: tuple[Path, str], stop: threading.Event) -> str | None:
    path, expected = item
    try:
        actual = digest(path, stop)
    except OSError as exc:
        return f"{path.name} cannot be read ({exc.strerror})"
    return None if actual == expected else f"{path.name} does not match its {ALGORITHM} (its bytes changed after the save)"
