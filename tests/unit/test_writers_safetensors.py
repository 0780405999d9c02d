"""writers/safetensors.py: a file laid out by safetensors_layout and filled in place is what the safetensors library writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdp_convert.writers.safetensors import safetensors_layout
from tests._tensors import DTYPES, _tensor


def test_layout_filled_in_place_matches_safetensors_library(tmp_path: Path) -> None:
    tensors = {f"layer.{i}": _tensor(dtype, (2, 3), i) for i, dtype in enumerate(DTYPES) if dtype not in (torch.complex64,)}
    tensors["scalar"] = torch.tensor(1.5)
    tensors["empty"] = torch.empty(0, 2)
    layout = safetensors_layout([(("model", name), t.dtype, tuple(t.shape)) for name, t in tensors.items()])
    out = tmp_path / "ours.safetensors"
    with open(out, "wb") as f:
        f.write(layout.header)
        for t, offset in zip(reversed(tensors.values()), reversed(layout.data_offsets), strict=True):  # any order
            f.seek(offset)
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    assert out.stat().st_size == layout.size
    got = load_file(out)
    save_file(tensors, tmp_path / "theirs.safetensors")
    theirs = load_file(tmp_path / "theirs.safetensors")
    assert sorted(got) == sorted(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(
            got[name].reshape(-1).view(torch.uint8), theirs[name].reshape(-1).view(torch.uint8)
        ), name


def test_layout_refuses_two_tensors_of_one_name() -> None:
    with pytest.raises(ValueError, match="both named a"):
        safetensors_layout([(("model", "a"), torch.float32, (2,)), (("model", "a"), torch.float32, (2,))])
