"""Comparing two values of ``verify``: tensors bit for bit or within tolerances, plain values by equality.

A tensor pair is equal when dtype, shape and every element's bytes agree (``same_bytes``, as wide
integers); with ``atol``/``rtol``, floating tensors may differ within ``torch.allclose`` (NaNs
equal). A side cast as ``consolidate --dtype`` casts is compared after the cast (``cast``).
Two tensors whose bytes both sides locate as stored (``same_stored_bytes``) are compared as those
bytes, read block by block into two reused buffers: no torch, and a few MiB of memory whatever
their size. torch is imported only for tensors in memory, which only a tensor yet needs.
"""

from __future__ import annotations

import os
import reprlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from fsdp_convert.dtypes import is_tensor
from fsdp_convert.errors import CorruptChunkError
from fsdp_convert.formats.crc import crc32
from fsdp_convert.formats.index import dtype_name, values_equal
from fsdp_convert.formats.reader import StoredBytes, check_crc

if TYPE_CHECKING:
    import torch

__all__ = ["BLOCK_BYTES", "ByteBuffers", "StoredPieces", "cast", "compare", "same_bytes", "same_stored_bytes"]

BLOCK_BYTES = 2 << 20  # each side's buffer: bytes read and compared at a time (2-4 MiB cost the least CPU here)
_SMALL_BYTES = 64 << 10  # a part this short is compared as copies (cheaper than a whole buffer's memcmp)
StoredPieces = Sequence[tuple[int, StoredBytes]]
"""A tensor's bytes as stored: ``(offset in the tensor's bytes, where they lie)`` per piece, in order, back to back."""


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors of one dtype and shape hold the same bytes, compared as wide integers.

    Their bytes are seen as the widest integer (8, 4, 2 or 1 bytes) that divides their size, so a
    gigabyte compares in a few hundredths of a second where a byte-by-byte compare takes ten times that.
    """
    import torch

    bytes_a, bytes_b = (_element_bytes(t).reshape(-1) for t in (a, b))
    for wide in (torch.int64, torch.int32, torch.int16):
        if bytes_a.numel() % wide.itemsize == 0:
            try:
                return torch.equal(bytes_a.view(wide), bytes_b.view(wide))
            except RuntimeError:  # a view at an offset not aligned to the wider type
                break
    return torch.equal(bytes_a, bytes_b)


def _element_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a ``(numel, itemsize)`` uint8 tensor, in element order (any dtype, 0-dim too).

    Works for every dtype, where ``torch.equal`` and ``!=`` do not (float8 and float4 have no
    CPU kernels for them, and NaN != NaN).
    """
    import torch

    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).reshape(-1, t.dtype.itemsize)


def _values(t: torch.Tensor) -> torch.Tensor | None:
    """A real floating tensor's values as float64 (exact for every float dtype, float8 included); None otherwise."""
    import torch

    from fsdp_convert.constants import UNCASTABLE_DTYPES  # built with torch at first use

    if not t.is_floating_point() or t.dtype in UNCASTABLE_DTYPES:
        return None
    return t.detach().to(torch.float64)


def cast(value: Any, dtype: torch.dtype | None) -> tuple[Any, bool]:
    """``value`` cast element by element (as consolidate's writers cast), if a castable floating tensor of another dtype."""
    if dtype is None or not is_tensor(value) or dtype == value.dtype or not value.is_floating_point():
        return value, False
    from fsdp_convert.constants import UNCASTABLE_DTYPES  # built with torch at first use

    if value.dtype in UNCASTABLE_DTYPES:
        return value, False
    return value.reshape(-1).to(dtype).reshape(value.shape), True


def compare(a: Any, b: Any, atol: float | None, rtol: float | None, *, any_nan: bool = False) -> str | None:
    """None when equal, else what differs.

    Tensors are equal when their bytes are (so NaNs with the same bits are equal and -0.0 differs
    from 0.0), compared as bytes for every dtype; with ``atol``/``rtol``, real floating tensors
    (float8 too, through float64) are equal within ``torch.allclose`` (NaNs equal). Complex,
    integer, bool and float4 tensors are always compared bitwise. With ``any_nan`` (a side was
    cast: torch's casts give a NaN's sign and payload bits by code path, vectorised or not), a
    NaN equals any NaN; every other element still compares by its bytes. Plain values are equal
    when of the same types and equal item by item, floats by their bits too (``formats.index.values_equal``).
    """
    if is_tensor(a) and is_tensor(b):  # no tensor before torch is imported: plain values need none
        import torch

        if a.dtype != b.dtype:
            return f"dtype {dtype_name(a.dtype)} != {dtype_name(b.dtype)}"
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
        if same_bytes(a, b):
            return None
        bytes_a, bytes_b = _element_bytes(a), _element_bytes(b)
        values_a, values_b = _values(a), _values(b)
        if any_nan and values_a is not None and values_b is not None:
            other_bits = (bytes_a != bytes_b).any(dim=1) & ~(values_a.isnan() & values_b.isnan()).reshape(-1)
            if not other_bits.any():
                return None
        if values_a is not None and values_b is not None:
            if (atol is not None or rtol is not None) and torch.allclose(
                values_a, values_b, rtol=rtol or 0.0, atol=atol or 0.0, equal_nan=True
            ):
                return None
            nan_a, nan_b = values_a.isnan(), values_b.isnan()
            # a NaN on both sides, or equal values, is no difference in value (inf - inf would be NaN)
            alike = (nan_a & nan_b) | (values_a == values_b)
            one_nan = int((nan_a ^ nan_b).sum())
            diff = torch.where(alike | nan_a | nan_b, 0.0, (values_a - values_b).abs()).max().item()
            if one_nan:
                elsewhere = f"; max abs difference {diff:.3g} elsewhere" if diff else ""
                return f"values differ (a NaN on one side in {one_nan} of {a.numel()} elements{elsewhere})"
            if diff == 0:
                return "values differ in bits only (-0.0 and 0.0, or NaNs of other bits)"
            return f"values differ (max abs difference {diff:.3g})"
        differing = int((bytes_a != bytes_b).any(dim=1).sum())
        return f"values differ ({differing} of {a.numel()} elements)"
    if is_tensor(a) or is_tensor(b):
        return f"{type(a).__name__} != {type(b).__name__}"

    # plain values: a walk of their own (shared parts once, Ctrl-C heard), floats by their bits as tensors'
    def tensors(x: Any, y: Any) -> bool | None:
        return compare(x, y, atol, rtol, any_nan=any_nan) is None if is_tensor(x) else None

    if not values_equal(a, b, tensors):
        return f"{_shown(a)} != {_shown(b)}"
    return None


_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother = 3, 40, 40


def _shown(value: Any) -> str:
    """A plain value for a message, at most 80 characters (``reprlib``: a few levels and items, never the whole)."""
    text = _short.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Pieces:
    """One side's pieces read in order into a buffer, each piece's CRC-32 (where stored) checked once read whole."""

    def __init__(self, pieces: StoredPieces) -> None:
        self._pieces = pieces
        self._next = 0  # the piece read next
        self._done = 0  # its bytes read so far
        self._crc = 0  # their CRC-32

    def fill(self, view: memoryview) -> None:
        """Read the next ``len(view)`` bytes into ``view``.

        Raises:
            CorruptChunkError: a short read (the file changed while it was read), or a CRC-32 mismatch.
        """
        pos = 0
        while pos < len(view):
            stored = self._pieces[self._next][1]
            part = view[pos : pos + min(len(view) - pos, stored.nbytes - self._done)]
            got = 0
            while got < len(part):  # one preadv moves at most about 2 GiB
                n = os.preadv(stored.fd, [part[got:]], stored.offset + self._done + got)
                if n <= 0:
                    raise CorruptChunkError(f"{stored.where}: short read; the file changed while it was read")
                got += n
            if stored.crc32 is not None:
                self._crc = crc32(part, self._crc)
            pos, self._done = pos + len(part), self._done + len(part)
            if self._done == stored.nbytes:
                check_crc(stored, self._crc)
                self._next, self._done, self._crc = self._next + 1, 0, 0


class ByteBuffers:
    """Two reused buffers of ``BLOCK_BYTES`` for ``same_stored_bytes``, allocated at first use.

    Outside the part just read, the two always hold the same bytes (both start as zeros; a part
    read into both and found equal leaves them equal; found unequal, A's is copied onto B's), so
    comparing the whole buffers (``bytearray ==``: one memcmp) compares the part, with no copy.
    """

    def __init__(self) -> None:
        self._a = self._b = bytearray()

    def compare(self, pool: ThreadPoolExecutor, a: _Pieces, b: _Pieces, nbytes: int) -> bool:
        """Read the next ``nbytes`` (at most ``BLOCK_BYTES``) of each side, each in a thread of ``pool``; True when equal.

        Raises:
            As ``_Pieces.fill``.
        """
        if not self._a:
            self._a, self._b = bytearray(BLOCK_BYTES), bytearray(BLOCK_BYTES)
        view_a, view_b = memoryview(self._a)[:nbytes], memoryview(self._b)[:nbytes]
        equal = False
        try:
            filled = [pool.submit(a.fill, view_a), pool.submit(b.fill, view_b)]
            wait(filled)  # both reads end before the buffers are touched again
            for read in filled:
                read.result()
            if nbytes <= _SMALL_BYTES:
                equal = bytes(view_a) == bytes(view_b)
            else:
                equal = self._a == self._b  # the same bytes outside the part (see above)
        finally:
            if not equal:  # unequal, or a read failed part-way: the parts made the same again
                view_b[:] = view_a
        return equal


def same_stored_bytes(a: StoredPieces, b: StoredPieces, pool: ThreadPoolExecutor, buffers: ByteBuffers) -> bool:
    """Whether two tensors' bytes as stored are the same (both of one dtype and shape): read and compared block by block.

    Exact for every dtype (the bytes are the elements). Holds the two buffers alone; stops at the
    first block that differs. Each piece's CRC-32, where its format stores one, is checked once it
    is read whole.

    Args:
        a: A's pieces (``StoredPieces``), tiling its bytes.
        b: B's, tiling as many bytes.
        pool: two threads, to read A's and B's blocks in (never in the thread that compares).
        buffers: the buffers to read into.

    Raises:
        CorruptChunkError: a short read or a CRC-32 mismatch (the file names it).
    """
    total = sum(stored.nbytes for _, stored in a)
    side_a, side_b = _Pieces(a), _Pieces(b)
    done = 0
    while done < total:
        nbytes = min(BLOCK_BYTES, total - done)
        if not buffers.compare(pool, side_a, side_b, nbytes):
            return False
        done += nbytes
    return True
