"""move.py / chunk_rows.segment_runs: a derived tensor that is row segments of its inputs moves as byte-range copies.

An expert split (``adapters._common.split_experts``) and a stack (``stack_experts``) are such
tensors: each output is rows of its inputs' dim-0 chunks, so the mover streams those bytes as it
streams a plain tensor's (no block built, no ``combine``), locates each chunk once however many
outputs it feeds, and writes exactly the bytes ``Derived.compute`` would.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch

import fsdp_convert.blocks
import fsdp_convert.move
from fsdp_convert.chunk_rows import segment_runs
from fsdp_convert.derive import Derived, Input, Segment, concat
from fsdp_convert.errors import CorruptChunkError
from fsdp_convert.formats.dcp import DcpReader
from fsdp_convert.move import MoveJob, Mover
from tests.unit.test_move import _flip, _write_ckpt


def _moved(
    folder: Path, derived: list[Derived], ck_entries: dict, monkeypatch: pytest.MonkeyPatch, located: bool
) -> tuple[list[bytes], int, int]:
    """Each derived tensor moved to its own range of one file (``located``: as the reader locates its
    chunks; else as if it could locate none); (their bytes, reader.locate calls, CRC-32 checks)."""
    calls, checks = [], []
    locate, check = DcpReader.locate, fsdp_convert.blocks.check_crc

    def counting_checks(stored, crc):  # type: ignore[no-untyped-def]
        checks.append(stored.where)
        return check(stored, crc)

    def counting(self: DcpReader, entry, chunk):  # type: ignore[no-untyped-def]
        calls.append((entry.fqn, chunk.offsets))
        return locate(self, entry, chunk) if located else None

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("built block by block, not copied")

    monkeypatch.setattr(DcpReader, "locate", counting)
    monkeypatch.setattr(fsdp_convert.blocks, "check_crc", counting_checks)
    monkeypatch.setattr(fsdp_convert.move, "check_crc", counting_checks)
    monkeypatch.setattr(fsdp_convert.move, "move_derived", refuse)
    out = folder / "out.bin"
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        offset, spans = 0, []
        with DcpReader(folder / "ck", check_crc=True) as reader:
            mover = Mover(reader, piece_bytes=16)  # pieces smaller than a row: several per run
            for d in derived:
                sources = tuple(ck_entries[i.fqn] for i in d.inputs)
                job = MoveJob(entry=sources[0], dtype=d.dtype, file=0, fd=fd, offset=offset, derived=d, sources=sources)
                pieces = mover.move(job)
                data = os.pread(fd, job.nbytes, offset)
                assert sum(p.nbytes for p in pieces) == len(data)
                assert all(zlib.crc32(os.pread(fd, p.nbytes, p.offset)) == p.crc32 for p in pieces)
                spans.append(data)
                offset += job.nbytes
    finally:
        os.close(fd)
    return spans, len(calls), len(checks)


@pytest.mark.parametrize("located", [True, False], ids=["located", "decoded"])
def test_expert_split_and_join_are_byte_copies_locating_each_chunk_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, located: bool
) -> None:
    """Located chunks are streamed; chunks that cannot be (a view, a remote source) are decoded a row at a time."""
    ck = _write_ckpt(tmp_path / "ck")
    t = ck.tensors["dim0"]  # (10, 3) fp32 in dim-0 chunks of 4, 4, 2 rows (and an empty one)
    split = [
        Derived(inputs=(Input(fqn="dim0", rows=Segment(0, 2, src_start=2 * e)),), shape=(2, 3), dtype=t.dtype) for e in range(5)
    ]
    join = Derived(  # rows 7..9 then 1..4: across chunks, in another order
        inputs=(Input(fqn="dim0", rows=Segment(0, 3, src_start=7)), Input(fqn="dim0", rows=Segment(3, 4, src_start=1))),
        shape=(7, 3),
        dtype=t.dtype,
    )
    split.append(  # elements 5..8 of the (30, 1) view: parts of tensor rows 1 and 2
        Derived(inputs=(Input(fqn="dim0", rows=Segment(0, 4, src_start=5), view=(30, 1)),), shape=(4, 1), dtype=t.dtype)
    )
    got, locates, checks = _moved(tmp_path, [*split, join], ck.entries, monkeypatch, located)
    want = [d.compute([t]) if len(d.inputs) == 1 else d.compute([t, t]) for d in [*split, join]]
    assert got == [w.contiguous().numpy().tobytes() for w in want]
    assert torch.equal(want[-1], torch.cat([t[7:10], t[1:5]])) and torch.equal(want[-2], t.reshape(30, 1)[5:9])
    assert locates == 3, "each non-empty chunk is located once, not once per output it feeds"
    # chunks 0 and 1, copied in part, are read through for their CRC-32 once each (not once per
    # expert); chunk 2 (rows 8-9) is copied whole twice, checked as it streams
    assert checks == (4 if located else 0)


def test_segment_runs_leaves_other_derived_tensors_to_move_derived(tmp_path: Path) -> None:
    """A combine, a cast, chunks split on dim 1, segments out of output order: not byte ranges."""
    e = _write_ckpt(tmp_path / "ck").entries
    seg = Input(fqn="dim0", rows=Segment(0, 10))
    f32 = torch.float32
    assert segment_runs(Derived(inputs=(seg,), shape=(10, 3), dtype=f32), (e["dim0"],), f32, (0, 10)) is not None
    assert segment_runs(Derived(inputs=(seg,), shape=(10, 3), dtype=f32, combine=concat), (e["dim0"],), f32, (0, 10)) is None
    assert segment_runs(Derived(inputs=(seg,), shape=(10, 3), dtype=f32), (e["dim0"],), torch.bfloat16, (0, 10)) is None
    tp = Input(fqn="tp2d", rows=Segment(0, 7))  # chunks split on dim 1: not byte ranges
    assert segment_runs(Derived(inputs=(tp,), shape=(7, 6), dtype=f32), (e["tp2d"],), f32, (0, 7)) is None
    swapped = (Input(fqn="dim0", rows=Segment(5, 5)), Input(fqn="dim0", rows=Segment(0, 5, src_start=5)))
    assert segment_runs(Derived(inputs=swapped, shape=(10, 3), dtype=f32), (e["dim0"], e["dim0"]), f32, (0, 10)) is None


def test_expert_copied_from_a_corrupt_chunk_is_refused(tmp_path: Path) -> None:
    """An expert's rows are good but another row of its chunk is not: the chunk's CRC-32 still refuses it."""
    ck = _write_ckpt(tmp_path / "ck")
    _flip(ck, "dim0", (0, 0), 3 * 12 + 1)  # row 3 of chunk 0; expert 0 is rows 0-1
    expert = Derived(inputs=(Input(fqn="dim0", rows=Segment(0, 2)),), shape=(2, 3), dtype=torch.float32)
    fd = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT)
    try:
        with DcpReader(ck.folder, check_crc=True) as reader, pytest.raises(CorruptChunkError, match="CRC-32 mismatch"):
            entry = ck.entries["dim0"]
            Mover(reader, piece_bytes=16).move(
                MoveJob(entry=entry, dtype=torch.float32, file=0, fd=fd, offset=0, derived=expert, sources=(entry,))
            )
    finally:
        os.close(fd)
