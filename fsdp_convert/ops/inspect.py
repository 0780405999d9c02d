"""Operation ``inspect``, the index stage alone: what a checkpoint holds, from its index (no data file is read)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from fsdp_convert.formats import read_index
from fsdp_convert.formats.index import Location, TensorEntry, dtype_name
from fsdp_convert.layout import GROUPS, Group, classify, detect_producer

__all__ = ["EntrySummary", "InspectResult", "inspect_checkpoint"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EntrySummary:
    """One row of ``inspect``.

    Attributes:
        fqn: flattened key as stored.
        group: ``model``, ``optim`` or ``other`` (by top-level key).
        kind: ``tensor`` or ``bytes`` (a pickled plain value).
        shape: global shape in elements (``None`` for bytes).
        dtype: element type name, e.g. ``"bfloat16"`` (``None`` for bytes).
        chunks: number of stored chunks (1 for bytes).
        nbytes: tensor size (elements x item size) or payload size, in bytes.
    """

    fqn: str
    group: Group
    kind: str
    shape: tuple[int, ...] | None
    dtype: str | None
    chunks: int
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class InspectResult:
    """What ``.metadata`` says about a checkpoint; see ``inspect_checkpoint``."""

    checkpoint_id: Location
    producer: str
    world_size: int
    total_bytes: int
    data_files: tuple[str, ...]
    version: str | None
    entries: tuple[EntrySummary, ...]

    def to_json_dict(self) -> dict[str, Any]:
        """JSON-ready form: dtypes as strings, shapes as lists, ``schema_version`` 1."""
        groups: dict[str, list[dict[str, Any]]] = {g: [] for g in GROUPS}
        for e in self.entries:
            groups[e.group].append(
                {
                    "fqn": e.fqn,
                    "kind": e.kind,
                    "shape": None if e.shape is None else list(e.shape),
                    "dtype": e.dtype,
                    "chunks": e.chunks,
                    "bytes": e.nbytes,
                }
            )
        return {
            "schema_version": 1,
            "checkpoint": str(self.checkpoint_id),
            "producer": self.producer,
            "world_size": self.world_size,
            "total_bytes": self.total_bytes,
            "data_files": list(self.data_files),
            "dcp_version": self.version,
            "groups": groups,
        }


def inspect_checkpoint(checkpoint_id: str | os.PathLike[str]) -> InspectResult:
    """Describe a DCP checkpoint from its ``.metadata`` alone (no data file is opened).

    Args:
        checkpoint_id: the checkpoint folder.

    Returns:
        Producer, world size (distinct writer ranks), total bytes, data files, and one
        ``EntrySummary`` per entry in the producer's order.

    Raises:
        CheckpointNotFoundError, NotADcpCheckpointError, UnsafeContentError: see ``read_index``.
    """
    index = read_index(checkpoint_id)
    rows = []
    for e, slot in zip(index.entries, classify(index), strict=True):
        if isinstance(e, TensorEntry):
            rows.append(
                EntrySummary(
                    fqn=e.fqn,
                    group=slot.group_name,
                    kind="tensor",
                    shape=e.shape,
                    dtype=dtype_name(e.dtype),
                    chunks=len(e.chunks),
                    nbytes=e.nbytes,
                )
            )
        else:
            rows.append(
                EntrySummary(fqn=e.fqn, group=slot.group_name, kind="bytes", shape=None, dtype=None, chunks=1, nbytes=e.nbytes)
            )
    return InspectResult(
        checkpoint_id=index.checkpoint_id,
        producer=detect_producer(index),
        world_size=index.world_size,
        total_bytes=index.total_bytes,
        data_files=index.data_files,
        version=index.version,
        entries=tuple(rows),
    )
