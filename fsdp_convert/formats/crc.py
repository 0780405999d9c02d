"""CRC-32 for every stage: of a byte buffer (``crc32``), and of a concatenation from its parts' (``combine``).

Every byte the tool moves is hashed once, so the CRC-32's speed bounds the move's CPU cost per
byte. ISA-L's (the ``isal`` package, a dependency: PCLMUL, about 15-20 GB/s a core here) runs
four to five times as fast as zlib's (about 4 GB/s); both release the GIL and give the same
values. Without ``isal`` (a platform it has no wheel for), zlib's are used.

A full tensor assembled from dim-0 chunks is the chunks' bytes back to back, and the reader has
already computed (and checked) each chunk's CRC-32; ``combine`` spares the writer a second pass
over every byte. Without ``isal``, zlib's ``crc32_combine`` (which Python's ``zlib`` module does
not expose) is called from the system zlib through ctypes; without that either, ``combine``
returns None and the writer hashes the data itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import zlib
from collections.abc import Callable, Iterable
from types import ModuleType

_isal: ModuleType | None
try:  # a dependency; guarded for a platform without its wheel
    from isal import isal_zlib as _isal
except ImportError:  # pragma: no cover - exercised in a subprocess by tests/unit/test_crc.py
    _isal = None

__all__ = ["crc32", "combine", "ACCELERATED"]

ACCELERATED = _isal is not None  # ISA-L's CRC-32 is in use (False: zlib's)

# crc32(data, value=0) -> int: CRC-32 of ``data`` (any contiguous buffer: bytes, memoryview, mmap)
# continuing from ``value``, zlib's result (unsigned, 32 bits); the builtin itself, so a call costs
# no Python frame on the hot path
crc32: Callable[..., int] = _isal.crc32 if _isal is not None else zlib.crc32


@functools.cache
def _crc32_combine() -> Callable[[int, int, int], int] | None:
    if _isal is not None:
        fast: Callable[[int, int, int], int] = _isal.crc32_combine
        return fast
    return _zlib_combine()


@functools.cache
def _zlib_combine() -> Callable[[int, int, int], int] | None:
    """The system zlib's ``crc32_combine`` through ctypes, or None."""
    name = ctypes.util.find_library("z")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).crc32_combine
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ulong
    fn.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_long]
    return lambda a, b, n: int(fn(a, b, n)) & 0xFFFFFFFF


def combine(parts: Iterable[tuple[int, int]]) -> int | None:
    """CRC-32 of the concatenation of parts given as ``(crc32, length_bytes)``, in order.

    Returns:
        The combined CRC-32, or None when neither ISA-L's nor zlib's ``crc32_combine`` can be loaded.
    """
    fn = _crc32_combine()
    if fn is None:
        return None
    crc = 0
    for part_crc, length in parts:
        crc = fn(crc, part_crc, length)
    return crc
