"""Operation ``inspect``, the index stage alone: what a checkpoint holds, from its index (no data file is read)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from fsdp_convert.formats import open_checkpoint
from fsdp_convert.formats.dcp import payload_formats
from fsdp_convert.formats.index import Location, TensorEntry
from fsdp_convert.producers import classify, detect_producer
from fsdp_convert.remote import as_location
from fsdp_convert.roles import GROUPS, Group

__all__ = ["EntrySummary", "InspectResult", "chunks_per_dim", "inspect_checkpoint"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EntrySummary:
    """One row of ``inspect``.

    Attributes:
        fqn: flattened key as stored.
        group: ``model``, ``optim`` or ``other`` (by top-level key).
        kind: ``tensor`` or ``bytes`` (a pickled plain value).
        shape: global shape in elements (``None`` for bytes).
        dtype: element type name, e.g. ``"bfloat16"`` (``None`` for bytes).
        chunks: number of stored chunks (1 for bytes), empty ones included (FSDP2 records an
            empty chunk for a rank whose shard of a small tensor is empty).
        chunks_per_dim: how the non-empty chunks cut the tensor: the number of pieces along each
            dim, e.g. ``(2, 2)`` for FSDP on dim 0 with tensor parallelism on dim 1, ``(3, 1)``
            for FSDP alone; ``None`` for bytes, or when the chunks are not such a grid.
        nbytes: tensor size (elements x item size) or payload size, in bytes.
    """

    fqn: str
    group: Group
    kind: str
    shape: tuple[int, ...] | None
    dtype: str | None
    chunks: int
    chunks_per_dim: tuple[int, ...] | None
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class InspectResult:
    """What ``.metadata`` says about a checkpoint; see ``inspect_checkpoint``.

    ``payload_formats`` (DCP folders only): how the payloads are stored, as
    ``formats.dcp.payload_formats`` names them: ``torch_save`` zips, bare ``safetensors`` elements
    (``FileSystemWriter(serialization_format=SAFETENSORS)``) and stream transforms (``stream.zstd/1``).
    ``details``: what the format read about how it was written (``CheckpointIndex.details``: a
    DeepSpeed save's ZeRO stage and dtypes), as (label, value) pairs.
    """

    checkpoint_id: Location
    producer: str
    world_size: int
    total_bytes: int
    data_files: tuple[str, ...]
    version: str | None
    entries: tuple[EntrySummary, ...]
    payload_formats: tuple[str, ...] = ()
    details: tuple[tuple[str, str], ...] = ()

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
                    "chunks_per_dim": None if e.chunks_per_dim is None else list(e.chunks_per_dim),
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
            "payload_formats": list(self.payload_formats),
            **({"details": dict(self.details)} if self.details else {}),
            "groups": groups,
        }


def chunks_per_dim(entry: TensorEntry) -> tuple[int, ...] | None:
    """How a tensor's non-empty chunks cut it: the number of pieces along each dim, if they form a grid.

    The chunks form a grid when each dim is cut into intervals and the chunks are exactly every
    combination of one interval per dim, as any mesh of ``Shard`` placements (FSDP, tensor
    parallelism, HSDP, after DCP drops replicas) makes them. ``()`` for a 0-dim tensor.

    Returns:
        Pieces per dim (``(2, 2)``: two row blocks times two column blocks), or ``None`` when the
        chunks are not such a grid (they overlap, leave gaps, or are cut irregularly).
    """
    stored = [(c.offsets, c.sizes) for c in entry.chunks if 0 not in c.sizes]
    boxes = set(stored)
    if not boxes or len(boxes) != len(stored):  # none, or one box stored twice
        return None
    per_dim = [len({(offsets[d], sizes[d]) for offsets, sizes in boxes}) for d in range(len(entry.shape))]
    # each box is one cell of the grid of these intervals: they are all of it when they are as many
    return tuple(per_dim) if math.prod(per_dim) == len(boxes) else None


def inspect_checkpoint(checkpoint_id: str | os.PathLike[str], *, follow_symlinks: bool | None = None) -> InspectResult:
    """Describe a DCP checkpoint from its ``.metadata`` alone (no data file is opened).

    Args:
        checkpoint_id: the checkpoint folder.
        follow_symlinks: read a ``.metadata`` (or ``meta.pt``) that is a symbolic link out of the
            folder; by default refused. None: the process's setting (``--follow-symlinks``).

    Returns:
        Producer, world size (distinct writer ranks), total bytes, data files, and one
        ``EntrySummary`` per entry in the producer's order.

    Raises:
        CheckpointNotFoundError, NotADcpCheckpointError, UnsafeContentError: see ``formats.read_index``.
    """
    source = open_checkpoint(as_location(checkpoint_id), follow_symlinks=follow_symlinks)  # the format decided once
    index = source.index
    rows = []
    for e, slot in zip(index.entries, classify(index), strict=True):
        if isinstance(e, TensorEntry):
            rows.append(
                EntrySummary(
                    fqn=e.fqn,
                    group=slot.group_name,
                    kind="tensor",
                    shape=e.shape,
                    dtype=e.dtype_name,
                    chunks=len(e.chunks),
                    chunks_per_dim=chunks_per_dim(e),
                    nbytes=e.nbytes,
                )
            )
        else:
            rows.append(
                EntrySummary(
                    fqn=e.fqn,
                    group=slot.group_name,
                    kind="bytes",
                    shape=None,
                    dtype=None,
                    chunks=1,
                    chunks_per_dim=None,
                    nbytes=e.nbytes,
                )
            )
    return InspectResult(
        checkpoint_id=index.checkpoint_id,
        producer=detect_producer(index).name,
        world_size=index.world_size,
        total_bytes=index.total_bytes,
        data_files=index.data_files,
        version=index.version,
        entries=tuple(rows),
        payload_formats=payload_formats(index) if source.format.name == "dcp" else (),
        details=index.details,
    )
