"""writers/safetensors.py: SafetensorsWriter writes what the safetensors library writes, in the declared order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdp_convert.writers import SafetensorsWriter
from tests._tensors import DTYPES, _tensor


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
