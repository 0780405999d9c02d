"""move.py: a tensor's bytes moved from DCP chunks into a byte range of an output file, checked byte for byte and by CRC-32."""

from __future__ import annotations

import json
import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_convert.constants import READ_LOG_ENV
from fsdp_convert.errors import CorruptChunkError
from fsdp_convert.formats import Reader, open_reader, read_index
from fsdp_convert.formats.dcp import DcpReader
from fsdp_convert.formats.index import TensorEntry
from fsdp_convert.move import MoveJob, Mover, move_all
from fsdp_convert.pieces import Piece, pieces_crc
from fsdp_convert.writers.dcp import MetadataEntry, write_metadata
from tests._dcp_files import RankFileWriter

OFFSET, TAIL, FILL, FILE = 13, 7, b"\xa5", 3  # the range starts at an odd offset, between bytes the mover must not touch
BF16 = torch.bfloat16
Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]


@dataclass(frozen=True)
class _Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class _Ckpt(NamedTuple):
    folder: Path
    entries: dict[str, TensorEntry]
    tensors: dict[str, torch.Tensor]


def _grid(shape: tuple[int, ...], rows: list[int], cols: list[int]) -> Boxes:
    """Boxes splitting dim 0 into ``rows`` and dim 1 into ``cols`` (sizes), whole on further dims."""
    boxes: Boxes = []
    r0 = 0
    for nr in rows:
        c0 = 0
        for nc in cols:
            boxes.append(((r0, c0, *(0,) * (len(shape) - 2)), (nr, nc, *shape[2:])))
            c0 += nc
        r0 += nr
    return boxes


def _layouts() -> dict[str, tuple[torch.Tensor, Boxes]]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(dtype)

    return {
        "dim0": (rand(10, 3), _grid((10, 3), [4, 4, 2, 0], [3])),  # FSDP's Shard(0), uneven, an empty last chunk
        "dim0_bf16": (rand(9, 5, dtype=BF16), _grid((9, 5), [5, 4], [5])),  # 10-byte rows
        "tp2d": (rand(7, 6), _grid((7, 6), [4, 3], [2, 4])),  # FSDP x TP: a 2x2 grid
        "tp3d": (rand(5, 4, 3), _grid((5, 4, 3), [3, 2], [1, 3])),
        "cols": (rand(4, 10), _grid((4, 10), [4], [6, 4])),  # split on dim 1 only
        "scalar": (rand(), [((), ())]),
        "empty": (torch.empty(0, 4), [((0, 0), (0, 4))]),
    }


def _write_ckpt(folder: Path) -> _Ckpt:
    """The layouts over two rank files (box i on rank i % 2), with the project's DCP writer."""
    folder.mkdir()
    layouts = _layouts()
    writers = [RankFileWriter(folder, rank) for rank in range(2)]
    entries = []
    for name, (t, boxes) in layouts.items():
        for i, (offsets, sizes) in enumerate(boxes):
            box = t
            for dim, (o, n) in enumerate(zip(offsets, sizes)):
                box = box.narrow(dim, o, n)
            writers[i % 2].add_box(f"model.{name}", offsets, box)
        chunks = [_Box(o, s) for o, s in boxes]
        entries.append(
            MetadataEntry(fqn=f"model.{name}", path=("model", name), dtype=t.dtype, shape=tuple(t.shape), chunks=chunks)
        )
    for w in writers:
        w.finish()
    write_metadata(folder, entries, [c for w in writers for c in w.stored], version=None)
    index = {e.fqn.removeprefix("model."): e for e in read_index(folder).tensors()}
    return _Ckpt(folder, index, {name: t for name, (t, _) in layouts.items()})


@pytest.fixture
def ckpt(tmp_path: Path) -> _Ckpt:
    return _write_ckpt(tmp_path / "ck")


@pytest.fixture
def no_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk of a local DCP folder must be located and moved undecoded."""

    def boom(self: DcpReader, entry: TensorEntry, chunk: Any) -> torch.Tensor:
        raise AssertionError(f"read_chunk({entry.fqn}, {chunk.offsets}) called: the mover decoded a local DCP chunk")

    monkeypatch.setattr(DcpReader, "read_chunk", boom)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _move(
    reader: Reader, entry: TensorEntry, out: Path, *, dtype: Any = None, rows: Any = None, piece_bytes: int = 64
) -> tuple[list[Piece], bytes]:
    """Move one job to ``OFFSET`` of a fresh file filled with ``FILL``; return the pieces and the file's bytes."""
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        job = MoveJob(entry=entry, dtype=dtype or entry.dtype, file=FILE, fd=fd, offset=OFFSET, rows=rows)
        os.pwrite(fd, FILL * (OFFSET + job.nbytes + TAIL), 0)
        pieces = Mover(reader, piece_bytes).move(job)
    finally:
        os.close(fd)
    return pieces, out.read_bytes()


def _check(pieces: list[Piece], data: bytes, expected: torch.Tensor, *, at: int = OFFSET, tail: int = TAIL) -> None:
    """The range at ``at`` holds exactly ``expected``'s bytes, the pieces tile it in order, and their CRC-32s are right."""
    want = _bytes(expected)
    n = want.numel()
    assert len(data) == at + n + tail
    assert data[:at] == FILL * at and data[at + n :] == FILL * tail, "wrote outside its range"
    assert torch.equal(torch.frombuffer(bytearray(data[at : at + n]), dtype=torch.uint8), want)
    pos = at
    for p in pieces:
        assert (p.file, p.offset) == (FILE, pos) and p.nbytes > 0
        assert p.crc32 == zlib.crc32(data[p.offset : p.offset + p.nbytes])
        pos += p.nbytes
    assert pos == at + n, "pieces do not cover the range"
    assert pieces_crc(pieces) == zlib.crc32(data[at : at + n])


def _expected(t: torch.Tensor, rows: tuple[int, int] | None, dtype: torch.dtype | None) -> torch.Tensor:
    part = t if rows is None else t[rows[0] : rows[1]]
    return part if dtype is None else part.to(dtype)


@pytest.mark.parametrize("piece_bytes", [16, 64, 1 << 20])
@pytest.mark.parametrize("name", ["dim0", "dim0_bf16", "tp2d", "tp3d", "cols"])
@pytest.mark.usefixtures("no_decode")
def test_whole_tensor_moved_undecoded(ckpt: _Ckpt, name: str, piece_bytes: int, tmp_path: Path) -> None:
    with open_reader(ckpt.folder) as reader:
        pieces, data = _move(reader, ckpt.entries[name], tmp_path / "out", piece_bytes=piece_bytes)
    _check(pieces, data, ckpt.tensors[name])
    if name in ("tp2d", "tp3d") and piece_bytes == 64:
        assert len(pieces) > 2, "several row blocks expected"


def test_each_chunk_read_once(ckpt: _Ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(READ_LOG_ENV, str(tmp_path))
    for name in ("dim0", "tp2d"):
        with open_reader(ckpt.folder) as reader:
            _move(reader, ckpt.entries[name], tmp_path / "out", piece_bytes=16)
    logged = [json.loads(line) for f in tmp_path.glob("reads-*.jsonl") for line in f.read_text().splitlines()]
    got = sorted((fqn, tuple(offsets)) for _, fqn, offsets, *_ in logged)
    assert got == sorted(
        (e.fqn, c.offsets) for name in ("dim0", "tp2d") for e in [ckpt.entries[name]] for c in e.chunks if c.numel
    )


ROWS = {
    "dim0": [(0, 10), (1, 9), (3, 5), (4, 8), (5, 6), (9, 10)],
    "dim0_bf16": [(4, 6), (0, 5), (2, 9)],
    "tp2d": [(1, 6), (0, 1), (3, 5), (4, 7), (6, 7)],
    "tp3d": [(2, 5), (0, 3), (1, 2), (4, 5)],
    "cols": [(1, 3)],
}
ROW_CASES = [(name, rows) for name, ranges in ROWS.items() for rows in ranges]


@pytest.mark.parametrize("piece_bytes", [16, 64])
@pytest.mark.parametrize(("name", "rows"), ROW_CASES)
@pytest.mark.usefixtures("no_decode")
def test_rows_cut_through_chunks(ckpt: _Ckpt, name: str, rows: tuple[int, int], piece_bytes: int, tmp_path: Path) -> None:
    with open_reader(ckpt.folder) as reader:
        pieces, data = _move(reader, ckpt.entries[name], tmp_path / "out", rows=rows, piece_bytes=piece_bytes)
    _check(pieces, data, _expected(ckpt.tensors[name], rows, None))


@pytest.mark.parametrize(
    ("name", "rows", "dtype"),
    [(n, r, BF16) for n in ("dim0", "tp2d", "tp3d", "cols") for r in (None, ROWS[n][0])]
    + [("dim0_bf16", None, torch.float32), ("dim0_bf16", (2, 9), torch.float16), ("scalar", None, BF16)],
)
@pytest.mark.usefixtures("no_decode")
def test_cast(ckpt: _Ckpt, name: str, rows: tuple[int, int] | None, dtype: torch.dtype, tmp_path: Path) -> None:
    with open_reader(ckpt.folder) as reader:
        pieces, data = _move(reader, ckpt.entries[name], tmp_path / "out", dtype=dtype, rows=rows, piece_bytes=32)
    _check(pieces, data, _expected(ckpt.tensors[name], rows, dtype))


@pytest.mark.usefixtures("no_decode")
def test_zero_dim_and_empty(ckpt: _Ckpt, tmp_path: Path) -> None:
    with open_reader(ckpt.folder) as reader:
        pieces, data = _move(reader, ckpt.entries["scalar"], tmp_path / "out")
        _check(pieces, data, ckpt.tensors["scalar"])
        assert len(pieces) == 1 and pieces[0].nbytes == 4
        for name, rows in [("empty", None), ("dim0", (3, 3))]:
            pieces, data = _move(reader, ckpt.entries[name], tmp_path / "out", rows=rows)
            assert pieces == [] and data == FILL * (OFFSET + TAIL), "nothing to write, yet something was written"


@pytest.mark.usefixtures("no_decode")
def test_tensors_saved_by_torch(tmp_path: Path) -> None:
    w, s = torch.randn(6, 5, generator=torch.Generator().manual_seed(1)), torch.tensor(2.5, dtype=torch.float64)
    dcp.save({"model": {"w": w, "s": s}}, checkpoint_id=tmp_path / "ck", no_dist=True)
    entries = {e.fqn: e for e in read_index(tmp_path / "ck").tensors()}
    cases = [("model.w", w, None, None), ("model.w", w, (2, 5), None), ("model.w", w, (1, 4), BF16), ("model.s", s, None, None)]
    with open_reader(tmp_path / "ck") as reader:
        for fqn, t, rows, dtype in cases:
            pieces, data = _move(reader, entries[fqn], tmp_path / "out", rows=rows, dtype=dtype, piece_bytes=16)
            _check(pieces, data, _expected(t, rows, dtype))


def _flip(ck: _Ckpt, name: str, offsets: tuple[int, ...], at: int) -> torch.Tensor:
    """Flip byte ``at`` of a chunk's stored elements in its data file; return the tensor now stored."""
    entry = ck.entries[name]
    chunk = next(c for c in entry.chunks if c.offsets == offsets)
    with open_reader(ck.folder) as reader:
        stored = reader.locate(entry, chunk)
    assert stored is not None and chunk.relative_path is not None and 0 <= at < stored.nbytes
    with open(ck.folder / chunk.relative_path, "r+b") as f:
        f.seek(stored.offset + at)
        byte = f.read(1)[0]
        f.seek(stored.offset + at)
        f.write(bytes([byte ^ 0xFF]))
    box = ck.tensors[name].clone()
    part = box
    for dim, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
        part = part.narrow(dim, o, n)
    flipped = part.contiguous()
    _bytes(flipped)[at] ^= 0xFF
    part.copy_(flipped)
    return box


CORRUPT = [  # name, chunk's offsets, byte flipped in its elements, rows moved, dtype written
    ("dim0", (4, 0), 5, None, None),  # streamed whole: its CRC-32 checked at its end
    ("dim0", (0, 0), 3 * 12 + 1, (0, 2), None),  # row 3 corrupt, rows 0-1 moved: the whole chunk is still checked
    ("dim0", (0, 0), 1, (2, 6), None),
    ("tp2d", (4, 2), 0, None, BF16),  # row blocks, cast
    ("tp2d", (0, 0), 31, (1, 3), None),  # row 3 of the chunk corrupt, rows 1-2 moved
    ("tp3d", (3, 1, 0), 17, (4, 5), None),
]


@pytest.mark.parametrize(("name", "offsets", "at", "rows", "dtype"), CORRUPT)
@pytest.mark.parametrize("located", [True, False])
def test_corrupt_chunk_is_refused(
    ckpt: _Ckpt, name: str, offsets: tuple[int, ...], at: int, rows: Any, dtype: Any, located: bool, tmp_path: Path
) -> None:
    stored = _flip(ckpt, name, offsets, at)
    with pytest.MonkeyPatch.context() as mp:
        if not located:
            mp.setattr(DcpReader, "locate", lambda self, entry, chunk: None)
        with open_reader(ckpt.folder) as reader, pytest.raises(CorruptChunkError, match="CRC-32"):
            _move(reader, ckpt.entries[name], tmp_path / "out", rows=rows, dtype=dtype, piece_bytes=16)
        with open_reader(ckpt.folder, check_crc=False) as reader:  # unchecked: the flipped byte goes through
            pieces, data = _move(reader, ckpt.entries[name], tmp_path / "out", rows=rows, dtype=dtype, piece_bytes=16)
    _check(pieces, data, _expected(stored, rows, dtype))


@pytest.mark.parametrize(
    ("name", "rows", "dtype"),
    [(n, r, None) for n, r in ROW_CASES]
    + [("tp3d", None, BF16), ("dim0", None, None), ("scalar", None, None), ("scalar", None, BF16)],
)
def test_fallback_to_decode_gives_the_same_bytes(
    ckpt: _Ckpt, name: str, rows: Any, dtype: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[tuple[int, ...]] = []
    read_chunk = DcpReader.read_chunk

    def counting(self: DcpReader, entry: TensorEntry, chunk: Any) -> torch.Tensor:
        decoded.append(chunk.offsets)
        return read_chunk(self, entry, chunk)

    monkeypatch.setattr(DcpReader, "locate", lambda self, entry, chunk: None)
    monkeypatch.setattr(DcpReader, "read_chunk", counting)
    with open_reader(ckpt.folder) as reader:
        pieces, data = _move(reader, ckpt.entries[name], tmp_path / "out", rows=rows, dtype=dtype, piece_bytes=16)
    _check(pieces, data, _expected(ckpt.tensors[name], rows, dtype))
    assert decoded and len(decoded) == len(set(decoded)), "each chunk met is decoded once"


def _jobs(ck: _Ckpt, fd: int) -> tuple[list[MoveJob], bytes]:
    """Many jobs laid back to back in one file (whole tensors, row runs, casts), and the bytes expected there."""
    specs: list[tuple[str, Any, Any]] = [(n, None, None) for n in ck.tensors]
    specs += [(n, r, None) for n, r in ROW_CASES] + [(n, None, BF16) for n in ("dim0", "tp2d", "tp3d", "cols")]
    jobs, want, offset = [], b"", 0
    for name, rows, dtype in specs:
        jobs.append(
            MoveJob(entry=ck.entries[name], dtype=dtype or ck.entries[name].dtype, file=FILE, fd=fd, offset=offset, rows=rows)
        )
        want += _bytes(_expected(ck.tensors[name], rows, dtype)).numpy().tobytes()
        offset += jobs[-1].nbytes
    assert len(want) == offset
    return jobs, want


@pytest.mark.usefixtures("no_decode")
def test_move_all_threads_give_the_same_file(ckpt: _Ckpt, tmp_path: Path) -> None:
    files: list[bytes] = []
    done: list[tuple[MoveJob, list[Piece]]] = []
    for threads in (1, 3):  # and with drop_cache: fdatasync and fadvise change no byte
        out = tmp_path / f"out{threads}"
        fd = os.open(out, os.O_RDWR | os.O_CREAT)
        try:
            jobs, want = _jobs(ckpt, fd)
            done.clear()
            pieces = move_all(
                lambda: open_reader(ckpt.folder),
                jobs,
                threads=threads,
                piece_bytes=48,
                drop_cache=threads > 1,
                on_done=lambda j, p: done.append((j, p)),
            )
        finally:
            os.close(fd)
        files.append(out.read_bytes())
        assert sorted(j.offset for j, _ in done) == [j.offset for j in jobs], "on_done once per job"
        for job, job_pieces in done:  # each job's own pieces: its range, their CRC-32 that of the range
            assert sum(p.nbytes for p in job_pieces) == job.nbytes and all(p in pieces for p in job_pieces)
            if job.nbytes:
                assert job_pieces[0].offset == job.offset
                assert pieces_crc(job_pieces) == zlib.crc32(files[-1][job.offset : job.offset + job.nbytes])
        _check(
            sorted(pieces, key=lambda p: p.offset), files[-1], torch.frombuffer(bytearray(want), dtype=torch.uint8), at=0, tail=0
        )
    assert files[0] == files[1]


@pytest.mark.parametrize("threads", [1, 3])
def test_move_all_raises_the_corrupt_chunk(ckpt: _Ckpt, tmp_path: Path, threads: int) -> None:
    _flip(ckpt, "tp3d", (0, 1, 0), 2)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    try:
        jobs, _ = _jobs(ckpt, fd)
        with pytest.raises(CorruptChunkError, match="CRC-32"):
            move_all(lambda: open_reader(ckpt.folder), jobs, threads=threads, piece_bytes=48)
    finally:
        os.close(fd)


@pytest.mark.parametrize("corrupt_first", [True, False])
def test_move_all_raises_the_cause_not_the_stop(
    ckpt: _Ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, corrupt_first: bool
) -> None:
    """Three threads each hold a job; one meets a corrupt chunk, the other two are stopped mid-job."""
    _flip(ckpt, "tp3d", (0, 1, 0), 2)
    barrier, started, locate, init = threading.Barrier(3, timeout=10), threading.local(), DcpReader.locate, Mover.__init__
    stops: list[threading.Event] = []

    def held(self: DcpReader, entry: TensorEntry, chunk: Any) -> Any:
        if not getattr(started, "yes", False):
            started.yes = True
            barrier.wait()  # every thread has taken its job
            if entry.fqn != "model.tp3d":  # wait for the corrupt chunk to stop every mover
                assert stops[0].wait(10), "move_all never set its stop event"
        return locate(self, entry, chunk)

    def capture(self: Mover, *args: Any, **kw: Any) -> None:
        init(self, *args, **kw)
        stops.append(kw["stop"])

    monkeypatch.setattr(DcpReader, "locate", held)
    monkeypatch.setattr(Mover, "__init__", capture)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    try:
        e = ckpt.entries
        jobs = [MoveJob(entry=e[n], dtype=e[n].dtype, file=0, fd=fd, offset=0) for n in ("dim0", "tp2d")]
        bad = MoveJob(entry=e["tp3d"], dtype=e["tp3d"].dtype, file=0, fd=fd, offset=0)
        done: list[MoveJob] = []
        with pytest.raises(CorruptChunkError, match="CRC-32"):
            jobs = [bad, *jobs] if corrupt_first else [*jobs, bad]
            move_all(lambda: open_reader(ckpt.folder), jobs, threads=3, piece_bytes=16, on_done=lambda j, p: done.append(j))
    finally:
        os.close(fd)
    assert done == [], "the other threads were not stopped"
