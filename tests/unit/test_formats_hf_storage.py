"""formats/hf_storage.py: safetensors shards indexed from their headers; bad headers are errors, not guesses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fsdp_convert


def test_negative_chunk_offsets_are_refused(tmp_path: Path) -> None:
    """Two safetensors shards that claim offsets -2 and 2 of a 4-element tensor: an error, not zeros."""
    import json

    from fsdp_convert.errors import CheckpointError
    from fsdp_convert.writers.safetensors import SafetensorsWriter

    ck = tmp_path / "hf_dcp"
    ck.mkdir()
    for i, offset in enumerate((-2, 2)):
        writer = SafetensorsWriter(
            ck / f"shard-0000{i + 1}-model-00001-of-00001.safetensors",
            [(("w",), torch.float32, (2,))],
            metadata={"format": "pt", "DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [offset]}})},
        )
        writer.add_tensor(("w",), torch.ones(2))
        writer.finish()
    with pytest.raises(CheckpointError, match="non-negative"):
        fsdp_convert.consolidate(ck, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
