"""Index stage, per-rank files: a value of a rank file as its local shards: global shape, dtype and boxes.

A DTensor record's box comes from its placements and this rank's mesh coordinate (``Shard`` and
``Replicate`` by ``torch.chunk``'s arithmetic, ``_StridedShard`` by ``_rank_pieces.strided_box``);
a ShardedTensor record's boxes from its ``ShardMetadata``; a plain tensor is replicated state, held
whole by every rank. Every int the file claims is checked before it is used (``_naturals``), and
each local tensor must hold each of its elements once (``_rank_pieces.check_elements``).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_convert.errors import CorruptChunkError, NotADcpCheckpointError, TorchFeatureError
from fsdp_convert.formats._rank_pieces import Placement, check_elements, mesh_sizes, strided_box
from fsdp_convert.formats._rank_unpickler import SHARDED_TENSOR, Record, kind
from fsdp_convert.formats.index import ObjPath

__all__ = ["LocalShard", "local_shard"]


@dataclass(frozen=True, slots=True)
class LocalShard:
    """What one rank's file holds of a tensor: its global shape and dtype, and a box per local shard.

    Attributes:
        shape: the global tensor's shape, in elements.
        dtype: its dtype.
        boxes: ``(offsets, sizes, record)`` per local shard: its box in the global tensor, in
            elements, and the path of its local tensor inside the file's value
            (``_rank_unpickler.local_value``). Empty for a replicated tensor on all ranks but the first.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], ObjPath]]  # offsets, sizes, record inside the file


def _naturals(values: Any, where: str, what: str) -> tuple[int, ...]:
    """A sequence of non-negative 64-bit ints from a file, or NotADcpCheckpointError naming ``what`` (not its value)."""
    try:
        out = tuple(values)
    except TypeError:
        out = (None,)
    if not all(type(v) is int and 0 <= v < 1 << 63 for v in out):
        raise NotADcpCheckpointError(f"{where}: its {what} is not a sequence of non-negative integers")
    return out


def _placements(spec: dict[str, Any], where: str) -> tuple[Placement, ...]:
    """A DTensor spec's placements as ``(kind, dim, split_factor)``, after checking its shard order.

    ``shard_order``, where recorded, must be the default left-to-right one that DCP's
    ``compute_local_shape_and_global_offset`` assumes (it reads the placements alone); a spec
    that treats ``_StridedShard`` as a plain ``Shard`` (``use_strided_shard_as_shard_order``
    false, as view propagation may) is refused too.

    Raises:
        NotADcpCheckpointError: a ``Partial`` or unknown placement, or a shard order other than the default.
    """
    out: list[Placement] = []
    for p in spec["placements"]:
        if kind(p) in ("Shard", "_StridedShard"):
            dim, split_factor = _naturals([p.fields.get("dim"), p.fields.get("split_factor", 1)], where, "placement")
            if split_factor < 1:
                raise NotADcpCheckpointError(f"{where}: placement {p!r} has split factor {split_factor}")
            out.append((kind(p), dim, split_factor))
        elif kind(p) == "Replicate":
            out.append(("Replicate", 0, 1))
        else:  # Partial is never saved in a state dict
            raise NotADcpCheckpointError(f"{where}: placement {p!r} is not supported (Shard, _StridedShard and Replicate are)")
    strided = any(k == "_StridedShard" for k, _, _ in out)
    if strided and spec.get("use_strided_shard_as_shard_order") is False:
        raise NotADcpCheckpointError(
            f"{where}: its _StridedShard stands for a plain Shard (use_strided_shard_as_shard_order); not supported"
        )
    order = spec.get("shard_order")
    if order is not None:
        by_dim: dict[int, list[int]] = {}
        for mesh_dim, (k, dim, _) in enumerate(out):
            if k != "Replicate":
                by_dim.setdefault(dim, []).append(mesh_dim)
        try:
            recorded = {int(e.args[0]): tuple(e.args[1]) for e in order}
        except (AttributeError, TypeError, ValueError, IndexError) as e:
            raise NotADcpCheckpointError(f"{where}: malformed DTensor shard_order ({type(e).__name__}: {e})") from e
        if recorded != {d: tuple(m) for d, m in by_dim.items()}:
            raise NotADcpCheckpointError(
                f"{where}: shard order {recorded} is not left to right over the mesh dims; not supported"
            )
    return tuple(out)


def _dtensor_local(value: Record, where: str) -> LocalShard:
    """A DTensor record's box: the global shape from its wrapper, the box from its placements."""
    try:
        fields = value.fields
        local, spec = fields["_local_tensor"], fields["_spec"].fields
        dtype, shape = value.wrapper.args[1], value.wrapper.args[2]  # type: ignore[attr-defined]
        mesh = spec["mesh"].fields
        axes = [axis.fields.get("shape") if isinstance(axis, Record) else None for axis in mesh["_layout"].fields["axes"]]
        coordinate = mesh.get("_coordinate_on_dim")
        placements = _placements(spec, where)
    except (KeyError, AttributeError, TypeError, IndexError) as e:
        raise NotADcpCheckpointError(f"{where}: malformed DTensor ({type(e).__name__}: {e})") from e
    mesh_shape = mesh_sizes(axes, where)
    if coordinate is None:
        raise NotADcpCheckpointError(f"{where}: the DTensor does not record this rank's place in its mesh")
    coordinate = _naturals(coordinate, where, "mesh coordinate")
    if len(coordinate) != len(mesh_shape) or not all(c < n for c, n in zip(coordinate, mesh_shape, strict=True)):
        raise NotADcpCheckpointError(f"{where}: mesh coordinate {list(coordinate)[:8]} lies outside mesh {list(mesh_shape)}")
    if len(placements) != len(mesh_shape):
        raise NotADcpCheckpointError(f"{where}: {len(placements)} placements for a {len(mesh_shape)}-dim mesh")
    if not isinstance(local, torch.Tensor) or not isinstance(dtype, torch.dtype) or local.dtype != dtype:
        raise NotADcpCheckpointError(f"{where}: malformed DTensor (its local tensor and dtype disagree)")
    shape = _naturals(shape, where, "shape")
    check_elements(local, where)
    if any(k != "Replicate" and d >= len(shape) for k, d, _ in placements):
        raise NotADcpCheckpointError(f"{where}: a placement shards a dim the tensor does not have")
    if any(k == "_StridedShard" for k, _, _ in placements):
        try:
            box = strided_box(shape, mesh_shape, coordinate, placements)
        except TorchFeatureError as e:
            raise TorchFeatureError(f"{where}: {e}") from None
        if isinstance(box, str):
            raise NotADcpCheckpointError(f"{where}: {box}")
        sizes, offsets = box
    else:
        sizes, offsets = _local_box(shape, mesh_shape, coordinate, [None if k == "Replicate" else d for k, d, _ in placements])
    if tuple(local.shape) != sizes:
        raise CorruptChunkError(f"{where}: local tensor {list(local.shape)} does not match its placement's {list(sizes)}")
    return LocalShard(shape, local.dtype, [(offsets, sizes, ("_local_tensor",))])


@functools.lru_cache(maxsize=16)
def _strided_boxes(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] | str:
    """Every mesh coordinate's ``strided_box``, or the first reason one has none: O(mesh size), for small meshes."""
    boxes = {}
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        box = strided_box(shape, mesh_shape, coordinate, placements)
        if isinstance(box, str):
            return box
        boxes[coordinate] = box
    return boxes


def _local_box(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], dims: list[int | None]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's (sizes, offsets), in elements, by ``torch.chunk`` on each sharded dim.

    Mesh dims apply in order, as DTensor's ``compute_local_shape_and_global_offset`` does for
    ``Shard`` and ``Replicate`` placements.
    """
    sizes, offsets = list(shape), [0] * len(shape)
    for mesh_dim, d in enumerate(dims):
        if d is None:  # Replicate
            continue
        n, c = mesh_shape[mesh_dim], coordinate[mesh_dim]
        step = -(-sizes[d] // n)
        start = min(step * c, sizes[d])
        size = max(0, min(sizes[d], step * (c + 1)) - start)
        offsets[d] += start
        sizes[d] = size
    return tuple(sizes), tuple(offsets)


def _sharded_tensor_local(value: Record, where: str) -> LocalShard:
    """A ShardedTensor record's local shards and their boxes, from its ``ShardMetadata``."""
    try:
        local_shards, meta, *_ = value.fields["__tuple_state__"]
        meta_fields = meta.fields
        shape = _naturals(meta_fields["size"], where, "size")
        properties = meta_fields["tensor_properties"].fields
        dtype = properties["dtype"] if "dtype" in properties else properties["__tuple_state__"][0]
        boxes: list[tuple[tuple[int, ...], tuple[int, ...], ObjPath]] = []
        for i, shard in enumerate(local_shards):
            tensor, shard_meta = shard.fields["tensor"], shard.fields["metadata"].fields
            offsets = _naturals(shard_meta["shard_offsets"], where, f"shard {i}'s offsets")
            sizes = _naturals(shard_meta["shard_sizes"], where, f"shard {i}'s sizes")
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != sizes or tensor.dtype != dtype:
                raise CorruptChunkError(f"{where}: local shard {i} does not match its metadata ({list(sizes)[:8]}, {dtype})")
            check_elements(tensor, f"{where} (shard {i})")
            boxes.append((offsets, sizes, ("local_shards", i)))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise NotADcpCheckpointError(f"{where}: malformed ShardedTensor ({type(e).__name__}: {e})") from e
    if not isinstance(dtype, torch.dtype):
        raise NotADcpCheckpointError(f"{where}: malformed ShardedTensor (no dtype)")
    return LocalShard(shape, dtype, boxes)


def local_shard(value: Any, where: str, first_rank: bool) -> LocalShard | None:
    """The local shards a leaf of a rank file holds (a DTensor, a ShardedTensor, a tensor), or None for a plain value.

    A plain tensor is replicated state, which every rank saved whole: boxed on ``first_rank`` alone.

    Raises:
        NotADcpCheckpointError: a malformed DTensor or ShardedTensor, a placement or shard order not
            supported, claims past the caps (``_rank_pieces``), or a record where a value should be.
        CorruptChunkError: a local tensor that does not match its box, or whose elements overlap in storage.
        TorchFeatureError: a ``_StridedShard`` placement, and this torch cannot compute its offsets.
    """
    if value.__class__ is SHARDED_TENSOR:
        return _sharded_tensor_local(value, where)
    if kind(value) == "DTensor":
        return _dtensor_local(value, where)
    if isinstance(value, Record):  # a mesh, a placement... where a value should be
        raise NotADcpCheckpointError(f"{where}: a {value.qualname} is not a state dict value")
    if isinstance(value, torch.Tensor):  # replicated: every rank saved it whole; rank 0's copy is read
        check_elements(value, where)
        shape = tuple(value.shape)
        return LocalShard(shape, value.dtype, [((0,) * len(shape), shape, ())] if first_rank else [])
    return None
