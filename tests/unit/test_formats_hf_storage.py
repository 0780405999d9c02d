"""formats/hf_storage.py: safetensors shards indexed from their headers; bad headers are errors, not guesses."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import fsdp_convert
from fsdp_convert.constants import SAFETENSORS_DTYPES
from fsdp_convert.errors import CorruptChunkError, NotADcpCheckpointError
from fsdp_convert.formats.hf_storage import describe_safetensors_dcp, read_header
from fsdp_convert.formats.index import TensorEntry
from tests._compare import same_bits
from tests._dtypes import DTYPES, FLOAT4, adversarial


def test_negative_chunk_offsets_are_refused(tmp_path: Path) -> None:
    """Two safetensors shards that claim offsets -2 and 2 of a 4-element tensor: an error, not zeros."""
    import json

    from safetensors.torch import save_file

    from fsdp_convert.errors import CheckpointError

    ck = tmp_path / "hf_dcp"
    ck.mkdir()
    for i, offset in enumerate((-2, 2)):
        save_file(
            {"w": torch.ones(2)},
            ck / f"shard-0000{i + 1}-model-00001-of-00001.safetensors",
            metadata={"format": "pt", "DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [offset]}})},
        )
    with pytest.raises(CheckpointError, match="non-negative"):
        fsdp_convert.consolidate(ck, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def _safetensors(path: Path, header: dict[str, Any], data: bytes, *, length: int | None = None) -> Path:
    """A safetensors file by hand: 8-byte little-endian header length, the JSON header, the data."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def _one_tensor(dtype: str = "F32", offsets: list[int] | None = None) -> dict[str, Any]:
    return {"w": {"dtype": dtype, "shape": [2, 3], "data_offsets": offsets or [0, 24]}}


def test_header_of_a_hand_made_file_indexes_one_chunk(tmp_path: Path) -> None:
    _safetensors(tmp_path / "model.safetensors", _one_tensor(), bytes(range(24)))
    header, data_start = read_header(tmp_path / "model.safetensors")
    assert header == _one_tensor() and data_start == 8 + len(json.dumps(_one_tensor()))
    index = describe_safetensors_dcp(tmp_path)
    (entry,) = index.entries
    assert isinstance(entry, TensorEntry) and entry.shape == (2, 3) and entry.dtype == torch.float32
    assert [(c.offset_bytes, c.length_bytes) for c in entry.chunks] == [(data_start, 24)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x10\x00\x00", "no header length"),
        (struct.pack("<Q", 1000) + b"{}", "header length does not fit the file"),
        (struct.pack("<Q", 2**40) + b"{}", "does not fit the file"),
        (struct.pack("<Q", 5) + b"{oops", "not a readable safetensors file"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    ],
    ids=["truncated length", "length past the end", "huge length", "not JSON", "not an object"],
)
def test_bad_header_is_corrupt(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CorruptChunkError, match=message):
        read_header(path)
    with pytest.raises(CorruptChunkError, match=message):
        describe_safetensors_dcp(tmp_path)


@pytest.mark.parametrize("offsets", [[0, 48], [24, 48], [4, 24]], ids=["past the end", "after the data", "not the shape"])
def test_data_offsets_outside_the_file_are_corrupt(tmp_path: Path, offsets: list[int]) -> None:
    _safetensors(tmp_path / "model.safetensors", _one_tensor(offsets=offsets), bytes(24))
    with pytest.raises(CorruptChunkError, match=r"its data range does not hold"):
        describe_safetensors_dcp(tmp_path)


@pytest.mark.parametrize("dtype", ["Q9", "", 7], ids=["unknown name", "empty", "not a string"])
def test_unknown_dtype_is_not_a_checkpoint(tmp_path: Path, dtype: Any) -> None:
    _safetensors(tmp_path / "model.safetensors", _one_tensor(dtype=dtype), bytes(24))
    with pytest.raises(NotADcpCheckpointError, match="malformed header entry for w"):
        describe_safetensors_dcp(tmp_path)


def test_sharded_safetensors_in_every_dtype_consolidate_bitwise(tmp_path: Path) -> None:
    """Two shard files as torch's HuggingFaceStorageWriter lays them out (rows 0-1 and 2-4, offsets
    in DCP_SHARDING_INFO), written by safetensors itself in every dtype of the table: the index has
    torch's dtypes and shapes (an F4 header counts 4-bit values) and consolidate gives the bytes back."""
    full = {
        name: adversarial(dtype, (5, 4), seed=i) for i, (name, dtype) in enumerate(DTYPES.items()) if dtype in SAFETENSORS_DTYPES
    }
    ck = tmp_path / "hf_dcp"
    ck.mkdir()
    for rank, (begin, end) in enumerate(((0, 2), (2, 5))):
        info = {name: {"saved_offsets": [begin, 0]} for name in full}
        save_file(
            {name: t[begin:end].clone() for name, t in full.items()},
            ck / f"shard-0000{rank + 1}-model-00001-of-00001.safetensors",
            metadata={"format": "pt", "DCP_SHARDING_INFO": json.dumps(info)},
        )
    index = describe_safetensors_dcp(ck)
    assert {e.fqn: (e.dtype, e.shape) for e in index.entries if isinstance(e, TensorEntry)} == {
        name: (t.dtype, (5, 4)) for name, t in full.items()
    }
    fsdp_convert.consolidate(ck, tmp_path / "full.pt", nproc=1)
    got = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    assert sorted(got) == sorted(full) and all(same_bits(got[k], t) for k, t in full.items())


@pytest.mark.skipif(FLOAT4 is None, reason="this torch has no float4_e2m1fn_x2")
def test_a_float4_header_of_half_an_element_is_malformed(tmp_path: Path) -> None:
    _safetensors(tmp_path / "model.safetensors", {"w": {"dtype": "F4", "shape": [2, 5], "data_offsets": [0, 5]}}, bytes(5))
    with pytest.raises(NotADcpCheckpointError, match="malformed header entry for w .*whole float4_e2m1fn_x2 elements"):
        describe_safetensors_dcp(tmp_path)
