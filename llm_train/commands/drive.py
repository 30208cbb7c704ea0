"""Sequential read and write speed of the drive under an NVMe offload directory (`llm-train doctor`).

ZeRO-Infinity's step time is mostly the drive's: every step reads the swapped optimizer state and
writes it back (planning/speed/step_time.py times it from these two numbers). This writes a file of a few
GiB in large blocks, fsyncs it, reads it back and removes it. With O_DIRECT (where the filesystem
takes it) neither direction goes through the page cache, as DeepSpeed's async I/O does not; where
it is refused (tmpfs, some network filesystems) the file is written buffered and fsynced, the
cache is dropped for it (posix_fadvise) before the read, and the result says so.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

MiB = 2**20
BLOCK_BYTES = 8 * MiB  # large sequential requests, like DeepSpeed's swap of a whole sub-group
PROBE_NAME = ".llm_train_drive_probe"


@dataclass(frozen=True)
class DriveSpeed:
    write_bytes_per_s: float
    read_bytes_per_s: float
    nbytes: int
    direct: bool
    """O_DIRECT in both directions; else buffered, fsynced, cache dropped before the read."""

    def describe(self) -> str:
        how = (
            "O_DIRECT" if self.direct else "buffered: the filesystem refused O_DIRECT, the read may be cached"
        )
        return (
            f"sequential write {self.write_bytes_per_s / 1e9:.2f} GB/s, read {self.read_bytes_per_s / 1e9:.2f} GB/s "
            f"({self.nbytes / 2**30:.1f} GiB in {BLOCK_BYTES // MiB} MiB blocks, {how})"
        )


def _open(path: Path, flags: int, direct: bool) -> tuple[int, bool]:
    """An fd for `path`, with O_DIRECT when asked and the filesystem takes it; (fd, direct)."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem does not do O_DIRECT
                raise
    return os.open(path, flags, 0o600), False


def measure_drive(directory: Path, nbytes: int, block: int = BLOCK_BYTES) -> DriveSpeed:
    """Write then read `nbytes` (rounded up to whole blocks) under `directory`; the file is removed."""
    path = Path(directory) / PROBE_NAME
    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT requires
    buffer.write(os.urandom(block))  # incompressible: drives that compress must not flatter themselves
    blocks = max(1, -(-nbytes // block))
    try:
        fd, direct = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct=True)
        try:
            started = time.perf_counter()
            for _ in range(blocks):
                os.write(fd, buffer)
            os.fsync(fd)
            write_s = time.perf_counter() - started
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the drive, not the cache
        finally:
            os.close(fd)
        fd, read_direct = _open(path, os.O_RDONLY, direct=direct)
        try:
            started = time.perf_counter()
            while os.readv(fd, [buffer]) > 0:
                pass
            read_s = time.perf_counter() - started
        finally:
            os.close(fd)
    finally:
        buffer.close()
        path.unlink(missing_ok=True)
    total = blocks * block
    return DriveSpeed(total / write_s, total / read_s, total, direct and read_direct)
