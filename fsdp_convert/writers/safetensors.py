"""safetensors writer that writes the header first and then streams tensor data in order.

Format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header
length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}`` padded with spaces to a multiple of 8, then the tensor bytes, little-endian, C order,
back to back. Every name, dtype and shape is known from the index before any data is read, so
the header is written first and each tensor's bytes are appended as it arrives.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from fsdp_convert.constants import SAFETENSORS_DTYPES, SAFETENSORS_TO_TORCH
from fsdp_convert.formats.index import ObjPath, dcp_key
from fsdp_convert.writers._buffer import byte_view, close_synced, dense

__all__ = ["SafetensorsWriter", "SAFETENSORS_DTYPES", "SAFETENSORS_TO_TORCH", "safetensors_name", "ShardFile", "write_hf_index"]


def safetensors_name(path: ObjPath) -> str:
    """The tensor name for a model entry: its path below the top-level ``model`` key, dotted."""
    return dcp_key(path[1:]) if len(path) > 1 else str(path[0])


class SafetensorsWriter:
    """Streams tensors into one safetensors file whose header is fixed up front. Rank 0 only.

    Args:
        path: the file to create (normally a temporary sibling of the output).
        layout: ``(path, dtype, shape)`` of every tensor, in the order they will be added.
        metadata: string pairs for ``__metadata__`` (``{"format": "pt"}`` by default, as HF writes).

    Raises:
        ValueError: a dtype safetensors cannot hold, or two paths with the same name.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layout: Sequence[tuple[ObjPath, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
        self._expected: list[tuple[ObjPath, torch.dtype, tuple[int, ...]]] = list(layout)
        begin = 0
        for obj_path, dtype, shape in self._expected:
            name = safetensors_name(obj_path)
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"{name}: safetensors cannot hold dtype {dtype}")
            if name in header:
                raise ValueError(f"two tensors are both named {name}")
            nbytes = dtype.itemsize * math.prod(shape)
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [begin, begin + nbytes]}
            begin += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = Path(path)
        self._file: IO[bytes] = open(self.path, "xb")  # noqa: SIM115 (closed in finish/close)
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0
        self.tensor_bytes = 0

    def add_tensor(self, path: ObjPath, tensor: torch.Tensor, crc32: int | None = None) -> None:
        """Append ``tensor``'s bytes; it must be the next one of ``layout`` (same path, dtype, shape).

        ``crc32`` is accepted for the ``StateDictWriter`` protocol; safetensors stores none.

        Raises:
            ValueError: the tensor is not the one the header announced next.
        """
        expected = self._expected[self._next] if self._next < len(self._expected) else None
        got = (path, tensor.dtype, tuple(tensor.shape))
        if got != expected:
            raise ValueError(f"safetensors writer expected {expected}, got {got}")
        tensor = dense(tensor)
        self._file.write(byte_view(tensor))
        self._next += 1
        self.tensor_bytes += tensor.nbytes

    def add_value(self, path: ObjPath, value: Any) -> None:
        """Safetensors holds tensors only; the planner keeps values away from this writer."""
        raise ValueError(f"{'.'.join(map(str, path))}: safetensors holds tensors only")

    def finish(self) -> int:
        """Check every announced tensor arrived, flush and fsync; return the file size in bytes."""
        if self._next != len(self._expected):
            raise ValueError(f"safetensors writer got {self._next} of {len(self._expected)} tensors")
        return close_synced(self._file)

    def close(self) -> None:
        """Close the file without completing it; the caller removes it."""
        self._file.close()


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardFile:
    """One safetensors shard of a Hugging Face folder, as its index lists it.

    Attributes:
        filename: the shard's name inside the folder (``model-00001-of-00003.safetensors``).
        paths: the nested path of each tensor it holds (``("model", "layers", "0", ...)``), in
            file order; the index names them as ``safetensors_name`` does.
        tensor_bytes: tensor data in the shard, in bytes.
    """

    filename: str
    paths: tuple[ObjPath, ...]
    tensor_bytes: int


def write_hf_index(path: str | os.PathLike[str], shards: Sequence[ShardFile]) -> None:
    """Write a sharded folder's ``model.safetensors.index.json`` and fsync it. Rank 0 only.

    The format of transformers' ``save_pretrained``: ``{"metadata": {"total_size": bytes},
    "weight_map": {tensor name: shard file name}}``.

    Args:
        path: the index file to create (the folder's ``model.safetensors.index.json``).
        shards: every shard of the folder.

    Raises:
        FileExistsError: ``path`` exists.
    """
    weight_map = {safetensors_name(p): shard.filename for shard in shards for p in shard.paths}
    index = {"metadata": {"total_size": sum(s.tensor_bytes for s in shards)}, "weight_map": weight_map}
    with open(path, "x") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
