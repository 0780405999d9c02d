"""constants.py: the safetensors dtype table and its inverse agree with each other and with safetensors itself."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file, save, save_file

from fsdp_convert.constants import (
    SAFETENSORS_DTYPES,
    SAFETENSORS_TO_TORCH,
    SUPPORTED_DTYPES,
    safetensors_shape,
    torch_shape,
)
from tests._dtypes import DTYPES, FLOAT4, adversarial


def _header(raw: bytes) -> dict[str, dict[str, object]]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length])  # type: ignore[no-any-return]


def test_safetensors_to_torch_is_the_inverse_table() -> None:
    assert len(set(SAFETENSORS_DTYPES.values())) == len(SAFETENSORS_DTYPES)  # no two dtypes share a name
    assert {SAFETENSORS_TO_TORCH[name]: name for name in SAFETENSORS_TO_TORCH} == SAFETENSORS_DTYPES
    assert all(SAFETENSORS_DTYPES[dtype] == name for name, dtype in SAFETENSORS_TO_TORCH.items())


def test_every_safetensors_dtype_can_be_written_as_a_full_tensor() -> None:
    assert set(SAFETENSORS_DTYPES) <= SUPPORTED_DTYPES
    assert set(DTYPES.values()) <= SUPPORTED_DTYPES


def test_the_table_has_every_name_safetensors_reads_into_torch() -> None:
    """safetensors' own torch name table (private, so looked up softly) is a part of ours."""
    theirs = getattr(safetensors.torch, "_TYPES", {})
    assert {name: dtype for name, dtype in theirs.items() if dtype is not None}.items() <= SAFETENSORS_TO_TORCH.items()


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
def test_safetensors_writes_the_same_dtype_name_and_shape(tmp_path: Path, dtype: torch.dtype) -> None:
    """For every dtype: what ``safetensors.torch.save`` writes is what the table says, and
    ``load_file`` gives the dtype and bytes back; a dtype missing from the table, safetensors refuses."""
    t = adversarial(dtype, (3, 4), seed=5)
    if dtype not in SAFETENSORS_DTYPES:
        with pytest.raises(Exception):  # noqa: B017  (KeyError in safetensors 0.8: it has no name for it)
            save({"t": t})
        return
    path = tmp_path / "t.safetensors"
    save_file({"t": t}, path)
    entry = _header(path.read_bytes())["t"]
    assert entry["dtype"] == SAFETENSORS_DTYPES[dtype]
    assert entry["shape"] == safetensors_shape(dtype, (3, 4))
    assert torch_shape(dtype, entry["shape"]) == (3, 4)  # type: ignore[arg-type]
    got = load_file(path)["t"]
    assert got.dtype == SAFETENSORS_TO_TORCH[str(entry["dtype"])] == dtype
    assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_shapes_are_torch_shapes_except_float4_whose_last_dim_counts_values() -> None:
    assert safetensors_shape(torch.float8_e4m3fn, ()) == [] and torch_shape(torch.float8_e4m3fn, []) == ()
    assert safetensors_shape(torch.float32, (0, 3)) == [0, 3]
    assert FLOAT4 is not None, "every torch in the declared range (>=2.13) has float4_e2m1fn_x2"
    assert safetensors_shape(FLOAT4, (2, 3)) == [2, 6] and torch_shape(FLOAT4, [2, 6]) == (2, 3)
    assert safetensors_shape(FLOAT4, (0, 3)) == [0, 6] and torch_shape(FLOAT4, [0, 6]) == (0, 3)
    with pytest.raises(ValueError, match="0-dim float4_e2m1fn_x2"):
        safetensors_shape(FLOAT4, ())
    with pytest.raises(Exception):  # noqa: B017  (safetensors itself refuses a 0-dim float4)
        save({"t": torch.zeros((), dtype=torch.uint8).view(FLOAT4)})
    for odd in ([2, 5], []):
        with pytest.raises(ValueError, match="whole float4_e2m1fn_x2 elements"):
            torch_shape(FLOAT4, odd)
