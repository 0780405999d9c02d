"""Where a checkpoint's bytes live: a local ``Path`` or a remote ``Url``; a leaf below the index and ``remote``.

``formats/index.py`` records these in every ``ChunkEntry`` and ``remote.py`` reads and writes them,
so both import the types from here (and ``remote`` needs nothing from the read side).

A local file is read whole (``read_inside``), memory-mapped (``mapped_inside``) or handed to a
library that opens by name (``FdPath``, ``safe_open_inside``) as ``held_roots.open_inside`` opened
it: inside the folder named, never by name after a check.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fsdp_convert.held_roots import open_inside

__all__ = [
    "Url",
    "Location",
    "FdPath",
    "mapped_inside",
    "read_inside",
    "safe_open_inside",
]


class Url(str):
    """A remote location (``s3://bucket/ckpt``) that joins like a ``Path``: ``url / "__0_0.distcp"``."""

    __slots__ = ()

    def __truediv__(self, other: str | os.PathLike[str]) -> Url:
        return Url(self.rstrip("/") + "/" + os.fspath(other))

    @property
    def name(self) -> str:
        """The last component."""
        return self.rstrip("/").rsplit("/", 1)[-1]


Location = Path | Url


def read_inside(
    root: Path, path: Path, max_bytes: int, *, follow_symlinks: bool | None = None, what: str = "the checkpoint"
) -> bytes | None:
    """The whole of ``path``, a small regular file inside ``root`` (``open_inside``); None past ``max_bytes`` (never read).

    Raises:
        As ``open_inside``.
    """
    with open(open_inside(root, path, follow_symlinks=follow_symlinks, what=what), "rb") as f:
        if os.fstat(f.fileno()).st_size > max_bytes:
            return None
        data = f.read(max_bytes + 1)
    return data if len(data) <= max_bytes else None


class FdPath(os.PathLike[str]):
    """An open file for a library that opens by name: it opens ``/proc/self/fd/N`` (the very file), messages name ``path``.

    The descriptor stays the caller's to close (after the library opened it).
    """

    __slots__ = ("fd", "path")

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    def __fspath__(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def __str__(self) -> str:
        return str(self.path)


@contextmanager
def mapped_inside(
    root: Path, path: Path, *, follow_symlinks: bool | None = None, what: str = "the checkpoint"
) -> Iterator[mmap.mmap | bytes]:
    """The whole of ``path``, a regular file inside ``root`` (see ``open_inside``), memory-mapped for the block.

    An empty file is ``b""``. Nothing is read until used, so a huge file costs no memory.

    Raises:
        As ``open_inside``.
    """
    with open(open_inside(root, path, follow_symlinks=follow_symlinks, what=what), "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""
    try:
        yield data
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def safe_open_inside(root: Path, file: Path) -> Any:
    """Safetensors' ``safe_open`` of ``file`` as ``open_inside`` opened it (never by name after a check).

    Raises:
        UnsafeContentError, CorruptChunkError: as ``open_inside``. OSError: it cannot be opened. Exception: safetensors'.
    """
    from safetensors import safe_open

    fd = open_inside(root, file)
    try:
        return safe_open(f"/proc/self/fd/{fd}", "pt")  # the library maps the very file: the descriptor can go
    finally:
        os.close(fd)
