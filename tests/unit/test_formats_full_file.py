"""formats/full_file.py: a full checkpoint file opens by what it is; a bad safetensors header is an error."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fsdp_convert.constants import SAFETENSORS_DTYPES
from fsdp_convert.errors import CorruptChunkError, NotADcpCheckpointError
from fsdp_convert.formats.full_file import FileBoxReader, file_index, open_full_file
from fsdp_convert.formats.index import TensorEntry
from tests._compare import same_bits
from tests._dtypes import DTYPES, FLOAT4, adversarial


def _file(header: dict[str, object], data_bytes: int) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(data_bytes)


def test_a_safetensors_file_opens_with_its_tensors(tmp_path: Path) -> None:
    save_file({"w": torch.arange(6.0).reshape(2, 3)}, tmp_path / "model.safetensors")
    f = open_full_file(tmp_path / "model.safetensors")
    try:
        assert f.keys() == ["model.w"]  # a lone safetensors file holds model weights
        assert torch.equal(f.get("model.w"), torch.arange(6.0).reshape(2, 3))
    finally:
        f.close()


@pytest.mark.parametrize(
    "content",
    [
        struct.pack("<Q", 1000) + b"{}",  # header length past the end
        struct.pack("<Q", 2) + b"[]",  # header not an object
        b"\x01\x02",  # no header length
        _file({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, 4),  # unknown dtype
        _file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 4),  # offsets past the end of the file
    ],
    ids=["bad header length", "not an object", "truncated", "unknown dtype", "offsets outside the file"],
)
def test_a_bad_safetensors_file_is_corrupt(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CorruptChunkError, match="not a readable safetensors file"):
        open_full_file(path)


def test_an_unknown_file_type_is_not_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "model.npz"
    path.write_bytes(b"PK")
    with pytest.raises(NotADcpCheckpointError, match="unknown checkpoint file type '.npz'"):
        open_full_file(path)


def test_every_safetensors_dtype_indexes_and_reads_back_its_bytes(tmp_path: Path) -> None:
    """A file safetensors itself wrote, in every dtype of the table: ``file_index`` gives torch's
    dtype and shape (float4's header counts 4-bit values), and each box read is the tensor's slice."""
    tensors = {
        name: adversarial(dtype, (5, 4), seed=i) for i, (name, dtype) in enumerate(DTYPES.items()) if dtype in SAFETENSORS_DTYPES
    }
    save_file(tensors, tmp_path / "model.safetensors")
    index = file_index(tmp_path / "model.safetensors")
    entries = {e.fqn: e for e in index.entries if isinstance(e, TensorEntry)}
    assert {k: (e.dtype, e.shape) for k, e in entries.items()} == {k: (t.dtype, (5, 4)) for k, t in tensors.items()}
    with FileBoxReader(tmp_path / "model.safetensors") as reader:
        for name, t in tensors.items():
            assert same_bits(reader.read_tensor(entries[name]), t), name
            assert same_bits(reader.read_box(entries[name], (1, 0), (3, 4)), t[1:4]), name


@pytest.mark.skipif(FLOAT4 is None, reason="this torch has no float4_e2m1fn_x2")
def test_a_float4_header_of_half_an_element_is_not_a_checkpoint(tmp_path: Path) -> None:
    """F4 [2, 5] is a valid safetensors tensor (10 values, 5 bytes) that no float4_e2m1fn_x2 shape holds."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(_file({"w": {"dtype": "F4", "shape": [2, 5], "data_offsets": [0, 5]}}, 5))
    with pytest.raises(NotADcpCheckpointError, match=r"model\.safetensors: w: shape \[2, 5\] does not hold whole float4"):
        file_index(path)
