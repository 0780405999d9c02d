"""safetensors output placed before any data is read, and Hugging Face's shard index.

Format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header
length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}`` padded with spaces to a multiple of 8, then the tensor bytes, little-endian, C order,
back to back. Every name, dtype and shape is known from the index before any data is read, so
every tensor's byte range is too (``safetensors_placement``): workers write the tensors in place and
rank 0 the header.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from fsdp_convert.constants import safetensors_shape
from fsdp_convert.dtypes import SAFETENSORS_NAMES, DType
from fsdp_convert.formats.index import ObjPath, dcp_key, dtype_name

__all__ = [
    "SafetensorsPlacement",
    "safetensors_placement",
    "write_safetensors_header",
    "safetensors_name",
    "ShardFile",
    "write_hf_index",
]


def safetensors_name(path: ObjPath) -> str:
    """The tensor name for a model entry: its path below the top-level ``model`` key, dotted."""
    return dcp_key(path[1:]) if len(path) > 1 else str(path[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class SafetensorsPlacement:
    """A safetensors file placed before any data is read: its header and every tensor's offset.

    Attributes:
        header: the file's first bytes: the 8-byte little-endian length and the padded JSON header.
        data_offsets: per tensor, where its bytes start in the file, in bytes.
        size: the file's size, in bytes.
    """

    header: bytes
    data_offsets: tuple[int, ...]
    size: int


def safetensors_placement(
    tensors: Sequence[tuple[ObjPath, torch.dtype | DType, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> SafetensorsPlacement:
    """The header and every tensor's byte range of a safetensors file of these tensors, in this order.

    Each tensor's header entry is ``{"dtype": code, "shape": ..., "data_offsets":
    [begin, end]}`` (offsets in bytes from the end of the header), as safetensors 0.8 writes it:
    the dtype names are ``dtypes.SAFETENSORS_NAMES``, and the shape is the torch shape except
    for ``float4_e2m1fn_x2``, whose last dim counts 4-bit values (``constants.safetensors_shape``).

    Args:
        tensors: ``(path, dtype, shape)`` of every tensor, in file order; shapes in torch elements.
        metadata: string pairs for ``__metadata__`` (``{"format": "pt"}`` by default, as HF writes).

    Raises:
        ValueError: a dtype safetensors cannot hold (complex128, complex32; a 0-dim float4), or
            two paths with the same name; the message names the tensor and its dtype.
    """
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    begins = []
    begin = 0
    for obj_path, dtype, shape in tensors:
        name = safetensors_name(obj_path)
        code = SAFETENSORS_NAMES.get(str(dtype).removeprefix("torch."))
        if code is None:
            raise ValueError(
                f"{name}: safetensors has no dtype for {dtype_name(dtype)}; write a .pt file, or leave it out with --exclude"
            )
        try:
            header_shape = safetensors_shape(dtype, shape)
        except ValueError as e:
            raise ValueError(f"{name}: {e}; write a .pt file, or leave it out with --exclude") from e
        if name in header:
            raise ValueError(f"two tensors are both named {name}")
        nbytes = dtype.itemsize * math.prod(shape)
        header[name] = {"dtype": code, "shape": header_shape, "data_offsets": [begin, begin + nbytes]}
        begins.append(begin)
        begin += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    return SafetensorsPlacement(header=head, data_offsets=tuple(len(head) + b for b in begins), size=len(head) + begin)


def write_safetensors_header(fd: int, header: bytes) -> None:
    """Write a placed file's header (``SafetensorsPlacement.header``) at its start; its tensors are in place. Rank 0 only.

    Args:
        fd: the file, open for writing.
        header: the 8-byte length and the padded JSON header.
    """
    view = memoryview(header)
    while view:
        view = view[os.pwrite(fd, view, len(header) - len(view)) :]


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
