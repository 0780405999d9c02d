"""move.py / blocks.py: located chunks are copied through one small buffer, a piece at a time.

Each piece (``blocks.COPY_BYTES``) is read into the buffer, which stays in the CPU's cache, hashed
and written; the read-ahead hint keeps a window (``piece_bytes``) ahead of the reads. Memory holds
one buffer per thread whatever the tensor's size; a file shorter than its records is a corrupt chunk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from fsdp_convert import _pagecache, blocks, move
from fsdp_convert.errors import CorruptChunkError
from fsdp_convert.formats import open_reader
from fsdp_convert.formats.dcp import DcpReader
from fsdp_convert.formats.index import TensorEntry
from fsdp_convert.formats.reader import StoredBytes
from fsdp_convert.move import MoveJob, Mover
from tests.unit.test_move import FILE, FILL, OFFSET, TAIL, _check, _Ckpt, _expected, _move, _write_ckpt

COPY = 5  # bytes per piece here: every chunk of these small tensors takes several


@pytest.fixture
def ckpt(tmp_path: Path) -> _Ckpt:
    return _write_ckpt(tmp_path / "ck")


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(move, "COPY_BYTES", COPY)
    monkeypatch.setattr(move, "MIN_HINTED_BYTES", 0)


class _Reads:
    """Records every read into a buffer (its size and the buffer object) and every read-ahead hint."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        self.buffers: set[int] = set()
        self.hints: list[tuple[int, int, int]] = []
        real = blocks.ChunkReads.read_exact
        reads = self

        def read_exact(mover: blocks.ChunkReads, stored: StoredBytes, view: memoryview, at: int) -> None:
            reads.sizes.append(len(view))
            reads.buffers.add(id(view.obj))
            real(mover, stored, view, at)

        def will_read(fd: int, offset: int, nbytes: int) -> None:
            reads.hints.append((fd, offset, nbytes))

        monkeypatch.setattr(blocks.ChunkReads, "read_exact", read_exact)
        monkeypatch.setattr(_pagecache.PageCache, "will_read", staticmethod(will_read))


@pytest.mark.parametrize(("name", "rows"), [("dim0", None), ("dim0_bf16", None), ("dim0", (1, 7)), ("dim0", (5, 6))])
def test_located_chunks_are_copied_a_piece_at_a_time_through_one_buffer(
    ckpt: _Ckpt, name: str, rows: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _Reads(monkeypatch)
    monkeypatch.setattr(DcpReader, "read_chunk", lambda *a: pytest.fail("a located chunk was decoded"))
    with open_reader(ckpt.folder) as reader:
        pieces, data = _move(reader, ckpt.entries[name], tmp_path / "out", rows=rows, piece_bytes=16)
    _check(pieces, data, _expected(ckpt.tensors[name], rows, None))
    copied = [n for n in reads.sizes if n <= COPY]
    assert sum(copied) >= sum(p.nbytes for p in pieces) and max(reads.sizes) <= 16, reads.sizes
    if rows is None:  # the whole tensor: every chunk copied in pieces of COPY bytes, through buffer 0 alone
        assert reads.sizes == copied and len(reads.buffers) == 1 and len(copied) > len(pieces) >= 2
    else:  # a part of a chunk: the whole chunk is read through for its CRC-32 first (buffer 1)
        assert len(reads.buffers) == 2


def test_read_ahead_keeps_a_window_ahead_of_the_reads(ckpt: _Ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _Reads(monkeypatch)
    with open_reader(ckpt.folder) as reader:
        pieces, data = _move(reader, ckpt.entries["dim0"], tmp_path / "out", piece_bytes=16)
        stored = [reader.locate(ckpt.entries["dim0"], c) for c in ckpt.entries["dim0"].chunks if c.numel > 0]
    _check(pieces, data, ckpt.tensors["dim0"])
    ranges = sorted((s.fd, s.offset, s.nbytes) for s in stored if s is not None)
    hinted = sorted(reads.hints)
    assert all(n <= 16 for _, _, n in hinted) and len(hinted) < len(reads.sizes)  # windows, not a hint per piece
    for fd, offset, nbytes in ranges:  # each chunk's bytes hinted once, in windows that tile it
        mine = [(o, n) for f, o, n in hinted if f == fd and offset <= o < offset + nbytes]
        assert sum(n for _, n in mine) == nbytes and mine[0][0] == offset, (offset, nbytes, mine)


def test_a_data_file_cut_short_under_the_mover_is_a_corrupt_chunk(
    ckpt: _Ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    locate = DcpReader.locate

    def cut(self: DcpReader, entry: TensorEntry, chunk: Any) -> StoredBytes | None:
        stored = locate(self, entry, chunk)
        if stored is not None and chunk.offsets == (4, 0):  # the file ends 5 bytes into this chunk's last piece
            os.truncate(f"/proc/self/fd/{stored.fd}", stored.offset + stored.nbytes - 5)
        return stored

    monkeypatch.setattr(DcpReader, "locate", cut)
    with open_reader(ckpt.folder) as reader, pytest.raises(CorruptChunkError, match="short read.*changed while it was read"):
        _move(reader, ckpt.entries["dim0"], tmp_path / "out", piece_bytes=16)


def test_drop_cache_drops_each_piece_once_read(ckpt: _Ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dropped: list[tuple[int, int, int]] = []
    monkeypatch.setattr(_pagecache.PageCache, "read", lambda cache, fd, offset, nbytes: dropped.append((fd, offset, nbytes)))
    entry = ckpt.entries["dim0"]
    out = tmp_path / "out"
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        with open_reader(ckpt.folder) as reader:
            job = MoveJob(entry=entry, dtype=entry.dtype, file=FILE, fd=fd, offset=OFFSET)
            os.pwrite(fd, FILL * (OFFSET + job.nbytes + TAIL), 0)
            pieces = Mover(reader, 16, drop_cache=True).move(job)
            stored = [reader.locate(entry, c) for c in entry.chunks if c.numel > 0]
    finally:
        os.close(fd)
    _check(pieces, out.read_bytes(), ckpt.tensors["dim0"])
    assert sum(n for _, _, n in dropped) == sum(s.nbytes for s in stored if s is not None) == job.nbytes
    assert len(set(dropped)) == len(dropped) > len(stored)
