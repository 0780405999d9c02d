"""writers/safetensors.py: a file laid out by safetensors_placement and filled in place is what the safetensors library writes."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save, save_file

from fsdp_convert.constants import SAFETENSORS_DTYPES
from fsdp_convert.writers.safetensors import safetensors_placement
from tests._dtypes import DTYPES as ALL_DTYPES
from tests._dtypes import FLOAT4, adversarial
from tests._tensors import DTYPES, _tensor


def test_placement_filled_in_place_matches_safetensors_library(tmp_path: Path) -> None:
    tensors = {f"layer.{i}": _tensor(dtype, (2, 3), i) for i, dtype in enumerate(DTYPES) if dtype not in (torch.complex64,)}
    tensors["scalar"] = torch.tensor(1.5)
    tensors["empty"] = torch.empty(0, 2)
    placement = safetensors_placement([(("model", name), t.dtype, tuple(t.shape)) for name, t in tensors.items()])
    out = tmp_path / "ours.safetensors"
    with open(out, "wb") as f:
        f.write(placement.header)
        for t, offset in zip(reversed(tensors.values()), reversed(placement.data_offsets), strict=True):  # any order
            f.seek(offset)
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    assert out.stat().st_size == placement.size
    got = load_file(out)
    save_file(tensors, tmp_path / "theirs.safetensors")
    theirs = load_file(tmp_path / "theirs.safetensors")
    assert sorted(got) == sorted(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(
            got[name].reshape(-1).view(torch.uint8), theirs[name].reshape(-1).view(torch.uint8)
        ), name


def test_placement_refuses_two_tensors_of_one_name() -> None:
    with pytest.raises(ValueError, match="both named a"):
        safetensors_placement([(("model", "a"), torch.float32, (2,)), (("model", "a"), torch.float32, (2,))])


def _header(raw: bytes) -> dict[str, Any]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length])  # type: ignore[no-any-return]


def test_every_safetensors_dtype_has_the_header_safetensors_writes(tmp_path: Path) -> None:
    """Every dtype of the table, random bits (float8 NaNs, float4 pairs, uint64s): each header entry
    says what ``safetensors.torch.save`` says for the tensor, and ``load_file`` gives its bytes back."""
    tensors = {
        f"{name}.{shape_name}": adversarial(dtype, shape, seed=i)
        for i, (name, dtype) in enumerate(ALL_DTYPES.items())
        if dtype in SAFETENSORS_DTYPES
        for shape_name, shape in (("odd", (3, 5)), ("empty", (0, 2)), ("scalar", ()))
        if shape or dtype != FLOAT4
    }
    assert {t.dtype for t in tensors.values()} == set(SAFETENSORS_DTYPES)
    placement = safetensors_placement([(("model", name), t.dtype, tuple(t.shape)) for name, t in tensors.items()])
    out = tmp_path / "ours.safetensors"
    with open(out, "wb") as f:
        f.write(placement.header)
        for t, offset in zip(tensors.values(), placement.data_offsets, strict=True):
            f.seek(offset)
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        f.truncate(placement.size)
    ours = _header(out.read_bytes())
    theirs = _header(save(tensors))
    assert ours.pop("__metadata__") == {"format": "pt"}
    for name, t in tensors.items():
        assert ours[name]["dtype"] == theirs[name]["dtype"] and ours[name]["shape"] == theirs[name]["shape"], name
        begin, end = ours[name]["data_offsets"]
        assert end - begin == t.nbytes, name
    got = load_file(out)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize(
    ("dtype", "shape", "detail"),
    [
        (torch.complex128, (2,), "safetensors has no dtype for complex128"),
        (torch.complex32, (2,), "safetensors has no dtype for complex32"),
        *([(FLOAT4, (), "0-dim float4_e2m1fn_x2")] if FLOAT4 is not None else []),
    ],
    ids=str,
)
def test_placement_refuses_what_safetensors_cannot_hold_naming_the_tensor(
    dtype: torch.dtype, shape: tuple[int, ...], detail: str
) -> None:
    with pytest.raises(ValueError) as caught:
        safetensors_placement([(("model", "ok"), torch.float32, (2,)), (("model", "layers", "0", "w"), dtype, shape)])
    message = str(caught.value)
    assert message.startswith("layers.0.w: ") and detail in message and "\n" not in message, message
