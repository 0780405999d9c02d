"""CRC-32 of a concatenation from the CRC-32s of its parts (zlib's ``crc32_combine``).

A full tensor assembled from dim-0 chunks is the chunks' bytes back to back, and the reader has
already computed (and checked) each chunk's CRC-32; combining them spares the writer a second
pass over every byte. Python's ``zlib`` module does not expose ``crc32_combine``, so it is called
from the same system zlib through ctypes; without it, ``combine`` returns None and the writer
hashes the data itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable, Iterable

__all__ = ["combine"]


@functools.cache
def _crc32_combine() -> Callable[[int, int, int], int] | None:
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
        The combined CRC-32, or None when zlib's ``crc32_combine`` cannot be loaded.
    """
    fn = _crc32_combine()
    if fn is None:
        return None
    crc = 0
    for part_crc, length in parts:
        crc = fn(crc, part_crc, length)
    return crc
