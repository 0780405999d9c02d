"""Move stage, its row-block half: a tensor's dim-0 rows read from its chunks, and derived tensors built block by block.

``ChunkSource`` hands out a chunk's rows (read from its located bytes, CRC-32 checked as they pass
in order, or sliced from the decoded chunk); ``read_rows`` assembles rows ``[lo, hi)`` of a tensor
from whichever chunks hold them (any tiling: FSDP's dim-0 chunks, tensor-parallel boxes).
``move_derived`` writes a ``derive.Derived`` output: per block of output rows, each input's rows
(the span its row map covers, at most about a block plus, for a head permutation, one head), the
``combine`` function, a cast, one ``pwrite``. Memory: the block's inputs and output, sized from
the mover's buffers; inputs read whole (``rows=None``) are held for the tensor. A derived tensor
that needs none of that (row segments of its inputs, no ``combine``, no cast) is copied as byte
ranges of its inputs' dim-0 chunks instead (``chunk_rows.segment_runs``).
"""

from __future__ import annotations

import math
import os
import threading
from typing import TYPE_CHECKING

from fsdp_convert._pagecache import PageCache
from fsdp_convert.chunk_rows import box, rows_of
from fsdp_convert.derive import Derived, Input, concat, row_span
from fsdp_convert.dtypes import DType
from fsdp_convert.errors import CorruptChunkError, ShapeMismatchError
from fsdp_convert.formats import Reader
from fsdp_convert.formats.crc import crc32
from fsdp_convert.formats.index import ChunkEntry, TensorEntry
from fsdp_convert.formats.reader import StoredBytes, check_crc

if TYPE_CHECKING:
    import torch
__all__ = [
    "COPY_BYTES",
    "MIN_HINTED_BYTES",
    "ChunkReads",
    "ChunkSource",
    "pwrite_all",
    "read_rows",
    "move_derived",
]

COMPUTE_ITEMSIZE = 12  # a combine function's intermediates per element: three fp32 live at once (LoRA: W, B @ A, their sum)
# the plain copy's unit: read into a buffer that stays in the CPU's cache, hashed, written. On ext4,
# a write from a read-only mapping of the source (the copy done once) cost 3x the CPU of this (two
# copies, the second from cache), and did not scale over processes; on tmpfs they cost the same
COPY_BYTES = 1 << 20
MIN_HINTED_BYTES = 1 << 20  # a smaller range (an expert's rows) is read at once: a read-ahead hint only costs a call


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` all of ``data`` at ``offset`` (a write may be short)."""
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class ChunkReads:
    """A mover thread's reading side: its reader, two reusable buffers, the page cache and the stop flag.

    ``move.Mover`` is one; ``ChunkSource`` and ``move_derived`` read through this public interface.

    Args:
        reader: the source's reader (owned by the caller, used by this thread only).
        piece_bytes: size of each of the (at most two) buffers, in bytes.
        drop_cache: drop what is read and written from the page cache (see ``_pagecache.PageCache``).
        stop: set by another thread to make the next ``check_stop`` raise ``InterruptedError``.
    """

    def __init__(
        self, reader: Reader, piece_bytes: int, *, drop_cache: bool = False, stop: threading.Event | None = None
    ) -> None:
        self.reader = reader
        self.piece_bytes = piece_bytes
        self.cache = PageCache(drop_cache)
        self._stop = stop
        self._buffers: list[bytearray] = [bytearray(0), bytearray(0)]
        self._verified: set[tuple[int, int]] = set()  # (fd, offset) of the chunks read through for their CRC-32
        self._located: dict[tuple[str, tuple[int, ...]], StoredBytes | None] = {}

    def buffer(self, which: int, nbytes: int) -> memoryview:
        """The first ``nbytes`` of buffer ``which`` (0: output, 1: chunk rows); valid until its next call.

        A buffer grows to ``max(nbytes, piece_bytes)`` when it is too small, and is kept for reuse.
        """
        if len(self._buffers[which]) < nbytes:
            self._buffers[which] = bytearray(max(nbytes, self.piece_bytes))
        return memoryview(self._buffers[which])[:nbytes]

    def locate(self, entry: TensorEntry, chunk: ChunkEntry) -> StoredBytes | None:
        """``reader.locate``, once per chunk: a chunk holding many experts is split into as many tensors.

        Raises:
            As ``Reader.locate``.
        """
        key = (entry.fqn, chunk.offsets)
        if key not in self._located:
            self._located[key] = self.reader.locate(entry, chunk)
        return self._located[key]

    def check_stop(self) -> None:
        """Raise ``InterruptedError`` when another thread asked this one to stop (called between pieces)."""
        if self._stop is not None and self._stop.is_set():
            raise InterruptedError("stopped")

    def verify(self, stored: StoredBytes) -> None:
        """Check a chunk's stored CRC-32 by reading it through (for a chunk copied only in part), piece by piece.

        Raises:
            CorruptChunkError: the CRC-32 differs, or the file is shorter than the record.
        """
        if stored.crc32 is None or (stored.fd, stored.offset) in self._verified:
            return  # nothing to check, or checked already (a chunk holding several experts, each its own tensor)
        crc, done = 0, 0
        while done < stored.nbytes:
            self.check_stop()
            view = self.piece(stored, done, min(self.piece_bytes, stored.nbytes - done), 1)
            crc = crc32(view, crc)
            done += len(view)
        check_crc(stored, crc)
        self._verified.add((stored.fd, stored.offset))

    def piece(self, stored: StoredBytes, at: int, nbytes: int, which: int = 0) -> memoryview:
        """Bytes ``[at, at + nbytes)`` (``nbytes`` > 0) of a located chunk, read into buffer ``which``.

        Raises:
            CorruptChunkError: the file is shorter than the record (it changed while it was read).
        """
        view = self.buffer(which, nbytes)
        self.read_exact(stored, view, at)
        return view

    def read_exact(self, stored: StoredBytes, view: memoryview, at: int) -> None:
        """Fill ``view`` with the located chunk's bytes from ``at`` (bytes from the record's start).

        Raises:
            CorruptChunkError: a short read (the file changed while it was read).
        """
        got = os.preadv(stored.fd, [view], stored.offset + at)
        if got != len(view):
            raise CorruptChunkError(
                f"{stored.where}: short read ({got} of {len(view)} bytes); the file changed while it was read"
            )
        self.cache.read(stored.fd, stored.offset + at, len(view))


class ChunkSource:
    """A chunk's rows, handed out in order: read from its located bytes, or sliced from the decoded chunk.

    Args:
        mover: the mover thread's reads (its reader and second buffer).
        entry: the tensor.
        chunk: the chunk.
        begin: first row of the tensor that will be asked for (dim-0 index of the tensor).
        end: last row that will be asked for, plus one. A chunk read only in part is read through
            once for its CRC-32 first.
    """

    def __init__(self, mover: ChunkReads, entry: TensorEntry, chunk: ChunkEntry, begin: int, end: int) -> None:
        self.mover, self.entry, self.chunk = mover, entry, chunk
        self.stored: StoredBytes | None = mover.reader.locate(entry, chunk)
        (c0, *_), (c_rows, *_) = box(chunk)
        self.last = min(end, c0 + c_rows) - c0  # the chunk's last row needed, plus one
        self.checked = self.stored is None or self.stored.crc32 is None
        if self.stored is not None and (begin > c0 or self.last < c_rows):
            mover.verify(self.stored)  # read in part: its stored CRC-32 covers the whole chunk
            self.checked = True
        self.decoded: torch.Tensor | None = None
        self.crc = 0
        self.done_to = 0  # rows read (and hashed) in order from the chunk's start

    def rows(self, a: int, b: int) -> torch.Tensor:
        """Rows ``[a, b)`` of the chunk (its own dim-0 indices), shape ``(b - a, *sizes[1:])``.

        Called in row order (a later call may overlap an earlier one); valid until the next call.
        """
        import torch

        _, (c_rows, *rest) = box(self.chunk)
        if self.stored is None:
            if self.decoded is None:
                self.decoded = self.mover.reader.read_chunk(self.entry, self.chunk).reshape(c_rows, *rest)
            part = self.decoded[a:b]
            if b >= self.last:
                self.decoded = None  # its last rows needed: free it once copied
            return part
        row_bytes = math.prod(rest) * self.entry.dtype.itemsize
        view = self.mover.buffer(1, (b - a) * row_bytes)
        self.mover.read_exact(self.stored, view, a * row_bytes)
        if a <= self.done_to < b:
            self.crc = crc32(view[(self.done_to - a) * row_bytes :], self.crc)
            self.done_to = b
            if b == c_rows and not self.checked:
                check_crc(self.stored, self.crc)
                self.checked = True
        return torch.frombuffer(view, dtype=self.entry.dtype.torch).view(b - a, *rest)

    def finish(self) -> None:
        """Check the stored CRC-32 if the rows asked for left it unchecked (a selection with gaps)."""
        if not self.checked and self.stored is not None:
            self.mover.verify(self.stored)
            self.checked = True


def read_rows(
    entry: TensorEntry, lo: int, hi: int, sources: dict[int, ChunkSource], into: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``entry`` (dim-0 indices), in its dtype, from the chunks holding them.

    Args:
        entry: the tensor.
        lo: first row, in elements of dim 0.
        hi: last row plus one.
        sources: a ``ChunkSource`` per chunk, by ``id(chunk)`` (those of the chunks overlapping
            every row that will be asked for).
        into: a flat tensor of ``entry``'s dtype to build them in (at least that long); None: a new one.
    """
    import torch

    shape = entry.shape or (1,)
    size = (hi - lo, *shape[1:])
    out = torch.empty(size, dtype=entry.dtype.torch) if into is None else into[: math.prod(size)].view(size)
    for chunk in entry.chunks:
        (c0, *rest_offsets), (c_rows, *rest_sizes) = box(chunk)
        a, b = max(lo, c0), min(hi, c0 + c_rows)
        if a >= b or chunk.numel == 0:
            continue
        dst = out.narrow(0, a - lo, b - a)
        for dim, (o, n) in enumerate(zip(rest_offsets, rest_sizes, strict=True), start=1):
            dst = dst.narrow(dim, o, n)
        dst.copy_(sources[id(chunk)].rows(a - c0, b - c0))
    return out


class _InputReader:
    """One input of a derived tensor: its rows for each block, read over the span they cover."""

    def __init__(self, mover: ChunkReads, inp: Input, entry: TensorEntry, begin: int, end: int) -> None:
        import torch

        self.inp, self.entry = inp, entry
        self.view = inp.view or entry.shape or (1,)
        self.per_row = self.view[0] // max(rows_of(entry.shape)[0], 1)  # view rows per tensor row
        need = (0, self.view[0]) if inp.rows is None else row_span(inp.rows, begin, end)
        lo, hi = need or (0, 0)
        t_lo, t_hi = lo // self.per_row, -(-hi // self.per_row)
        self.sources = {
            id(c): ChunkSource(mover, entry, c, t_lo, t_hi)
            for c in entry.chunks
            if c.numel > 0 and box(c)[0][0] < t_hi and t_lo < box(c)[0][0] + box(c)[1][0]
        }
        self.whole: torch.Tensor | None = None
        self._spans = torch.empty(0, dtype=entry.dtype.torch)  # reused block after block: fewer, larger allocations
        self._picked = torch.empty(0, dtype=entry.dtype.torch)

    def part(self, r0: int, r1: int) -> torch.Tensor:
        """The input's part for output rows ``[r0, r1)``: its rows there, or all of it."""
        import torch

        if self.inp.rows is None:
            if self.whole is None:
                self.whole = self._span(0, self.view[0])
            return self.whole
        rows = self.inp.rows(r0, r1)
        if not rows:
            return torch.empty((0, *self.view[1:]), dtype=self.entry.dtype.torch)
        lo, hi = min(rows), max(rows) + 1
        span = self._span(lo, hi)
        if isinstance(rows, range) and rows.step == 1:
            return span
        numel = len(rows) * math.prod(self.view[1:])
        if self._picked.numel() < numel:
            self._picked = torch.empty(numel, dtype=self.entry.dtype.torch)
        picked = self._picked[:numel].view(len(rows), *self.view[1:])
        return torch.index_select(span, 0, torch.tensor(rows, dtype=torch.long) - lo, out=picked)

    def _span(self, lo: int, hi: int) -> torch.Tensor:
        """View rows ``[lo, hi)``: the tensor rows holding them, read and cut."""
        import torch

        t_lo, t_hi = lo // self.per_row, -(-hi // self.per_row)
        numel = (t_hi - t_lo) * rows_of(self.entry.shape)[1]
        if self.inp.rows is None:  # whole: held for the tensor, its own
            data = read_rows(self.entry, t_lo, t_hi, self.sources)
        else:
            if self._spans.numel() < numel:
                self._spans = torch.empty(numel, dtype=self.entry.dtype.torch)
            data = read_rows(self.entry, t_lo, t_hi, self.sources, into=self._spans)
        data = data.reshape(-1, *self.view[1:])
        return data[lo - t_lo * self.per_row : hi - t_lo * self.per_row]

    def finish(self) -> None:
        for source in self.sources.values():
            source.finish()


def move_derived(
    mover: ChunkReads,
    derived: Derived,
    entries: tuple[TensorEntry, ...],
    dtype: DType,
    fd: int,
    offset: int,
    row_range: tuple[int, int],
) -> list[tuple[int, int, int]]:
    """Build rows ``row_range`` of a derived tensor block by block and write them at ``offset`` of ``fd``.

    Args:
        mover: the mover (reader, buffers, checks).
        derived: how the tensor is made.
        entries: the entries of ``derived.inputs``, in order.
        dtype: the dtype written (``combine``'s result is cast to it).
        fd: the output file.
        offset: where row ``row_range[0]`` goes, in bytes.
        row_range: the tensor's dim-0 rows ``[begin, end)`` to write (a reshard's target chunk).

    Returns:
        ``(offset, nbytes, crc32)`` of every run written, in file order.

    Raises:
        ShapeMismatchError: ``combine`` returned another shape than the block's (names the inputs).
        As ``Mover.move`` for bad chunks.
    """
    import torch

    view = derived.out_view
    per_row = view[0] // max(rows_of(derived.shape)[0], 1)
    begin, end = row_range[0] * per_row, row_range[1] * per_row
    row_elems = math.prod(view[1:])
    # per row: the output (buffer 0) and combine's fp32 result; per input, the chunk rows read
    # (buffer 1), the span assembled and the rows gathered from it
    in_row_bytes = sum(
        math.prod((i.view or e.shape or (1,))[1:]) * (3 * e.dtype.itemsize)
        for i, e in zip(derived.inputs, entries, strict=True)
        if i.rows is not None
    )
    block = max(1, 2 * mover.piece_bytes // (row_elems * (dtype.itemsize + COMPUTE_ITEMSIZE) + in_row_bytes))
    readers = [_InputReader(mover, inp, entry, begin, end) for inp, entry in zip(derived.inputs, entries, strict=True)]
    combine = derived.combine or concat
    runs = []
    for r0 in range(begin, end, block):
        mover.check_stop()
        r1 = min(end, r0 + block)
        result = combine([reader.part(r0, r1) for reader in readers])
        want = (r1 - r0, *view[1:])
        if tuple(result.shape) != want:
            names = ", ".join(e.fqn for e in entries)
            raise ShapeMismatchError(f"derived from {names}: rows [{r0}, {r1}) came out {tuple(result.shape)}, not {want}")
        out = mover.buffer(0, (r1 - r0) * row_elems * dtype.itemsize)
        torch.frombuffer(out, dtype=dtype.torch).view(want).copy_(result)
        at = offset + (r0 - begin) * row_elems * dtype.itemsize
        pwrite_all(fd, out, at)
        mover.cache.wrote(fd, at, len(out))
        runs.append((at, len(out), crc32(out)))
    for reader in readers:
        reader.finish()
    return runs
