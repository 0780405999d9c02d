"""formats/full_file.py: a full checkpoint file opens by what it is; a bad safetensors header is an error."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fsdp_convert.errors import CorruptChunkError, NotADcpCheckpointError
from fsdp_convert.formats.full_file import open_full_file


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
