"""formats/crc.py: combine gives the CRC-32 of a concatenation from its parts' CRC-32s, as zlib.crc32 of the whole."""

from __future__ import annotations

import os
import zlib

import pytest

from fsdp_convert.formats.crc import combine


@pytest.mark.parametrize("sizes", [[1], [7, 0, 13], [4096, 1, 65537], [0]])
def test_combine_equals_crc32_of_the_concatenation(sizes: list[int]) -> None:
    parts = [os.urandom(n) for n in sizes]
    combined = combine((zlib.crc32(p), len(p)) for p in parts)
    assert combined is not None, "zlib's crc32_combine could not be loaded"
    assert combined == zlib.crc32(b"".join(parts))


def test_combine_depends_on_order_and_lengths() -> None:
    a, b = b"first part", b"second, longer part"
    forward = combine([(zlib.crc32(a), len(a)), (zlib.crc32(b), len(b))])
    assert forward == zlib.crc32(a + b)
    assert combine([(zlib.crc32(b), len(b)), (zlib.crc32(a), len(a))]) == zlib.crc32(b + a) != forward
    assert combine([(zlib.crc32(a), len(a)), (zlib.crc32(b), len(b) + 1)]) != forward
    assert combine([]) == 0 == zlib.crc32(b"")
