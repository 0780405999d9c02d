"""Test helper: DCP rank files of any chunk layout, payload by payload, as FileSystemWriter writes them.

The package lays rank files out ahead (``ops/reshard``); tests that need a checkpoint of a layout
no training run here produces (tensor-parallel boxes, uneven chunks) append payloads with this.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import IO

import torch

from fsdp_convert.writers.dcp import StoredChunk, rank_filename


class RankFileWriter:
    """Appends torch.save payloads (tensor boxes) and raw bytes payloads to one rank's data file."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.relative_path = rank_filename(rank)
        self._file: IO[bytes] = open(folder / self.relative_path, "xb")  # noqa: SIM115 (closed in finish)
        self.stored: list[StoredChunk] = []

    def add_box(self, fqn: str, offsets: tuple[int, ...], box: torch.Tensor) -> None:
        """Append ``box`` (the chunk at ``offsets``, in elements) as its own torch.save payload."""
        buf = io.BytesIO()
        torch.save(box.contiguous().clone(), buf)  # torch.save writes whole storages, never a view's
        self._append(fqn, offsets, buf.getbuffer())

    def add_raw(self, fqn: str, payload: bytes) -> None:
        """Append a bytes entry's payload unchanged."""
        self._append(fqn, None, payload)

    def _append(self, fqn: str, offsets: tuple[int, ...] | None, data: bytes | memoryview) -> None:
        at = self._file.tell()
        self._file.write(data)
        self.stored.append(StoredChunk(fqn, offsets, self.relative_path, at, len(data)))

    def finish(self) -> None:
        """Flush, fsync and close."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
