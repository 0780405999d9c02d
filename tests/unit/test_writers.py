"""Streaming writers: what they write loads back exactly with torch's and safetensors' own loaders."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdp_convert.errors import OutputExistsError
from fsdp_convert.layout import unflatten
from fsdp_convert.writers import SafetensorsWriter, TorchSaveWriter, atomic_output
from tests._compare import assert_same_state

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.complex64,
]  # fmt: skip


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype)[: torch.Size(shape).numel()].reshape(shape)
    return t.to(torch.bool) if dtype == torch.bool else t


def _items() -> list[tuple[tuple[str | int, ...], object]]:
    items: list[tuple[tuple[str | int, ...], object]] = []
    for i, dtype in enumerate(DTYPES):
        items.append((("model", f"w{i}.{dtype}".replace("torch.", "")), _tensor(dtype, (3, 5), i)))
    items += [
        (("model", "scalar"), torch.tensor(3.5)),
        (("model", "empty"), torch.empty(0, 4)),
        (("model", "view"), torch.arange(40.0).reshape(8, 5)[2:6]),  # storage larger than the tensor
        (("model", "transposed"), torch.arange(12.0).reshape(3, 4).t()),  # non-contiguous
        (("optim", "state", "w0", "step"), torch.tensor(2.0)),
        (("optim", "param_groups", 0, "lr"), 0.01),
        (("optim", "param_groups", 0, "betas"), (0.9, 0.95)),
        (("optim", "param_groups", 0, "params"), ["w0", "w1"]),
        (("optim", "param_groups", 1, "lr"), 0.02),
        (("train_state", "step"), 7),
    ]
    return items


def test_torch_save_writer_round_trips_every_dtype(tmp_path: Path) -> None:
    out = tmp_path / "x.pt"
    writer = TorchSaveWriter(out)
    for path, value in _items():
        if isinstance(value, torch.Tensor):
            writer.add_tensor(path, value)
        else:
            writer.add_value(path, value)
    size = writer.finish()
    assert size == out.stat().st_size
    want = unflatten((p, v.contiguous() if isinstance(v, torch.Tensor) else v) for p, v in _items())
    for mmap in (False, True):
        assert_same_state(torch.load(out, weights_only=True, mmap=mmap), want)


def test_torch_save_writer_output_does_not_depend_on_file_name(tmp_path: Path) -> None:
    paths = [tmp_path / "a.pt", tmp_path / ".b.pt.tmp-123"]
    for p in paths:
        w = TorchSaveWriter(p)
        w.add_tensor(("x",), torch.arange(5))
        w.finish()
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_torch_save_writer_loads_like_torch_save(tmp_path: Path) -> None:
    """Same structure as torch.save writes: compare what both give back, records included."""
    state = {"model": {"a": torch.randn(4, 3), "b": torch.tensor(1, dtype=torch.int64)}}
    w = TorchSaveWriter(tmp_path / "ours.pt")
    w.add_tensor(("model", "a"), state["model"]["a"])
    w.add_tensor(("model", "b"), state["model"]["b"])
    w.finish()
    buf = io.BytesIO()
    torch.save(state, buf)
    import zipfile

    ours = sorted(n.split("/", 1)[1] for n in zipfile.ZipFile(tmp_path / "ours.pt").namelist())
    theirs = sorted(n.split("/", 1)[1] for n in zipfile.ZipFile(buf).namelist())
    assert ours == theirs
    assert_same_state(torch.load(tmp_path / "ours.pt", weights_only=True), state)


def test_safetensors_writer_matches_safetensors_library(tmp_path: Path) -> None:
    tensors = {f"layer.{i}": _tensor(dtype, (2, 3), i) for i, dtype in enumerate(DTYPES) if dtype not in (torch.complex64,)}
    tensors["scalar"] = torch.tensor(1.5)
    tensors["empty"] = torch.empty(0, 2)
    layout = [(("model", name), t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    w = SafetensorsWriter(tmp_path / "ours.safetensors", layout)
    for name, t in tensors.items():
        w.add_tensor(("model", name), t)
    w.finish()
    got = load_file(tmp_path / "ours.safetensors")
    save_file(tensors, tmp_path / "theirs.safetensors")
    theirs = load_file(tmp_path / "theirs.safetensors")
    assert sorted(got) == sorted(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(
            got[name].reshape(-1).view(torch.uint8), theirs[name].reshape(-1).view(torch.uint8)
        ), name


def test_safetensors_writer_refuses_tensor_out_of_order(tmp_path: Path) -> None:
    w = SafetensorsWriter(
        tmp_path / "x.safetensors", [(("model", "a"), torch.float32, (2,)), (("model", "b"), torch.float32, (2,))]
    )
    with pytest.raises(ValueError, match="expected"):
        w.add_tensor(("model", "b"), torch.zeros(2))
    w.close()


def test_atomic_output_leaves_nothing_on_error(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    with pytest.raises(RuntimeError), atomic_output(out, overwrite=False) as tmp:
        tmp.write_bytes(b"partial")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_replaces_only_at_the_end(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    out.write_bytes(b"old")
    with pytest.raises(OutputExistsError), atomic_output(out, overwrite=False):
        pass
    with atomic_output(out, overwrite=True) as tmp:
        tmp.write_bytes(b"new")
        assert out.read_bytes() == b"old"
    assert out.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.pt"]


def test_torch_save_writer_zip_crcs_are_valid(tmp_path: Path) -> None:
    """CRCs are computed with zlib and patched in: zipfile's own check passes, and matches torch's."""
    import zipfile

    out = tmp_path / "x.pt"
    w = TorchSaveWriter(out)
    w.add_tensor(("a",), torch.randn(1000))
    w.add_tensor(("b",), torch.arange(7, dtype=torch.int16))
    w.add_value(("c",), 3)
    w.finish()
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None
        ours = {i.filename.split("/", 1)[1]: i.CRC for i in z.infolist()}
    buf = io.BytesIO()
    torch.save({"a": torch.load(out, weights_only=True)["a"]}, buf)
    with zipfile.ZipFile(buf) as z:
        theirs = {i.filename.split("/", 1)[1]: i.CRC for i in z.infolist()}
    assert ours["data/0"] == theirs["data/0"] != 0
