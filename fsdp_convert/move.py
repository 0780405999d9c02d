"""Move stage: a tensor's bytes from its source chunks to its byte range in an output file, undecoded.

Every output's layout is fixed before any data is read (``plan``), so each tensor has a byte
range in its output file, and whichever worker owns the tensor writes it there with
``os.pwrite``, beside the other workers writing elsewhere in the same file.

- Chunks split on dim 0 only (FSDP's ``Shard(0)``), no cast: each chunk is a contiguous run of
  the output tensor. Its stored elements (``Reader.locate``: the payload's storage record, found
  from its zip headers, its pickle checked against ``.metadata``) are read ``COPY_BYTES`` at a
  time into a buffer that stays in the CPU's cache (``ChunkReads.piece``), hashed there
  (``formats.crc.crc32``, ISA-L's, which releases the GIL; the stored CRC-32 is checked at the
  chunk's end) and written with ``os.pwrite``, the read-ahead hint a window (``piece_bytes``)
  ahead. Memory: one buffer, whatever the tensor's size. (Measured on the 3.4 GB sample, warm
  cache: writing from a read-only mapping of the source instead cost 2.5x the CPU with OUT on
  ext4 and the same on tmpfs; ``pwrite`` is most of the move's CPU, CRC-32 under 5%.)
- Chunks split on further dims (tensor parallel), or a cast: the tensor is built row block by
  row block (dim-0 indices, at most a buffer's worth of output) in a buffer. Each chunk's rows in
  the block are one contiguous run of its storage, read into a second buffer and copied into
  place (casting if asked); the block is then written with one ``pwrite``. Memory: two buffers,
  or one row of the tensor if a row is larger.
- A derived tensor that is row segments of its inputs, no combine, no cast (an expert split,
  ``chunk_rows.segment_runs``): each input chunk's byte range copied as a dim-0 chunk's is.
- A chunk that cannot be located (a remote source, a stream-transformed payload, a view) is
  decoded with ``Reader.read_chunk`` and held until its last row is written: memory then also
  holds that chunk.

Every write is reported as a ``pieces.Piece`` (output offset, length, CRC-32), so rank 0 fills in
the output's CRC-32 fields (``pieces.range_crc``) without reading the data back.
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_convert.blocks import COPY_BYTES, MIN_HINTED_BYTES, ChunkReads, ChunkSource, move_derived, pwrite_all
from fsdp_convert.chunk_rows import box, rows_of, segment_runs
from fsdp_convert.derive import Derived
from fsdp_convert.dtypes import DType, as_dtype
from fsdp_convert.formats import Reader
from fsdp_convert.formats.crc import crc32
from fsdp_convert.formats.index import ChunkEntry, TensorEntry
from fsdp_convert.formats.reader import StoredBytes, check_crc
from fsdp_convert.pieces import Piece
from fsdp_convert.writers.buffer import byte_view, dense

__all__ = ["MoveJob", "Mover", "move_all", "mover_threads", "pwrite_all", "JOIN_POLL_S"]

JOIN_POLL_S = 0.2  # how often, in seconds, the main thread looks up from waiting on movers (signals land then)
# chunks this small on average (a 1024-rank FSDP save: a few KB each) are moved by one thread: a
# second's reads overlap the other's writes only where the bytes bound the move; here it only
# contends for the interpreter (1040 params x 64 ranks, 3 KB a chunk: 9.4 s -> 7.3 s)
SMALL_CHUNK_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class MoveJob:
    """One tensor, or a run of its dim-0 rows, to move: the entry read, the dtype written, and where it goes.

    Attributes:
        entry: the source tensor (its chunks).
        dtype: the output dtype (a cast when it differs from ``entry.dtype``).
        file: index of the output file; ``fd`` is its open descriptor.
        fd: descriptor of the output file, open for writing.
        offset: where the bytes start in the file, in bytes.
        rows: the dim-0 rows ``[begin, end)`` to move (a reshard's target chunk); None: the whole tensor.
        derived: the tensor is computed from ``sources`` (``derive.Derived``), not ``entry``'s data.
        sources: the entries of ``derived.inputs``, in order.
    """

    entry: TensorEntry
    dtype: DType
    file: int
    fd: int
    offset: int
    rows: tuple[int, int] | None = None
    derived: Derived | None = None
    sources: tuple[TensorEntry, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))  # a torch.dtype is taken too

    @property
    def shape(self) -> tuple[int, ...]:
        """Global shape of the tensor written (a derived tensor's own), in elements."""
        return self.derived.shape if self.derived is not None else self.entry.shape

    @property
    def row_range(self) -> tuple[int, int]:
        """The dim-0 rows moved, ``[begin, end)`` (a 0-dim tensor is one row)."""
        return self.rows if self.rows is not None else (0, _rows(self.shape)[0])

    @property
    def nbytes(self) -> int:
        """Bytes written, in bytes."""
        begin, end = self.row_range
        return (end - begin) * _rows(self.shape)[1] * self.dtype.itemsize


_rows, _box = rows_of, box


def _one_run(chunk: ChunkEntry, shape: tuple[int, ...]) -> bool:
    """Whether a chunk's elements are one run of the tensor's in row-major order.

    So they are when every dim after its first dim of size other than 1 is whole: FSDP's dim-0
    shards, and the row pieces a flat partition cuts (ZeRO's ``[1, 383]`` at ``(513, 0)``).
    """
    sizes = chunk.sizes
    cut = next((d for d, n in enumerate(sizes) if n != 1), len(sizes))
    return all(chunk.offsets[d] == 0 and sizes[d] == shape[d] for d in range(cut + 1, len(shape)))


def _overlaps(chunk: ChunkEntry, begin: int, end: int) -> bool:
    (c0, *_), (c_rows, *_) = _box(chunk)
    return c0 < end and begin < c0 + c_rows


class Mover(ChunkReads):
    """Moves tensors from a reader's chunks into output files; one per thread.

    Reads through ``blocks.ChunkReads`` (its reader, buffers, page cache and stop flag).

    Args:
        reader: the source's reader (owned by the caller, used by this thread only).
        piece_bytes: size of each of the (at most two) buffers, in bytes.
        drop_cache: drop what is read and written from the page cache (see ``_pagecache.PageCache``).
        stop: set by another thread to make ``move`` raise ``InterruptedError`` at its next piece.
        on_bytes: called with the bytes of each piece once written (progress); a job's bytes add up
            to its ``nbytes`` by the time ``move`` returns.
    """

    def __init__(
        self,
        reader: Reader,
        piece_bytes: int,
        *,
        drop_cache: bool = False,
        stop: threading.Event | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(reader, piece_bytes, drop_cache=drop_cache, stop=stop)
        self._on_bytes = on_bytes
        self._reported = 0  # bytes of the current job given to on_bytes

    def _wrote(self, nbytes: int) -> None:
        if self._on_bytes is not None and nbytes:
            self._reported += nbytes
            self._on_bytes(nbytes)

    def move(self, job: MoveJob) -> list[Piece]:
        """Write ``job``'s tensor at its offset; return the pieces written, in file order.

        Raises:
            MissingDataFileError, CorruptChunkError, UnsafeContentError, ShapeMismatchError: a bad chunk.
            OSError: the output cannot be written.
        """
        self._reported = 0
        pieces = self._move(job)
        self._wrote(job.nbytes - self._reported)  # what ``blocks`` wrote (a derived tensor's): at its end
        return pieces

    def _move(self, job: MoveJob) -> list[Piece]:
        entry = job.entry
        if job.nbytes == 0:
            return []
        if job.derived is not None:
            copied = self._move_segments(job)
            if copied is not None:
                return copied
            runs = move_derived(self, job.derived, job.sources, job.dtype, job.fd, job.offset, job.row_range)
            return [Piece(job.file, offset, nbytes, crc) for offset, nbytes, crc in runs]
        r0, r1 = job.row_range
        chunks = sorted((c for c in entry.chunks if c.numel > 0 and _overlaps(c, r0, r1)), key=lambda c: c.offsets)
        if job.dtype == entry.dtype and all(_one_run(c, entry.shape) for c in chunks):
            return self._move_runs(job, chunks)
        return self._move_row_blocks(job, chunks)

    def _move_segments(self, job: MoveJob) -> list[Piece] | None:
        """A derived tensor that is row segments of its inputs (``chunk_rows.segment_runs``), copied as byte ranges.

        Located chunks are streamed as ``_move_dim0`` streams them (each located once per thread,
        ``ChunkReads.locate``); others (a safetensors file's tensor) are decoded a buffer's worth
        of rows at a time (``_copy_decoded``). None: not such a tensor.
        """
        assert job.derived is not None
        runs = segment_runs(job.derived, job.sources, job.dtype, job.row_range)
        if runs is None:
            return None  # blocks.move_derived builds it
        pieces = []
        for entry, chunk, begin, end, at in runs:
            dst = job.offset + at
            stored = self.locate(entry, chunk)
            if stored is not None:
                if (begin, end) != (0, stored.nbytes):
                    self.verify(stored)  # a part (an expert): the stored CRC-32 is the whole chunk's
                pieces.append(Piece(job.file, dst, end - begin, self._stream(stored, begin, end, job.fd, dst)))
                continue
            pieces += self._copy_decoded(job, entry, chunk, begin, end, dst)
        return pieces

    def _copy_decoded(self, job: MoveJob, entry: TensorEntry, chunk: ChunkEntry, begin: int, end: int, dst: int) -> list[Piece]:
        """Bytes ``[begin, end)`` of a chunk that cannot be located, decoded a buffer's worth of its rows at a time (or a row)."""
        row_bytes = _rows(entry.shape)[1] * entry.dtype.itemsize
        step = max(1, self.piece_bytes // row_bytes)
        pieces = []
        for t in range(begin // row_bytes, -(-end // row_bytes), step):  # the chunk's rows holding the range
            self.check_stop()
            lo, hi = max(begin, t * row_bytes), min(end, (t + step) * row_bytes)
            at_rows = (chunk.offsets[0] + t, *chunk.offsets[1:])
            rows = dense(self.reader.read_box(entry, at_rows, (-(-hi // row_bytes) - t, *entry.shape[1:])))
            data = byte_view(rows)[lo - t * row_bytes : hi - t * row_bytes]
            at = dst + lo - begin
            pwrite_all(job.fd, data, at)
            self.cache.wrote(job.fd, at, len(data))
            self._wrote(len(data))
            pieces.append(Piece(job.file, at, len(data), crc32(data)))
        return pieces

    def _move_runs(self, job: MoveJob, chunks: list[ChunkEntry]) -> list[Piece]:
        """Chunks that are each one run of the tensor's elements (``_one_run``), copied as byte ranges in file order.

        Whole rows (FSDP's dim-0 shards) and a flat partition's cut rows (ZeRO's) alike; a chunk
        partly inside ``job.rows`` holds whole rows, read as just those where it cannot be located.
        """
        shape, itemsize = job.entry.shape, job.dtype.itemsize
        row_elems = _rows(shape)[1]
        first, last = (r * row_elems for r in job.row_range)  # the job's elements, [first, last)
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        pieces = []
        for chunk in chunks:
            start = sum(o * s for o, s in zip(chunk.offsets, strides, strict=True))
            lo, hi = max(first, start), min(last, start + chunk.numel)
            dst = job.offset + (lo - first) * itemsize
            begin, end = (lo - start) * itemsize, (hi - start) * itemsize
            stored = self.reader.locate(job.entry, chunk)
            if stored is not None:
                if (begin, end) != (0, stored.nbytes):
                    self.verify(stored)  # read in part: its stored CRC-32 covers the whole chunk
                pieces.append(Piece(job.file, dst, end - begin, self._stream(stored, begin, end, job.fd, dst)))
                continue
            if (lo, hi) == (start, start + chunk.numel):
                tensor = dense(self.reader.read_chunk(job.entry, chunk))
            else:  # whole rows, only those needed (a full file's reader copies just those from its memory map)
                rows = (lo // row_elems, hi // row_elems)
                at, size = (rows[0], *(0,) * (len(shape) - 1)), (rows[1] - rows[0], *shape[1:])
                tensor = dense(self.reader.read_box(job.entry, at, size))
            data = byte_view(tensor)
            pwrite_all(job.fd, data, dst)
            self.cache.wrote(job.fd, dst, len(data))
            self._wrote(len(data))
            pieces.append(Piece(job.file, dst, len(data), crc32(data)))
        return pieces

    def _stream(self, stored: StoredBytes, begin: int, end: int, fd: int, dst: int) -> int:
        """Copy bytes ``[begin, end)`` of a located chunk to ``dst`` in pieces; return their CRC-32.

        The stored CRC-32 is checked when the whole chunk is copied.
        """
        crc, done, hinted = 0, begin, begin
        window = self.piece_bytes if end - begin >= MIN_HINTED_BYTES else 0  # read-ahead kept a window ahead
        while done < end:
            self.check_stop()
            if window and hinted < end and hinted - done <= window:
                self.cache.will_read(stored.fd, stored.offset + hinted, min(window, end - hinted))
                hinted += min(window, end - hinted)
            nbytes = min(COPY_BYTES, self.piece_bytes, end - done)  # never past the memory budget's buffer
            view = self.piece(stored, done, nbytes)
            crc = crc32(view, crc)
            pwrite_all(fd, view, dst + done - begin)
            self.cache.wrote(fd, dst + done - begin, nbytes)
            self._wrote(nbytes)
            done += nbytes
        if (begin, end) == (0, stored.nbytes):
            check_crc(stored, crc)
        return crc

    def _move_row_blocks(self, job: MoveJob, chunks: list[ChunkEntry]) -> list[Piece]:
        import torch

        entry = job.entry
        _, row_elems = _rows(entry.shape)
        begin, end = job.row_range
        shape = entry.shape or (1,)
        widest = max(entry.dtype.itemsize, job.dtype.itemsize)
        block_rows = max(1, self.piece_bytes // (row_elems * widest))
        sources = {id(c): ChunkSource(self, entry, c, begin, end) for c in chunks}
        pieces = []
        for r0 in range(begin, end, block_rows):
            self.check_stop()
            r1 = min(end, r0 + block_rows)
            out = self.buffer(0, (r1 - r0) * row_elems * job.dtype.itemsize)
            block = torch.frombuffer(out, dtype=job.dtype.torch).view(r1 - r0, *shape[1:])
            for chunk in chunks:
                (c0, *rest_offsets), (c_rows, *rest_sizes) = _box(chunk)
                a, b = max(r0, c0), min(r1, c0 + c_rows)
                if a >= b:
                    continue
                dst = block.narrow(0, a - r0, b - a)
                for dim, (o, n) in enumerate(zip(rest_offsets, rest_sizes, strict=True), start=1):
                    dst = dst.narrow(dim, o, n)
                dst.copy_(sources[id(chunk)].rows(a - c0, b - c0))
            dst_offset = job.offset + (r0 - begin) * row_elems * job.dtype.itemsize
            pwrite_all(job.fd, out, dst_offset)
            self.cache.wrote(job.fd, dst_offset, len(out))
            self._wrote(len(out))
            pieces.append(Piece(job.file, dst_offset, len(out), crc32(out)))
        return pieces


def _pool_worker(
    open_reader: Callable[[], Reader],
    jobs: Iterator[MoveJob],
    lock: threading.Lock,
    mover_args: dict[str, Any],
    stop: threading.Event,
    out: list[Any],
    on_done: Callable[[MoveJob, list[Piece]], None],
) -> None:
    try:
        with open_reader() as reader:
            mover = Mover(reader, stop=stop, **mover_args)
            while not stop.is_set():
                with lock:
                    job = next(jobs, None)
                if job is None:
                    break
                pieces = mover.move(job)
                on_done(job, pieces)
                out.extend(pieces)
            mover.cache.flush()
    except BaseException as e:
        stop.set()
        out.append(e)


def mover_threads(jobs: Sequence[MoveJob], threads: int) -> int:
    """The threads to give ``move_all`` for ``jobs``: ``threads``, or 1 where their source chunks average under 64 KiB.

    Averaged over the stored bytes of each entry the jobs read, once per entry (``SMALL_CHUNK_BYTES``).
    """
    entries = {id(e): e for job in jobs for e in (job.entry, *job.sources)}.values()
    chunks = sum(len(e.chunks) for e in entries)
    stored = sum(sum(map(_LENGTH, e.chunks)) for e in entries)
    return 1 if chunks and stored < SMALL_CHUNK_BYTES * chunks else threads


_LENGTH = operator.attrgetter("length_bytes")


def move_all(
    open_reader: Callable[[], Reader],
    jobs: Sequence[MoveJob],
    *,
    threads: int,
    piece_bytes: int,
    drop_cache: bool = False,
    on_done: Callable[[MoveJob, list[Piece]], None] = lambda job, pieces: None,
    on_bytes: Callable[[int], None] | None = None,
) -> list[Piece]:
    """Move every job's tensor with ``threads`` threads, each with its own reader and buffers.

    Reads, CRC-32s and writes release the GIL, so one thread's read overlaps another's write.
    Memory: at most ``threads x 2 x piece_bytes`` of buffers (see the module docstring).

    Args:
        open_reader: makes a reader of the source (one per thread).
        jobs: the tensors, best in output order.
        threads: mover threads (1 runs in this thread); ``mover_threads`` says how many suit ``jobs``.
        piece_bytes: size of each buffer, in bytes.
        drop_cache: drop what is read and written from the page cache as it goes.
        on_done: called in the mover's thread with each job and its pieces once written (a record
            log, a reshard payload's headers).
        on_bytes: called in the mover's threads with the bytes of each piece once written (progress);
            a job's add up to its ``nbytes`` once it is done.

    Returns:
        Every piece written.

    Raises:
        As ``Mover.move``; a signal landing in this thread stops the others at their next piece.
    """
    stop = threading.Event()
    lock = threading.Lock()
    it = iter(jobs)
    args = {"piece_bytes": piece_bytes, "drop_cache": drop_cache, "on_bytes": on_bytes}
    outs: list[list[Any]] = [[] for _ in range(max(1, threads))]
    if threads <= 1:
        _pool_worker(open_reader, it, lock, args, stop, outs[0], on_done)
    else:
        pool = [
            threading.Thread(
                target=_pool_worker, args=(open_reader, it, lock, args, stop, out, on_done), name=f"fsdp-convert-mover-{i}"
            )
            for i, out in enumerate(outs)
        ]
        for t in pool:
            t.start()
        try:
            for t in pool:
                while t.is_alive():
                    t.join(JOIN_POLL_S)
        except BaseException:
            stop.set()
            for t in pool:
                t.join()
            raise
    errors = [x for out in outs for x in out if isinstance(x, BaseException)]
    if errors:  # the cause, not a thread it stopped
        raise next((e for e in errors if not isinstance(e, InterruptedError)), errors[0])
    return [x for out in outs for x in out]
