"""torch.save files written through writers/torch_save.py with torch-free dtype records; imports no torch.

Used in-process and by a subprocess in which ``import torch`` fails (tests/unit/test_torch_zip.py).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

from fsdp_convert.writers.torch_save import (
    TensorSlot,
    tensor_payload_placement,
    torch_save_offsets,
    write_tensor_payload_headers,
    write_torch_save_headers,
)


class Dtype:
    """A dtype record as writers.torch_save accepts one: its ``itemsize`` and ``str`` ``torch.<name>``."""

    def __init__(self, name: str, itemsize: int) -> None:
        self.name, self.itemsize = name, itemsize

    def __str__(self) -> str:
        return f"torch.{self.name}"


def items_from_spec(spec: list[Any], make_dtype: Any) -> list[tuple[tuple[str | int, ...], Any]]:
    """Items from their JSON form: ``[path, value]``, a tensor's value ``[[dtype name, itemsize], shape]``."""
    return [(tuple(p), TensorSlot(make_dtype(*v[0]), tuple(v[1])) if isinstance(v, list) else v) for p, v in spec]


def storage_bytes(j: int, slot: TensorSlot) -> bytes:
    """The made-up storage bytes of item ``j``."""
    return bytes((k * 7 + j) % 251 for k in range(slot.nbytes))


def write_file(out: Path, items: list[tuple[tuple[str | int, ...], Any]]) -> None:
    """Lay ``items`` out, write each storage's bytes at its offset, then the headers (as the workers and rank 0 do)."""
    slots = [v if isinstance(v, TensorSlot) else None for _, v in items]
    offsets = torch_save_offsets(slots)
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        crcs = {}
        for j, slot in enumerate(slots):
            offset = offsets[j]
            if slot is not None and offset is not None:
                raw = storage_bytes(j, slot)
                os.pwrite(fd, raw, offset)
                crcs[j] = zlib.crc32(raw)
        write_torch_save_headers(fd, items, crcs, offsets)
    finally:
        os.close(fd)


def write_payload(out: Path, slot: TensorSlot, at: int = 100) -> None:
    """A one-tensor payload (as DCP stores a chunk) placed at byte ``at`` of ``out``."""
    placement = tensor_payload_placement(slot)
    raw = storage_bytes(0, slot)
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        os.pwrite(fd, raw, at + placement.data_offset)
        write_tensor_payload_headers(fd, at, slot, zlib.crc32(raw))
        os.ftruncate(fd, at + placement.size)
    finally:
        os.close(fd)
