"""Each checkpoint file's size and sha256, recorded at the save and checked before a resume.

Rank 0 reads back every file of a finished save (DCP's ``.metadata`` and each
rank's ``.distcp``) and ``manifest.json`` lists them under ``files``. Before
a run resumes, the launcher checks sizes and digests, so a truncated,
bit-flipped or missing file is found before any worker starts; workers, which
load the checkpoint the launcher chose, recheck sizes only.

Why sha256: on the development machine (AMD EPYC with SHA extensions, one
100 MiB file, best of 5, page cache warm; ``docs/RELIABILITY.md``) sha256
took 84 ms (1.2 GB/s), zlib.crc32 56 ms, hashlib.blake2b 261 ms, reading
alone 18 ms. crc32 would save about 30 ms per 100 MiB; sha256 buys a digest
that no change to the bytes can keep, so it is the one recorded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

ALGORITHM = "sha256"
_CHUNK = 1 << 20
_NOT_RECORDED = frozenset({"manifest.json"})  # written after the digests, and checked by its own parse


def digest(path: Path) -> str:
    h = hashlib.new(ALGORITHM)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def fingerprint(directory: Path) -> dict[str, dict[str, Any]]:
    """``{file name: {"size": bytes, "sha256": hex}}`` for every file a save left in ``directory``."""
    return {
        p.name: {"size": p.stat().st_size, ALGORITHM: digest(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name not in _NOT_RECORDED
    }


def damage(directory: Path, files: dict[str, Any], full: bool = True) -> str | None:
    """Why ``directory`` no longer holds the files its manifest lists (None: it does).

    ``full``: compare digests too, not only sizes.
    """
    for name, record in sorted(files.items()):
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror})"
        expected = record.get("size")
        if size != expected:
            how = "truncated" if isinstance(expected, int) and size < expected else "changed"
            return f"{name} is {size} bytes, the manifest says {expected} ({how})"
        if full and ALGORITHM in record:
            try:
                actual = digest(path)
            except OSError as exc:
                return f"{name} cannot be read ({exc.strerror})"
            if actual != record[ALGORITHM]:
                return f"{name} does not match its {ALGORITHM} (its bytes changed after the save)"
    return None
