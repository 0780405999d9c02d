"""Layout: producer detection."""

from __future__ import annotations

from fsdp_convert.formats import read_index
from fsdp_convert.layout import detect_producer
from tests._samples import Sample


def test_detects_fsdp2(ws3_ckpt: Sample) -> None:
    assert detect_producer(read_index(ws3_ckpt.checkpoint)) == "fsdp2"
