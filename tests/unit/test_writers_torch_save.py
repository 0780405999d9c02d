"""writers/torch_save.py: what TorchSaveWriter writes loads back exactly with torch.load, zip CRCs included."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from fsdp_convert.formats.index import unflatten
from fsdp_convert.writers import TorchSaveWriter
from tests._compare import assert_same_state
from tests._tensors import DTYPES, _tensor


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
