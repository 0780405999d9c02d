"""formats/crc.py: ISA-L's, zlib-ng's and zlib's CRC-32 and crc32_combine give the same values, and zlib is the fallback.

Every CRC-32 the tool writes (zip records, safetensors-free pieces, the resume log) or checks
(DCP payloads) comes from ``formats.crc``; a value that differed between implementations would
make a file written on one machine fail its check on another.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys
import zlib
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_convert.formats import crc

Crc32 = Callable[..., int]
Combine = Callable[[int, int, int], int]


def _zlib_combine() -> Combine:
    fn = ctypes.CDLL(ctypes.util.find_library("z")).crc32_combine
    fn.restype, fn.argtypes = ctypes.c_ulong, [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_long]
    return lambda a, b, n: int(fn(a, b, n)) & 0xFFFFFFFF


def _implementations() -> dict[str, tuple[Crc32, Combine]]:
    from isal import isal_zlib

    found: dict[str, tuple[Crc32, Combine]] = {
        "zlib": (zlib.crc32, _zlib_combine()),
        "isal": (isal_zlib.crc32, isal_zlib.crc32_combine),
    }
    try:
        from zlib_ng import zlib_ng
    except ImportError:
        pass  # not a dependency: compared where it is installed
    else:
        found["zlib-ng"] = (zlib_ng.crc32, zlib_ng.crc32_combine)
    return found


IMPLEMENTATIONS = _implementations()
U32 = st.integers(min_value=0, max_value=0xFFFFFFFF)


def test_the_package_uses_isal() -> None:
    assert crc.ACCELERATED
    assert crc.crc32 is IMPLEMENTATIONS["isal"][0]
    assert crc.crc32(b"123456789") == 0xCBF43926  # the CRC-32 check value


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=5000), value=U32)
def test_every_crc32_gives_zlibs_value(data: bytes, value: int) -> None:
    want = zlib.crc32(data, value)
    for name, (crc32, _) in IMPLEMENTATIONS.items():
        assert crc32(data, value) == want, name
        assert crc32(memoryview(bytearray(data)), value) == want, name
    assert crc.crc32(data, value) == want
    assert crc.crc32(data) == zlib.crc32(data)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=5000), cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=4), value=U32)
def test_every_combine_gives_the_crc32_of_the_concatenation(data: bytes, cuts: list[int], value: int) -> None:
    bounds = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    parts = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    for name, (crc32, combine) in IMPLEMENTATIONS.items():
        running = crc32(parts[0], value)
        for part in parts[1:]:
            running = combine(running, crc32(part), len(part))
        assert running == zlib.crc32(data, value), name
    assert crc.combine((zlib.crc32(p), len(p)) for p in parts) == zlib.crc32(data)


def test_crc32_of_a_large_buffer_in_pieces() -> None:
    data = os.urandom((3 << 20) + 17)  # past the vector loops' block sizes, with a tail
    view = memoryview(data)
    for name, (crc32, combine) in IMPLEMENTATIONS.items():
        assert crc32(view[: 1 << 20], crc32(b"")) == zlib.crc32(view[: 1 << 20]), name
        rest = crc32(view[1 << 20 :])
        assert combine(crc32(view[: 1 << 20]), rest, len(data) - (1 << 20)) == zlib.crc32(data), name


FALLBACK = r"""
import sys, zlib
sys.modules["isal"] = None  # import isal raises ImportError: a platform without its wheel
from fsdp_convert.formats import crc
assert not crc.ACCELERATED
assert crc.crc32 is zlib.crc32
a, b = b"first part" * 1000, b"second, longer part" * 999
assert crc.combine([(zlib.crc32(a), len(a)), (zlib.crc32(b), len(b))]) == zlib.crc32(a + b)
assert crc._crc32_combine() is crc._zlib_combine() is not None
assert "isal" not in {m.partition(".")[0] for m in sys.modules if sys.modules[m] is not None}
print("fallback ok")
"""


def test_without_isal_zlib_is_used_and_gives_the_same_values() -> None:
    proc = subprocess.run([sys.executable, "-c", FALLBACK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "fallback ok"
