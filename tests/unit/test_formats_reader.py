"""formats/reader.py: a box or a full tensor is assembled from the chunks it meets, and only those are read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_convert.formats import read_index
from fsdp_convert.formats.dcp import DcpReader
from fsdp_convert.formats.index import ChunkEntry, TensorEntry
from fsdp_convert.formats.reader import StoredBytes

FULL = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
# four 2x3 quarters of FULL, each saved as its own tensor: (row, col) of the quarter
QUARTERS = {f"q{r}{c}": (r, c) for r in (0, 1) for c in (0, 1)}


class _CountingReader(DcpReader):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.read: list[tuple[int, ...]] = []
        self.in_place: list[tuple[int, ...]] = []

    def read_chunk(self, entry: TensorEntry, chunk: ChunkEntry) -> torch.Tensor:
        self.read.append(chunk.offsets)
        return super().read_chunk(entry, chunk)

    def locate(self, entry: TensorEntry, chunk: ChunkEntry) -> StoredBytes | None:
        stored = super().locate(entry, chunk)
        if stored is not None:  # read_box then reads it undecoded, straight into the box
            self.read.append(chunk.offsets)
            self.in_place.append(chunk.offsets)
        return stored


@pytest.fixture
def quartered(tmp_path: Path) -> tuple[Path, TensorEntry]:
    """A DCP folder of four quarters, and a hand-made entry of FULL whose four chunks are their payloads."""
    state = {name: FULL[2 * r : 2 * r + 2, 3 * c : 3 * c + 3].clone() for name, (r, c) in QUARTERS.items()}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    index = read_index(tmp_path)
    chunks = []
    for e in index.tensors():
        r, c = QUARTERS[e.fqn]
        (stored,) = e.chunks
        chunks.append(
            ChunkEntry(
                offsets=(2 * r, 3 * c), sizes=(2, 3), relative_path=stored.relative_path,
                offset_bytes=stored.offset_bytes, length_bytes=stored.length_bytes,
            )
        )  # fmt: skip
    entry = TensorEntry(fqn="w", path=("w",), shape=(4, 6), dtype=torch.float32, chunks=tuple(chunks))
    return tmp_path, entry


@pytest.mark.parametrize(
    ("offsets", "sizes", "meets"),
    [
        ((2, 3), (2, 3), [(2, 3)]),  # exactly one chunk
        ((2, 1), (2, 2), [(2, 0)]),  # inside one chunk, touching its neighbour's edge at column 3
        ((1, 2), (2, 2), [(0, 0), (0, 3), (2, 0), (2, 3)]),  # the middle: a corner of each
        ((0, 3), (4, 1), [(0, 3), (2, 3)]),  # a column
    ],
)
def test_read_box_reads_only_the_chunks_it_meets(
    quartered: tuple[Path, TensorEntry], offsets: tuple[int, int], sizes: tuple[int, int], meets: list[tuple[int, int]]
) -> None:
    root, entry = quartered
    with _CountingReader(root) as reader:
        box = reader.read_box(entry, offsets, sizes)
    assert torch.equal(box, FULL[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]])
    assert sorted(reader.read) == sorted(meets)


def test_read_tensor_assembles_every_chunk_in_place(quartered: tuple[Path, TensorEntry]) -> None:
    root, entry = quartered
    with _CountingReader(root) as reader:
        full = reader.read_tensor(entry)
    assert torch.equal(full, FULL) and full.is_contiguous()
    assert sorted(reader.read) == [(0, 0), (0, 3), (2, 0), (2, 3)]


def test_read_tensor_places_row_chunks_stored_out_of_order(tmp_path: Path) -> None:
    dcp.save({"top": FULL[:1].clone(), "rest": FULL[1:].clone()}, checkpoint_id=tmp_path, no_dist=True)
    stored = {e.fqn: e.chunks[0] for e in read_index(tmp_path).tensors()}
    chunks = tuple(
        ChunkEntry(
            offsets=(start, 0), sizes=(rows, 6), relative_path=stored[name].relative_path,
            offset_bytes=stored[name].offset_bytes, length_bytes=stored[name].length_bytes,
        )
        for name, start, rows in (("rest", 1, 3), ("top", 0, 1))
    )  # fmt: skip
    entry = TensorEntry(fqn="w", path=("w",), shape=(4, 6), dtype=torch.float32, chunks=chunks)
    with DcpReader(tmp_path) as reader:
        full = reader.read_tensor(entry)
    assert torch.equal(full, FULL)


def test_whole_rows_are_read_undecoded_into_the_tensor_and_their_crc_checked(tmp_path: Path) -> None:
    """A row chunk stored as its bare storage is read straight into the full tensor (no decode, no copy), CRC-32 checked."""
    from fsdp_convert.errors import CorruptChunkError

    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    dcp.save({"top": full[:2].clone(), "bottom": full[2:].clone()}, checkpoint_id=tmp_path, no_dist=True)
    index = read_index(tmp_path)
    halves = {e.fqn: e.chunks[0] for e in index.tensors()}
    chunks = tuple(
        ChunkEntry(
            offsets=(r, 0), sizes=(2, 6), relative_path=c.relative_path, offset_bytes=c.offset_bytes, length_bytes=c.length_bytes
        )
        for r, c in ((0, halves["top"]), (2, halves["bottom"]))
    )
    entry = TensorEntry(fqn="w", path=("w",), shape=(4, 6), dtype=torch.float32, chunks=chunks)
    with _CountingReader(tmp_path) as reader:
        got = reader.read_tensor(entry)
    assert torch.equal(got.view(torch.int32), full.view(torch.int32)) and reader.in_place == [(0, 0), (2, 0)]
    with _CountingReader(tmp_path) as reader:
        stored = reader.locate(entry, chunks[1])
        assert stored is not None
    data = tmp_path / chunks[1].relative_path
    raw = bytearray(data.read_bytes())
    raw[stored.offset] ^= 0x40  # one bit of the bottom half's elements
    data.write_bytes(bytes(raw))
    with _CountingReader(tmp_path) as reader, pytest.raises(CorruptChunkError, match="CRC-32 mismatch"):
        reader.read_tensor(entry)
