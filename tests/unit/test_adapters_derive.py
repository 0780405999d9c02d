"""derive.py and the mover's derived path: output tensors computed row block by row block from checkpoint chunks.

Each case writes a small DCP folder (tensor-parallel boxes and uneven dim-0 chunks over two rank
files), moves one ``Derived`` output with tiny buffers (one-row blocks) and large ones, whole and
by reshard row ranges, and compares with the same computation done on the whole tensors in torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_convert.derive import ALIGNED, Derived, Gather, HeadPermute, Input, Segment, TensorInfo, apply_adapter, concat
from fsdp_convert.errors import CorruptChunkError, ShapeMismatchError, UnsupportedTransformError
from fsdp_convert.formats import open_reader, read_index
from fsdp_convert.formats.index import TensorEntry
from fsdp_convert.move import MoveJob, Mover
from fsdp_convert.writers.dcp import MetadataEntry, write_metadata
from tests._dcp_files import RankFileWriter

BF16 = torch.bfloat16


@dataclass(frozen=True)
class _Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _ints(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Small integers: every sum and product below is exact in fp32 and bf16, whatever the block size."""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


TENSORS = {
    "w": (_ints(8, 6, seed=1, dtype=BF16), [((0, 0), (5, 2)), ((0, 2), (5, 4)), ((5, 0), (3, 2)), ((5, 2), (3, 4))]),
    "b": (_ints(8, 2, seed=2), [((0, 0), (3, 2)), ((3, 0), (5, 2))]),
    "a": (_ints(2, 6, seed=3), [((0, 0), (2, 6))]),
    "k": (_ints(4, 6, seed=4, dtype=BF16), [((0, 0), (2, 6)), ((2, 0), (2, 6))]),
    "experts": (_ints(3, 4, 2, seed=5), [((0, 0, 0), (2, 4, 2)), ((2, 0, 0), (1, 4, 2))]),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, TensorEntry]]:
    folder = tmp_path_factory.mktemp("derive") / "ck"
    folder.mkdir()
    writers = [RankFileWriter(folder, rank) for rank in range(2)]
    metadata = []
    for name, (t, boxes) in TENSORS.items():
        for i, (offsets, sizes) in enumerate(boxes):
            box = t
            for dim, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
                box = box.narrow(dim, o, n)
            writers[i % 2].add_box(name, offsets, box)
        chunks = [_Box(o, s) for o, s in boxes]
        metadata.append(MetadataEntry(fqn=name, path=(name,), dtype=t.dtype, shape=tuple(t.shape), chunks=chunks))
    for w in writers:
        w.finish()
    write_metadata(folder, metadata, [c for w in writers for c in w.stored], version=None)
    return folder, {e.fqn: e for e in read_index(folder).tensors()}


@dataclass(frozen=True, slots=True)
class LoraMerge:
    """The LoRA combine of the module docstring: ``W + scale * B @ A`` in fp32."""

    scale: float

    def __call__(self, parts: Any) -> torch.Tensor:
        w, b, a = parts
        return w.float() + self.scale * (b.float() @ a.float())


def _move(
    folder: Path, entries: dict[str, TensorEntry], derived: Derived, tmp: Path, *, piece_bytes: int, rows: Any = None
) -> torch.Tensor:
    dtype = derived.dtype
    out = tmp / "out"
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        sources = tuple(entries[i.fqn] for i in derived.inputs)
        job = MoveJob(entry=sources[0], dtype=dtype, file=0, fd=fd, offset=3, rows=rows, derived=derived, sources=sources)
        os.pwrite(fd, b"\0" * (3 + job.nbytes), 0)
        with open_reader(folder) as reader:
            pieces = Mover(reader, piece_bytes).move(job)
    finally:
        os.close(fd)
    assert sum(p.nbytes for p in pieces) == job.nbytes
    shape = derived.shape if rows is None else (rows[1] - rows[0], *derived.shape[1:])
    return torch.frombuffer(bytearray(out.read_bytes()[3:]), dtype=dtype.torch).view(shape)


def _titan_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """torchtitan 0.3.0's Llama3StateDictAdapter._permute (to HF's RoPE layout), copied."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2).clone()


PIECES = [16, 64, 1 << 20]  # one-row blocks, a few rows, the whole tensor


@pytest.mark.parametrize("piece_bytes", PIECES)
@pytest.mark.parametrize("rows", [None, (0, 3), (3, 8), (5, 6)])
def test_lora_merge_by_aligned_row_blocks(ckpt: Any, tmp_path: Path, piece_bytes: int, rows: Any) -> None:
    folder, entries = ckpt
    w, b, a = (TENSORS[n][0] for n in "wba")
    derived = Derived(
        inputs=(Input(fqn="w"), Input(fqn="b"), Input(fqn="a", rows=None)), shape=(8, 6), dtype=BF16, combine=LoraMerge(0.5)
    )
    got = _move(folder, entries, derived, tmp_path, piece_bytes=piece_bytes, rows=rows)
    want = (w.float() + 0.5 * b @ a).to(BF16)
    assert torch.equal(got, want if rows is None else want[rows[0] : rows[1]])


@pytest.mark.parametrize("piece_bytes", PIECES)
@pytest.mark.parametrize("n_heads", [1, 2])
def test_rope_permutation_is_torchtitans(ckpt: Any, tmp_path: Path, piece_bytes: int, n_heads: int) -> None:
    folder, entries = ckpt
    w = TENSORS["w"][0]
    to_hf = Derived(inputs=(Input(fqn="w", rows=HeadPermute(n_heads, 8 // n_heads)),), shape=(8, 6), dtype=BF16)
    got = _move(folder, entries, to_hf, tmp_path, piece_bytes=piece_bytes)
    assert torch.equal(got, _titan_permute(w, n_heads))
    back = HeadPermute(n_heads, 8 // n_heads, to_hf=False)
    assert torch.equal(got[list(back(0, 8))], w), "the reverse permutation undoes it"


@pytest.mark.parametrize("piece_bytes", PIECES)
def test_segments_join_and_split(ckpt: Any, tmp_path: Path, piece_bytes: int) -> None:
    """A fused weight joined from two (``concat`` of segments), and a slice of one back out."""
    folder, entries = ckpt
    w, k = TENSORS["w"][0], TENSORS["k"][0]
    join = Derived(inputs=(Input(fqn="w", rows=Segment(0, 8)), Input(fqn="k", rows=Segment(8, 4))), shape=(12, 6), dtype=BF16)
    assert torch.equal(_move(folder, entries, join, tmp_path, piece_bytes=piece_bytes), torch.cat([w, k]))
    assert torch.equal(_move(folder, entries, join, tmp_path, piece_bytes=piece_bytes, rows=(6, 10)), torch.cat([w, k])[6:10])
    part = Derived(inputs=(Input(fqn="w", rows=Segment(0, 3, src_start=4)),), shape=(3, 6), dtype=torch.float32)
    assert torch.equal(_move(folder, entries, part, tmp_path, piece_bytes=piece_bytes), w[4:7].float())


@pytest.mark.parametrize("piece_bytes", PIECES)
def test_views_split_and_stack_experts(ckpt: Any, tmp_path: Path, piece_bytes: int) -> None:
    """A stacked ``(E, F, D)`` expert weight read as ``(E * F, D)`` rows: one expert out, and all stacked back."""
    folder, entries = ckpt
    experts = TENSORS["experts"][0]
    one = Derived(inputs=(Input(fqn="experts", rows=Segment(0, 4, src_start=8), view=(12, 2)),), shape=(4, 2), dtype=BF16)
    assert torch.equal(_move(folder, entries, one, tmp_path, piece_bytes=piece_bytes), experts[2].to(BF16))
    stacked = Derived(
        inputs=(Input(fqn="experts", view=(12, 2)),), shape=(3, 4, 2), dtype=torch.float32, view=(12, 2), combine=concat
    )
    assert torch.equal(_move(folder, entries, stacked, tmp_path, piece_bytes=piece_bytes, rows=(1, 3)), experts[1:3])


def test_gather_with_gaps_still_checks_every_crc(ckpt: Any, tmp_path: Path) -> None:
    """Rows picked with gaps leave a chunk's in-order CRC-32 unfinished: it is read through once more and checked."""
    folder, entries = ckpt
    copy = tmp_path / "ck"
    copy.mkdir()
    for f in folder.iterdir():
        copy.joinpath(f.name).write_bytes(f.read_bytes())
    gather = Derived(inputs=(Input(fqn="b", rows=Gather((0, 2, 7))),), shape=(3, 2), dtype=torch.float32)
    assert torch.equal(_move(copy, entries, gather, tmp_path, piece_bytes=16), TENSORS["b"][0][[0, 2, 7]])
    chunk = entries["b"].chunks[0]  # rows 0-2, of which row 1 is never asked for
    with open_reader(copy) as reader:
        stored = reader.locate(entries["b"], chunk)
        assert stored is not None
        at = stored.offset + 8  # inside row 1
    data = bytearray((copy / chunk.relative_path).read_bytes())  # type: ignore[operator]
    data[at] ^= 0xFF
    (copy / chunk.relative_path).write_bytes(data)  # type: ignore[operator]
    with pytest.raises(CorruptChunkError, match="CRC-32"):
        _move(copy, entries, gather, tmp_path, piece_bytes=16)


def _transposed(parts: Any) -> torch.Tensor:
    return parts[0].t()


def test_combine_of_the_wrong_shape_names_the_inputs(ckpt: Any, tmp_path: Path) -> None:
    folder, entries = ckpt
    bad = Derived(inputs=(Input(fqn="b"),), shape=(8, 2), dtype=torch.float32, combine=_transposed)
    with pytest.raises(ShapeMismatchError, match="derived from b"):
        _move(folder, entries, bad, tmp_path, piece_bytes=1 << 20)


def test_check_refuses_what_does_not_fit() -> None:
    infos = {"w": TensorInfo("w", BF16, (8, 6)), "e": TensorInfo("e", BF16, (3, 4, 2))}
    with pytest.raises(UnsupportedTransformError, match="out: its input missing"):
        Derived(inputs=(Input(fqn="missing"),), shape=(8, 6), dtype=BF16).check("out", infos)
    with pytest.raises(UnsupportedTransformError, match="reads rows up to 8 of w"):
        Derived(inputs=(Input(fqn="w", rows=Gather((8,))),), shape=(1, 6), dtype=BF16).check("out", infos)
    with pytest.raises(UnsupportedTransformError, match="e: cannot be viewed as"):
        Derived(inputs=(Input(fqn="e", view=(4, 6)),), shape=(4, 6), dtype=BF16).check("out", infos)


def test_apply_adapter_keeps_plain_copies_undecoded(ckpt: Any) -> None:
    """An output that is one input as it is carries no Derived (its bytes move undecoded); others do."""
    _, entries = ckpt

    def adapter(tensors: Any) -> dict[str, Derived]:
        by = {t.fqn: t for t in tensors}
        return {
            "renamed": Derived(inputs=(Input(fqn="w", rows=ALIGNED),), shape=by["w"].shape, dtype=BF16),
            "permuted": Derived(inputs=(Input(fqn="k", rows=HeadPermute(1, 4)),), shape=(4, 6), dtype=BF16),
        }

    out = apply_adapter(adapter, [(e, fqn) for fqn, e in entries.items()])
    assert [(fqn, derived is None) for _, fqn, derived, _ in out] == [("renamed", True), ("permuted", False)]


def test_compute_is_what_the_mover_writes(ckpt: Any, tmp_path: Path) -> None:
    folder, entries = ckpt
    derived = Derived(
        inputs=(Input(fqn="w", rows=HeadPermute(2, 4)), Input(fqn="b"), Input(fqn="a", rows=None)),
        shape=(8, 6),
        dtype=BF16,
        combine=LoraMerge(0.25),
    )
    whole = derived.compute([TENSORS[n][0] for n in "wba"])
    assert torch.equal(_move(folder, entries, derived, tmp_path, piece_bytes=16), whole)
