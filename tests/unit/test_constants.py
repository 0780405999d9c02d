"""constants.py: the safetensors dtype table and its inverse agree with each other and with safetensors itself."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdp_convert.constants import SAFETENSORS_DTYPES, SAFETENSORS_TO_TORCH, SUPPORTED_DTYPES


def test_safetensors_to_torch_is_the_inverse_table() -> None:
    assert len(set(SAFETENSORS_DTYPES.values())) == len(SAFETENSORS_DTYPES)  # no two dtypes share a name
    assert {SAFETENSORS_TO_TORCH[name]: name for name in SAFETENSORS_TO_TORCH} == SAFETENSORS_DTYPES
    assert all(SAFETENSORS_DTYPES[dtype] == name for name, dtype in SAFETENSORS_TO_TORCH.items())


def test_every_safetensors_dtype_can_be_written_as_a_full_tensor() -> None:
    assert set(SAFETENSORS_DTYPES) <= SUPPORTED_DTYPES


@pytest.mark.parametrize("dtype", list(SAFETENSORS_DTYPES), ids=str)
def test_safetensors_writes_the_same_dtype_name(tmp_path: Path, dtype: torch.dtype) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"t": torch.zeros(3, dtype=dtype)}, path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    assert header["t"]["dtype"] == SAFETENSORS_DTYPES[dtype]
    assert load_file(path)["t"].dtype == SAFETENSORS_TO_TORCH[header["t"]["dtype"]]
