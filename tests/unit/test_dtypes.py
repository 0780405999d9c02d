"""dtypes.py: element types by name, checked against torch's own dtypes."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

from fsdp_convert.constants import DTYPE_NAMES, SAFETENSORS_DTYPES, SUPPORTED_DTYPES, UNCASTABLE_DTYPES
from fsdp_convert.dtypes import (
    CAST_NAMES,
    ITEMSIZES,
    SAFETENSORS_NAMES,
    UNCASTABLE,
    DType,
    as_dtype,
    is_tensor,
    safetensors_dtype,
)
from fsdp_convert.transform import fp8


@pytest.mark.parametrize("name", sorted(ITEMSIZES))
def test_each_dtype_is_torchs(name: str) -> None:
    dtype = DType(name)
    theirs = getattr(torch, name)
    assert (dtype.itemsize, dtype.is_floating_point, str(dtype), repr(dtype)) == (
        theirs.itemsize,
        theirs.is_floating_point,
        str(theirs),
        repr(theirs),
    )
    assert dtype.torch is theirs and as_dtype(theirs) is dtype and as_dtype(name) is dtype and as_dtype(dtype) is dtype
    assert dtype == theirs and theirs == dtype and not (dtype != theirs)  # either way round
    assert pickle.loads(pickle.dumps(dtype)) is dtype


def test_equal_by_name_only() -> None:
    assert DType("bfloat16") != DType("float16") and DType("bfloat16") != torch.float16
    assert len({DType("float32"), DType("float32"), as_dtype(torch.float32)}) == 1
    assert DType("float32") != "torch.float32"  # a string is not a dtype
    with pytest.raises(AttributeError):
        DType("float32").name = "float16"  # type: ignore[misc]
    with pytest.raises(TypeError, match="not a dtype"):
        as_dtype(4)


def test_tables_match_the_torch_tables() -> None:
    assert {getattr(torch, n) for n in ITEMSIZES} == SUPPORTED_DTYPES
    assert {getattr(torch, n): code for n, code in SAFETENSORS_NAMES.items()} == SAFETENSORS_DTYPES
    assert all(safetensors_dtype(code) == dtype for dtype, code in SAFETENSORS_DTYPES.items())
    assert safetensors_dtype("F128") is None
    assert {n: getattr(torch, d) for n, d in CAST_NAMES.items()} == DTYPE_NAMES
    assert {d for d in SUPPORTED_DTYPES if d.is_floating_point and as_dtype(d).name in UNCASTABLE} == UNCASTABLE_DTYPES
    assert torch.finfo(torch.float8_e4m3fn).max == fp8._FP8_MAX


def test_no_torch_needed() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from fsdp_convert.dtypes import DType, is_tensor\n"
        "d = DType('bfloat16'); assert d.itemsize == 2 and str(d) == 'torch.bfloat16' and not is_tensor(b'x')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert is_tensor(torch.zeros(1)) and not is_tensor([1])
