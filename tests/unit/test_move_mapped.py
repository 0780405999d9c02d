"""move.py / blocks.py: located chunks are hashed and written from read-only mappings of the data files, one piece at a time.

One copy per byte (the write's) instead of a read into a buffer and a write: each piece is mapped
(``_pagecache.ReadMapping``), hashed and written, then unmapped before the next, so memory holds
one piece per thread. A file that cannot be mapped falls back to reads into the buffers; a file
shorter than its records is a corrupt chunk either way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from fsdp_convert import _pagecache, blocks
from fsdp_convert.errors import CorruptChunkError
from fsdp_convert.formats import open_reader
from fsdp_convert.formats.dcp import DcpReader
from fsdp_convert.formats.index import TensorEntry
from fsdp_convert.formats.reader import StoredBytes
from fsdp_convert.move import MoveJob, Mover
from tests.unit.test_move import FILE, FILL, OFFSET, TAIL, _check, _Ckpt, _expected, _move, _write_ckpt


@pytest.fixture
def ckpt(tmp_path: Path) -> _Ckpt:
    return _write_ckpt(tmp_path / "ck")


@pytest.fixture(autouse=True)
def map_every_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """These checkpoints' pieces are bytes long: map them all, as a real run maps its MiB-sized pieces."""
    monkeypatch.setattr(blocks, "MIN_MAPPED_BYTES", 0)


class _Maps:
    """Counts the mappings made and closed, and checks none is open when the page cache is told a piece was read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made = self.closed = 0
        self.reads: list[tuple[int, int, int]] = []
        maps = self
        real = _pagecache.ReadMapping

        class Counting(real):  # type: ignore[misc, valid-type]
            def __init__(self, fd: int, offset: int, nbytes: int) -> None:
                super().__init__(fd, offset, nbytes)
                maps.made += 1

            def close(self) -> None:
                super().close()
                maps.closed += 1

        def read(cache: _pagecache.PageCache, fd: int, offset: int, nbytes: int) -> None:
            assert maps.made == maps.closed, "a piece is dropped from the page cache while still mapped"
            maps.reads.append((fd, offset, nbytes))

        monkeypatch.setattr(blocks, "ReadMapping", Counting)
        monkeypatch.setattr(_pagecache.PageCache, "read", read)


def _no_read(*args: Any) -> None:
    raise AssertionError("a located chunk was read into a buffer, not mapped")


@pytest.mark.parametrize(("name", "rows"), [("dim0", None), ("dim0_bf16", None), ("dim0", (1, 7)), ("dim0", (5, 6))])
def test_located_chunks_are_moved_from_mappings_one_piece_at_a_time(
    ckpt: _Ckpt, name: str, rows: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    maps = _Maps(monkeypatch)
    monkeypatch.setattr(blocks.ChunkReads, "read_exact", _no_read)
    with open_reader(ckpt.folder) as reader:
        pieces, data = _move(reader, ckpt.entries[name], tmp_path / "out", rows=rows, piece_bytes=16)
    _check(pieces, data, _expected(ckpt.tensors[name], rows, None))
    mapped = sum(-(-p.nbytes // 16) for p in pieces)  # a piece per chunk written, mapped 16 bytes at a time
    if rows is None:
        assert maps.made == mapped > len(pieces) >= 2
    else:  # a part of a chunk: the whole chunk is read through for its CRC-32 first
        assert maps.made > mapped
    assert maps.closed == maps.made, "a mapping left open"


def test_the_whole_file_is_never_mapped_at_once(ckpt: _Ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    real = _pagecache.ReadMapping.__init__

    def init(self: Any, fd: int, offset: int, nbytes: int) -> None:
        sizes.append(nbytes)
        real(self, fd, offset, nbytes)

    monkeypatch.setattr(_pagecache.ReadMapping, "__init__", init)
    with open_reader(ckpt.folder) as reader:
        pieces, data = _move(reader, ckpt.entries["dim0"], tmp_path / "out", piece_bytes=16)
    _check(pieces, data, ckpt.tensors["dim0"])
    assert sizes and max(sizes) <= 16, sizes


def test_files_that_cannot_be_mapped_are_read_into_buffers(ckpt: _Ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def unmappable(fd: int, offset: int, nbytes: int) -> None:
        calls.append(fd)
        raise OSError(19, "No such device")  # ENODEV: a file mmap does not support

    monkeypatch.setattr(blocks, "ReadMapping", unmappable)
    with open_reader(ckpt.folder) as reader:
        for name, rows in (("dim0", None), ("dim0_bf16", (2, 7)), ("tp2d", None)):
            pieces, data = _move(reader, ckpt.entries[name], tmp_path / "out", rows=rows, piece_bytes=16)
            _check(pieces, data, _expected(ckpt.tensors[name], rows, None))
    # each mover (one per _move) gives mapping up after its first failure; tp2d's row blocks read into buffers anyway
    assert len(calls) == 2, calls


@pytest.mark.parametrize("mapped", [True, False])
def test_a_data_file_cut_short_under_the_mover_is_a_corrupt_chunk(
    ckpt: _Ckpt, mapped: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    locate = DcpReader.locate

    def cut(self: DcpReader, entry: TensorEntry, chunk: Any) -> StoredBytes | None:
        stored = locate(self, entry, chunk)
        if stored is not None and chunk.offsets == (4, 0):  # the file ends 5 bytes into this chunk's last piece
            os.truncate(f"/proc/self/fd/{stored.fd}", stored.offset + stored.nbytes - 5)
        return stored

    monkeypatch.setattr(DcpReader, "locate", cut)
    if not mapped:
        monkeypatch.setattr(blocks, "ReadMapping", lambda fd, offset, nbytes: (_ for _ in ()).throw(OSError(19, "no mmap")))
    with open_reader(ckpt.folder) as reader, pytest.raises(CorruptChunkError, match="short read.*changed while it was read"):
        _move(reader, ckpt.entries["dim0"], tmp_path / "out", piece_bytes=16)


def test_drop_cache_drops_each_piece_once_unmapped(ckpt: _Ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    maps = _Maps(monkeypatch)
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
    dropped = sum(n for _, _, n in maps.reads)
    assert dropped == sum(s.nbytes for s in stored if s is not None) == job.nbytes
    assert len(maps.reads) == maps.made == maps.closed


def test_read_mapping_is_the_files_bytes(tmp_path: Path) -> None:
    path = tmp_path / "data"
    data = os.urandom(3 * 4096 + 123)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, nbytes in ((0, 1), (1, 4096), (4095, 2), (4096, 4096), (5000, len(data) - 5000)):
            mapping = _pagecache.ReadMapping(fd, offset, nbytes)
            assert bytes(mapping.view) == data[offset : offset + nbytes]
            mapping.close()
        with pytest.raises(ValueError):
            _pagecache.ReadMapping(fd, len(data) - 10, 11)
        mapping = _pagecache.ReadMapping(fd, 10, 20)
        held = mapping.view[2:5]  # a view still alive: closing leaves the unmapping to it
        mapping.close()
        assert bytes(held) == data[12:15]
        held.release()
    finally:
        os.close(fd)


def test_pieces_under_the_mapping_threshold_are_read_not_mapped(
    ckpt: _Ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An expert's few KiB (a row segment of a stacked weight) cost more to map and unmap than to read."""
    monkeypatch.setattr(blocks, "MIN_MAPPED_BYTES", 17)  # every 16-byte piece is under it
    maps = _Maps(monkeypatch)
    with open_reader(ckpt.folder) as reader:
        pieces, data = _move(reader, ckpt.entries["dim0"], tmp_path / "out", piece_bytes=16)
    _check(pieces, data, _expected(ckpt.tensors["dim0"], None, None))
    assert maps.made == 0 and maps.reads, "pieces were mapped, or read without the page-cache hint"
