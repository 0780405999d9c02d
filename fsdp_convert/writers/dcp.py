"""DCP writer: the ``.metadata`` of a checkpoint folder laid out for a target world size, in DCP's own format.

Mirrors what ``torch.distributed.checkpoint.FileSystemWriter`` writes
(``torch/distributed/checkpoint/filesystem.py``): each rank's chunks are torch.save payloads in
``__<rank>_0.distcp`` (laid out by ``reshard_plan``, each a ``writers.torch_save`` one-tensor
payload), and ``.metadata`` is a pickled ``torch.distributed.checkpoint.metadata.Metadata``
naming every chunk's box and byte range. ``.metadata`` is written last, so a folder without it
is visibly incomplete.
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from fsdp_convert._torch import StorageInfo
from fsdp_convert.constants import METADATA_FILENAME
from fsdp_convert.formats.index import ObjPath, plain_path

__all__ = ["StoredChunk", "MetadataEntry", "Box", "write_metadata", "rank_filename"]


def rank_filename(rank: int) -> str:
    """``__<rank>_0.distcp``, the data file FileSystemWriter gives rank ``rank``."""
    return f"__{rank}_0.distcp"


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """Where one payload went: the entry, its box (``None`` for a bytes entry) and byte range.

    Attributes:
        fqn: the entry's flattened key.
        offsets: per-dimension start of the chunk in the global tensor, in elements; ``None``
            for a bytes entry.
        relative_path: the data file, relative to the checkpoint folder (``__0_0.distcp``).
        offset_bytes: where the payload starts in that file, in bytes.
        length_bytes: the payload's length, in bytes.
    """

    fqn: str
    offsets: tuple[int, ...] | None
    relative_path: str
    offset_bytes: int
    length_bytes: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready row (offsets as a list), as a worker records its rank file's payloads."""
        return {
            "fqn": self.fqn,
            "offsets": None if self.offsets is None else list(self.offsets),
            "relative_path": self.relative_path,
            "offset_bytes": self.offset_bytes,
            "length_bytes": self.length_bytes,
        }

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> StoredChunk:
        """The record ``to_json`` wrote.

        Raises:
            KeyError, TypeError: a row ``to_json`` did not write.
        """
        offsets = row["offsets"]
        return cls(
            fqn=str(row["fqn"]),
            offsets=None if offsets is None else tuple(int(o) for o in offsets),
            relative_path=str(row["relative_path"]),
            offset_bytes=int(row["offset_bytes"]),
            length_bytes=int(row["length_bytes"]),
        )


class Box(Protocol):
    """A chunk's place in its global tensor, in elements (``reshard_plan.TargetChunk`` is one)."""

    @property
    def offsets(self) -> tuple[int, ...]:
        """Per-dimension start, in elements."""
        ...

    @property
    def sizes(self) -> tuple[int, ...]:
        """Per-dimension extent, in elements."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class MetadataEntry:
    """One entry of the ``.metadata`` to write.

    Attributes:
        fqn: the flattened key.
        path: its place in the nested state dict (``planner_data``).
        dtype: the tensor's element type; ``None`` for a bytes entry.
        shape: the global shape, in elements; ``None`` for a bytes entry.
        chunks: the tensor's stored chunks (ignored for a bytes entry).
    """

    fqn: str
    path: ObjPath
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    chunks: Sequence[Box]


def write_metadata(folder: Path, entries: Sequence[MetadataEntry], stored: Sequence[StoredChunk], version: str | None) -> None:
    """Write ``.metadata`` for the stored chunks, last, and fsync it. Rank 0 only.

    Args:
        folder: the output folder.
        entries: every entry, in order.
        stored: every payload written, from all rank files.
        version: DCP metadata version to record (the source's).

    Raises:
        FileExistsError: ``.metadata`` is already there.
    """
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for e in entries:
        if e.dtype is None or e.shape is None:
            state_dict_metadata[e.fqn] = BytesStorageMetadata()
        else:
            chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in e.chunks]
            state_dict_metadata[e.fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=e.dtype), size=torch.Size(e.shape), chunks=chunks
            )
    storage_data = {
        MetadataIndex(c.fqn, c.offsets): StorageInfo(relative_path=c.relative_path, offset=c.offset_bytes, length=c.length_bytes)
        for c in stored
    }
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data={e.fqn: plain_path(e.path) for e in entries},
        storage_data=storage_data,
        storage_meta=StorageMeta(save_id=str(uuid.uuid4())),
        version=version or "1.0.0",
    )
    with open(folder / METADATA_FILENAME, "xb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
