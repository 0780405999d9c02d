"""The one place that touches private torch names, so a torch upgrade changes one file.

Covers: DCP's ``filesystem._StorageInfo`` (the per-chunk byte range in ``.metadata``),
``torch._C.PyTorchFileWriter`` (torch.save's zip container writer) and the storage-type names
torch.save's pickle uses.
"""

from __future__ import annotations

import functools
from typing import IO

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

__all__ = [
    "StorageInfo",
    "MEM_FORMAT_ENCODING",
    "open_torch_save_writer",
    "storage_type_for",
    "storage_alignment",
    "reserve_record",
]

StorageInfo = _StorageInfo
MEM_FORMAT_ENCODING = _MEM_FORMAT_ENCODING


def storage_alignment() -> int:
    """Byte alignment of storage records in torch.save zips (64 in torch 2.13), for mmap loads."""
    return int(torch.serialization._get_storage_alignment())


def open_torch_save_writer(stream: IO[bytes], *, compute_crc32: bool = True) -> torch._C.PyTorchFileWriter:
    """torch.save's own zip writer over ``stream``, with torch's storage alignment.

    Writing to a stream (not a path) makes the archive's folder name ``archive``, as
    ``torch.save(obj, buffer)`` does, so the bytes do not depend on the output's file name.
    With ``compute_crc32=False`` the records' CRC-32 fields are left 0 for the caller to fill.
    """
    return torch._C.PyTorchFileWriter(stream, compute_crc32, storage_alignment())


def reserve_record(writer: torch._C.PyTorchFileWriter, name: str, nbytes: int) -> None:
    """Write a record's zip headers and skip its ``nbytes`` of data, to be written in place later.

    ``PyTorchFileWriter.write_record_metadata``, what ``torch.serialization.skip_data`` uses
    (torch >= 2.5); the stream must be seekable.

    Raises:
        RuntimeError: this torch's writer cannot reserve a record.
    """
    reserve = getattr(writer, "write_record_metadata", None)
    if reserve is None:
        raise RuntimeError(f"torch {torch.__version__} cannot lay out a torch.save file ahead (no write_record_metadata)")
    reserve(name, nbytes)


@functools.cache
def storage_type_for(dtype: torch.dtype) -> type | None:
    """The legacy typed-storage class torch.save pickles for ``dtype`` (e.g. ``torch.FloatStorage``).

    ``None`` for dtypes that have none (float8, uint16/32/64, ...): torch.save pickles those
    through ``torch.storage.UntypedStorage`` and ``torch._utils._rebuild_tensor_v3``.
    """
    name = torch.storage._dtype_to_storage_type_map().get(dtype)
    return None if name is None else getattr(torch, name)
