"""Zero-copy byte views of CPU tensors, for writing them to files without NumPy."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


__all__ = ["dense", "byte_view"]


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that owns exactly its bytes: storage offset 0, storage size == nbytes."""
    tensor = tensor.detach().contiguous()
    if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a memoryview (native byte order, little-endian here).

    The caller keeps ``tensor`` alive while the view is used.
    """
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("byte_view needs a contiguous CPU tensor")
    if tensor.nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")
