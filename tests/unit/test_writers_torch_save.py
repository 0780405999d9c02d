"""writers/torch_save.py: a file laid out ahead, its storages written in place in any order, loads back exactly."""

from __future__ import annotations

import io
import os
import subprocess
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from fsdp_convert.formats.index import unflatten
from fsdp_convert.writers.torch_save import (
    TensorSlot,
    tensor_payload_placement,
    torch_save_offsets,
    write_tensor_payload_headers,
    write_torch_save_headers,
)
from tests._compare import assert_same_state
from tests._dtypes import DTYPES as ALL_DTYPES
from tests._dtypes import SHAPES, adversarial, fqn
from tests._tensors import DTYPES, _tensor


def _items() -> list[tuple[tuple[str | int, ...], object]]:
    items: list[tuple[tuple[str | int, ...], object]] = []
    for i, dtype in enumerate(DTYPES):
        items.append((("model", f"w{i}.{dtype}".replace("torch.", "")), _tensor(dtype, (3, 5), i)))
    items += [
        (("model", "scalar"), torch.tensor(3.5)),
        (("model", "empty"), torch.empty(0, 4)),
        (("model", "fp8"), torch.arange(8.0).to(torch.float8_e4m3fn)),
        (("optim", "state", "w0", "step"), torch.tensor(2.0)),
        (("optim", "param_groups", 0, "lr"), 0.01),
        (("optim", "param_groups", 0, "betas"), (0.9, 0.95)),
        (("optim", "param_groups", 0, "params"), ["w0", "w1"]),
        (("optim", "param_groups", 1, "lr"), 0.02),
        (("train_state", "step"), 7),
    ]
    return items


def _write(out: Path, items: list[tuple[tuple[str | int, ...], object]]) -> int:
    """Lay ``items`` out, write every storage at its offset (last first, as workers might), then the headers."""
    slots = [TensorSlot(v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else None for _, v in items]
    offsets = torch_save_offsets(slots)
    crcs = {}
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        for j in reversed(range(len(items))):
            value = items[j][1]
            if isinstance(value, torch.Tensor):
                raw = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                offset = offsets[j]
                assert offset is not None
                os.pwrite(fd, raw, offset)
                crcs[j] = zlib.crc32(raw)
        return write_torch_save_headers(fd, [(p, s or v) for (p, v), s in zip(items, slots, strict=True)], crcs, offsets)
    finally:
        os.close(fd)


def test_laid_out_file_round_trips_every_dtype(tmp_path: Path) -> None:
    out = tmp_path / "x.pt"
    size = _write(out, _items())
    assert size == out.stat().st_size
    want = unflatten(_items())
    for mmap in (False, True):
        assert_same_state(torch.load(out, weights_only=True, mmap=mmap), want)


def test_every_storage_is_aligned_for_mmap_and_the_zip_checks(tmp_path: Path) -> None:
    """Storages at 64-byte offsets (torch's alignment), CRC-32s right for zipfile and unzip -t."""
    out = tmp_path / "x.pt"
    _write(out, _items())
    slots = [TensorSlot(v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else None for _, v in _items()]
    assert all(o % 64 == 0 for o in torch_save_offsets(slots) if o is not None)
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None
    done = subprocess.run(["unzip", "-t", str(out)], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "No errors detected" in done.stdout, done.stdout


def test_output_has_torch_saves_records_and_crcs(tmp_path: Path) -> None:
    """Same records as torch.save writes, and the same CRC-32 for the same storage bytes."""
    state = {"model": {"a": torch.randn(4, 3), "b": torch.tensor(1, dtype=torch.int64)}}
    ours = tmp_path / "ours.pt"
    _write(ours, [(("model", "a"), state["model"]["a"]), (("model", "b"), state["model"]["b"])])
    buf = io.BytesIO()
    torch.save(state, buf)
    with zipfile.ZipFile(ours) as z:
        mine = {i.filename.split("/", 1)[1]: i.CRC for i in z.infolist()}
    with zipfile.ZipFile(buf) as z:
        theirs = {i.filename.split("/", 1)[1]: i.CRC for i in z.infolist()}
    assert sorted(mine) == sorted(theirs)
    assert mine["data/0"] == theirs["data/0"] != 0
    assert_same_state(torch.load(ours, weights_only=True), state)


def test_output_does_not_depend_on_file_name(tmp_path: Path) -> None:
    paths = [tmp_path / "a.pt", tmp_path / ".b.pt.tmp-123"]
    for p in paths:
        _write(p, [(("x",), torch.arange(5))])
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_zip64_offsets_past_4_gib(tmp_path: Path) -> None:
    """A 4.5 GiB storage: torch's writer lays out zip64 records, and the headers land after it (sparse file)."""
    big = TensorSlot(torch.uint8, (9 << 29,))
    offsets = torch_save_offsets([big, TensorSlot(torch.float32, (3,)), None])
    assert offsets[1] is not None and offsets[1] > 1 << 32
    out = tmp_path / "big.pt"
    fd = os.open(out, os.O_RDWR | os.O_CREAT)
    try:
        small = torch.tensor([1.0, 2.0, 3.0])
        os.pwrite(fd, small.view(torch.uint8).numpy().tobytes(), offsets[1])
        zero_crc = 0
        for _ in range(9):  # CRC-32 of 9 x 512 MiB of zeros, as the sparse file reads
            zero_crc = zlib.crc32(bytes(1 << 29), zero_crc)
        crcs = {0: zero_crc, 1: zlib.crc32(small.view(torch.uint8).numpy().tobytes())}
        write_torch_save_headers(fd, [(("big",), big), (("small",), TensorSlot(torch.float32, (3,))), (("n",), 5)], crcs, offsets)
    finally:
        os.close(fd)
    loaded = torch.load(out, weights_only=True, mmap=True)
    assert loaded["n"] == 5 and torch.equal(loaded["small"], small) and loaded["big"].shape == (9 << 29,)


def test_headers_refuse_changed_offsets_or_a_missing_crc(tmp_path: Path) -> None:
    slot = TensorSlot(torch.float32, (4,))
    offsets = torch_save_offsets([slot, slot])
    fd = os.open(tmp_path / "x.pt", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(ValueError, match="no CRC-32"):
            write_torch_save_headers(fd, [(("a",), slot), (("b",), slot)], {0: 0}, offsets)
        with pytest.raises(ValueError, match="offsets changed"):  # a longer first storage moves the second
            items = [(("a",), TensorSlot(torch.float32, (40,))), (("b",), slot)]
            write_torch_save_headers(fd, items, {0: 0, 1: 0}, offsets)
    finally:
        os.close(fd)


def _dtype_items() -> list[tuple[tuple[str | int, ...], object]]:
    """Every dtype of tests/_dtypes.py in every shape there (random bits, NaN payloads, -0.0)."""
    return [(("model", fqn(name, shape_name)), t) for name, shapes in _by_dtype().items() for shape_name, t in shapes.items()]


def _by_dtype() -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: {shape_name: adversarial(dtype, shape, seed=i) for shape_name, shape in SHAPES.items()}
        for i, (name, dtype) in enumerate(ALL_DTYPES.items())
    }


def test_laid_out_file_round_trips_float8_float4_complex_and_wide_uints(tmp_path: Path) -> None:
    out = tmp_path / "x.pt"
    _write(out, _dtype_items())
    want = unflatten(_dtype_items())
    for mmap in (False, True):
        assert_same_state(torch.load(out, weights_only=True, mmap=mmap), want)
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None


@pytest.mark.parametrize("name", list(ALL_DTYPES))
def test_payload_pickle_is_torch_saves_for_every_dtype(tmp_path: Path, name: str) -> None:
    """A one-tensor payload (as DCP stores a chunk): ``data.pkl`` byte for byte what torch.save
    pickles (a legacy typed storage, or for float8/float4/uint16+/complex32 an untyped one with
    the dtype passed to ``_rebuild_tensor_v3``), and the same records."""
    for shape_name, t in _by_dtype()[name].items():
        slot = TensorSlot(t.dtype, tuple(t.shape))
        placement = tensor_payload_placement(slot)
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        path = tmp_path / f"{shape_name}.payload"
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
        try:
            os.pwrite(fd, raw, placement.data_offset)
            write_tensor_payload_headers(fd, 0, slot, zlib.crc32(raw))
            os.ftruncate(fd, placement.size)
        finally:
            os.close(fd)
        buf = io.BytesIO()
        torch.save(t, buf)
        with zipfile.ZipFile(path) as ours, zipfile.ZipFile(buf) as theirs:
            assert sorted(ours.namelist()) == sorted(theirs.namelist()), shape_name
            assert ours.read("archive/data.pkl") == theirs.read("archive/data.pkl"), shape_name
            assert ours.testzip() is None
        assert_same_state(torch.load(path, weights_only=True), t)


@pytest.mark.parametrize("value", [torch.tensor(3.0), torch.tensor([-0.0, float("nan")], dtype=torch.bfloat16)])
def test_a_tensor_rank_0_holds_is_written_as_torch_save_writes_it(tmp_path: Path, value: torch.Tensor) -> None:
    """A tensor passed as the value itself (a merged file's 0-dim step): rank 0 writes its bytes at
    its planned storage with the headers; the file is the one the workers' bytes make, and
    ``data.pkl`` and the records are torch.save's own, byte for byte."""
    items: list[tuple[tuple[str | int, ...], object]] = [(("step",), value)]
    workers = tmp_path / "workers.pt"
    _write(workers, items)  # the bytes written ahead, the slot passed
    own = tmp_path / "own.pt"
    offsets = torch_save_offsets([TensorSlot(value.dtype, tuple(value.shape))])
    fd = os.open(own, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        size = write_torch_save_headers(fd, items, {}, offsets)
    finally:
        os.close(fd)
    assert size == own.stat().st_size and own.read_bytes() == workers.read_bytes()
    buf = io.BytesIO()
    torch.save({"step": value}, buf)
    with zipfile.ZipFile(own) as ours, zipfile.ZipFile(buf) as theirs:
        assert sorted(ours.namelist()) == sorted(theirs.namelist())
        assert ours.read("archive/data.pkl") == theirs.read("archive/data.pkl")
        assert ours.read("archive/data/0") == theirs.read("archive/data/0")
        assert ours.testzip() is None
    got = torch.load(own, weights_only=True)["step"]
    assert (got.dtype, got.shape) == (value.dtype, value.shape)
    assert torch.equal(got.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8))
