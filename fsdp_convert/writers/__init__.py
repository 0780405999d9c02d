"""Write stage: single-file writers that stream tensors in as they arrive.

Every writer follows the ``StateDictWriter`` protocol and writes into a path the caller gives
(a temporary sibling of the final output, see ``atomic_output``), so a half-written file never
sits where the output should be.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from fsdp_convert.formats.index import ObjPath
from fsdp_convert.writers._atomic import atomic_output
from fsdp_convert.writers.safetensors import SafetensorsWriter
from fsdp_convert.writers.torch_save import TorchSaveWriter

__all__ = ["StateDictWriter", "TorchSaveWriter", "SafetensorsWriter", "atomic_output"]


class StateDictWriter(Protocol):
    """A single-file output fed one value at a time, in output order. Rank 0 only."""

    def add_tensor(self, path: ObjPath, tensor: torch.Tensor, crc32: int | None = None) -> None:
        """Write ``tensor`` (CPU) at ``path``; ``crc32`` of its bytes if known. The caller may free it after."""

    def add_value(self, path: ObjPath, value: Any) -> None:
        """Record a plain value (float, tuple, list of FQNs) at ``path``."""

    def finish(self) -> int:
        """Complete, flush and fsync the file; return its size in bytes."""

    def close(self) -> None:
        """Release the file without completing it (after an error)."""
