"""Page cache for the mover: hints (read ahead, start writeback early, drop what a huge run passed through).

``posix_fadvise`` (``os``) and ``sync_file_range`` (Linux's libc, through ctypes: Python's ``os``
does not expose it). Without ``sync_file_range`` (another libc or OS) writeback starts at the
kernel's own pace and dropping falls back to ``fdatasync``.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

__all__ = ["PageCache", "DROP_EVERY_BYTES"]

DROP_EVERY_BYTES = 256 << 20  # with drop: wait for written ranges to reach the disk and drop them this often
WRITEBACK_EVERY_BYTES = 8 << 20  # start writeback once this much is written to a file (one call, not one per tensor)


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Libc's ``sync_file_range`` (Linux; Python's ``os`` lacks it), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4


class PageCache:
    """What the mover tells the kernel about its reads and writes.

    - Before a piece is read, the next one is hinted (``POSIX_FADV_WILLNEED``), so the disk reads
      ahead while this thread hashes and writes.
    - Writeback starts once every ``WRITEBACK_EVERY_BYTES`` written to a file
      (``sync_file_range(SYNC_FILE_RANGE_WRITE)`` over the range written since), so dirty pages do
      not pile up until the final fsync and throttle every writer at once.
    - With ``drop`` (an output larger than half the RAM), read ranges are dropped from the page
      cache once read, and written ranges once on disk (waited for ``DROP_EVERY_BYTES`` later), so
      a conversion larger than the page cache does not evict everything else the machine holds.
    """

    def __init__(self, drop: bool) -> None:
        self.drop = drop
        self._written: list[tuple[int, int, int]] = []
        self._bytes = 0
        self._unsynced: dict[int, tuple[int, int, int]] = {}  # fd: (first byte, end, bytes) written since its writeback started

    @staticmethod
    def will_read(fd: int, offset: int, nbytes: int) -> None:
        if nbytes > 0:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)

    def read(self, fd: int, offset: int, nbytes: int) -> None:
        if self.drop:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    def wrote(self, fd: int, offset: int, nbytes: int) -> None:
        sync = _sync_file_range()
        if sync is not None:  # one call per WRITEBACK_EVERY_BYTES: an expert's 32 KiB each cost a call that did I/O
            first, end, unsynced = self._unsynced.get(fd, (offset, offset + nbytes, 0))
            first, end, unsynced = min(first, offset), max(end, offset + nbytes), unsynced + nbytes
            if unsynced >= WRITEBACK_EVERY_BYTES:
                sync(fd, first, end - first, _SYNC_WRITE)
                self._unsynced.pop(fd, None)
            else:
                self._unsynced[fd] = (first, end, unsynced)
        if not self.drop:
            return
        self._written.append((fd, offset, nbytes))
        self._bytes += nbytes
        if self._bytes >= DROP_EVERY_BYTES:
            self.flush()

    def flush(self) -> None:
        sync = _sync_file_range()
        for fd, offset, nbytes in self._written:
            if sync is None or sync(fd, offset, nbytes, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER) != 0:
                os.fdatasync(fd)
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        self._written.clear()
        self._bytes = 0
