"""Index stage, per-rank files: each rank's piece of a tensor, from what its file claims, in time the file's size bounds.

A rank file names the mesh its DTensor lives on and the placements that cut it; nothing stops a
few KB from claiming a mesh of a billion ranks or a local tensor of a billion elements over four
bytes of storage (stride 0). So here a rank's box is computed for its own mesh coordinate alone,
by the index arithmetic of torch's ``Shard`` and ``_StridedShard``, in O(placements x split
factor) whatever the mesh size; the mesh, its dims and split factors are capped; replicas are
found by sorting, never by hashing the file's ints; and a local tensor must hold each of its
elements once (``check_elements``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from fsdp_convert.errors import CorruptChunkError, NotADcpCheckpointError, TorchFeatureError
from fsdp_convert.formats.index import ChunkEntry
from fsdp_convert.torch_compat import dtensor_local_box

__all__ = [
    "Placement",
    "MAX_MESH_RANKS",
    "MAX_MESH_DIMS",
    "MAX_SPLIT_FACTOR",
    "mesh_sizes",
    "strided_box",
    "drop_replicas",
    "check_elements",
]

Placement = tuple[str, int, int]  # (kind, dim, split_factor), kind "Shard", "_StridedShard" or "Replicate"
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (sizes, offsets), in elements of the global tensor

# Far above any training run: the largest clusters hold about 2^17 GPUs; meshes have at most five
# dims (replicate, shard, context, tensor, expert parallel); a _StridedShard's split factor is the
# number of pieces other mesh dims cut the tensor dim into (FSDP over tensor parallelism: the
# tensor-parallel size, at most a few dozen).
MAX_MESH_RANKS = 1 << 20
MAX_MESH_DIMS = 16
MAX_SPLIT_FACTOR = 1 << 10
# torch's own box is computed to check ours where that is cheap: torch materialises every index of
# the dim and one tensor per mesh rank and split piece, so a few KB could claim hours of its work
_TORCH_CHECK_EXTENT = 1 << 16
_TORCH_CHECK_PIECES = 1 << 8

Runs = list[tuple[int, int]]  # (start, length) runs of global indices, in order


def mesh_sizes(axes: Sequence[Any], where: str) -> tuple[int, ...]:
    """The size of each mesh dim, from its ``_FlatLayout`` shape (an int or nested ints), capped.

    Raises:
        NotADcpCheckpointError: not ints, more than ``MAX_MESH_DIMS`` dims, or more than
            ``MAX_MESH_RANKS`` ranks.
    """
    if len(axes) > MAX_MESH_DIMS:
        raise NotADcpCheckpointError(f"{where}: a mesh of more than {MAX_MESH_DIMS} dims; not a training run's")
    sizes = []
    for axis in axes:
        pending, size = [axis], 1
        for _ in range(4 * MAX_MESH_DIMS):  # nested ints, flattened without recursion (a list may hold itself)
            if not pending:
                break
            value = pending.pop()
            if isinstance(value, (tuple, list)) and len(pending) + len(value) <= MAX_MESH_DIMS:
                pending.extend(value)
            elif type(value) is int and 0 <= value <= MAX_MESH_RANKS:
                size *= value
            else:
                pending = [None]
                break
        if pending:
            raise NotADcpCheckpointError(f"{where}: a mesh dim's shape is not a few non-negative ints")
        sizes.append(size)
    if math.prod(sizes) > MAX_MESH_RANKS:
        raise NotADcpCheckpointError(f"{where}: a mesh of more than {MAX_MESH_RANKS} ranks; not a training run's")
    return tuple(sizes)


def _chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk``'s piece ``index`` of ``range(length)`` in ``parts`` (empty past the last): (start, end)."""
    step = -(-length // parts)
    return min(step * index, length), min(step * (index + 1), length)


def _picks(kind: str, length: int, parts: int, index: int, split_factor: int) -> Runs:
    """Positions (runs) of the local sequence of ``length`` that mesh index ``index`` of ``parts`` keeps.

    ``Shard``: one ``torch.chunk`` piece (``Shard.local_shard_size_and_offset``). ``_StridedShard``:
    the sequence is chunked into ``split_factor`` pieces and each piece into ``parts``; the rank
    keeps its piece of each (``_StridedShard._split_tensor``).
    """
    if kind == "Shard":
        start, end = _chunk(length, parts, index)
        return [(start, end - start)] if end > start else []
    picks: Runs = []
    first = -(-length // split_factor) if length else 0
    for a in range(0, length, first or 1):
        piece = min(first, length - a)
        start, end = _chunk(piece, parts, index)
        if end > start:
            picks.append((a + start, end - start))
    return picks


def _compose(runs: Runs, picks: Runs) -> Runs:
    """The global indices at positions ``picks`` (ascending runs) of the sequence ``runs`` lists."""
    out: Runs = []
    k = base = 0  # runs[k] holds positions base .. base + its length
    for at, length in picks:
        while length:
            while base + runs[k][1] <= at:
                base += runs[k][1]
                k += 1
            start, run = runs[k]
            take = min(length, base + run - at)
            first = start + at - base
            if out and sum(out[-1]) == first:
                out[-1] = (out[-1][0], out[-1][1] + take)
            else:
                out.append((first, take))
            at += take
            length -= take
    return out


def strided_box(
    shape: tuple[int, ...], mesh: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[Placement, ...]
) -> Box | str:
    """The box a rank holds of a DTensor with a ``_StridedShard`` placement, or why it holds no box.

    Placements apply left to right, each on the indices the previous ones left on its dim
    (torch's ``_compute_local_shape_and_global_offset``); the offset is the first index kept, or
    the dim's extent when none is (as DCP records). A rank whose indices on a dim are not one
    run holds no box: ``(_StridedShard(0, sf), Replicate())`` interleaves rows. Work is
    O(placements x split factor); torch's function (``torch_compat.dtensor_local_box``) checks the box
    where it is cheap.

    Returns:
        ``(sizes, offsets)``, or a one-line reason (also for a split factor over ``MAX_SPLIT_FACTOR``).

    Raises:
        TorchFeatureError: this torch cannot compute DTensor offsets, or places the box elsewhere.
    """
    runs: list[Runs] = [[(0, extent)] if extent else [] for extent in shape]
    cut = [False] * len(shape)
    for (kind, dim, split_factor), parts, index in zip(placements, mesh, coordinate, strict=True):
        if kind == "Replicate":
            continue
        if split_factor > MAX_SPLIT_FACTOR:
            return f"placement {kind}({dim}) has a split factor over {MAX_SPLIT_FACTOR}; not a training run's"
        length = sum(n for _, n in runs[dim])
        runs[dim] = _compose(runs[dim], _picks(kind, length, parts, index, split_factor))
        cut[dim] = True
    for dim, dim_runs in enumerate(runs):
        if len(dim_runs) > 1:
            placed = ", ".join(
                f"_StridedShard({d}, sf={sf})" if k == "_StridedShard" else f"{k}({d})" if k == "Shard" else k + "()"
                for k, d, sf in placements
            )
            return (
                f"placements ({placed}) on mesh {list(mesh)} give ranks elements of dim {dim} that are not one "
                "contiguous run, so a rank's shard is not one box; not supported"
            )
    sizes = tuple(r[0][1] if r else 0 for r in runs)
    offsets = tuple(r[0][0] if r else extent if was_cut else 0 for r, extent, was_cut in zip(runs, shape, cut, strict=True))
    pieces = sum(n * sf for (k, _, sf), n in zip(placements, mesh, strict=True) if k != "Replicate")
    if pieces <= _TORCH_CHECK_PIECES and max(shape, default=0) <= _TORCH_CHECK_EXTENT:
        theirs = dtensor_local_box(shape, mesh, coordinate, placements)
        if theirs != (sizes, offsets):
            raise TorchFeatureError(
                f"torch {torch.__version__} places mesh coordinate {list(coordinate)}'s piece at {theirs}, not at "
                f"{(sizes, offsets)} as the torch fsdp-convert was tested with; not reading it"
            )
    return sizes, offsets


def drop_replicas(chunks: list[ChunkEntry]) -> list[ChunkEntry]:
    """The chunks without repeats of an earlier one's box (replicas: ``Replicate``, or a mesh dim of size 1).

    Sorted by box, never hashed: the offsets are the file's (a hash-flooded set costs O(n^2)).
    """
    order = sorted(range(len(chunks)), key=lambda k: (chunks[k].offsets, chunks[k].sizes, k))
    repeats = {
        b for a, b in zip(order, order[1:]) if (chunks[a].offsets, chunks[a].sizes) == (chunks[b].offsets, chunks[b].sizes)
    }
    return [c for k, c in enumerate(chunks) if k not in repeats]


def check_elements(tensor: torch.Tensor, where: str) -> None:
    """Refuse a local tensor that does not hold each of its elements once in its storage.

    A stride of 0 (or strides that make elements overlap) lets a few bytes of storage claim any
    shape, and the output would then be that large. Dims are taken from the smallest stride up;
    each stride must step past everything the smaller dims span, as in any tensor torch made
    from whole storage (contiguous, transposed, sliced).

    Raises:
        CorruptChunkError: elements overlap in storage.
    """
    span = 1  # storage elements the dims so far reach across, first to last
    for stride, size in sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride(), strict=True) if sz > 1):
        if stride < span:
            raise CorruptChunkError(
                f"{where}: local tensor of shape {list(tensor.shape)[:8]} has strides {list(tensor.stride())[:8]} "
                "that make its elements overlap in storage; not reading it"
            )
        span += stride * (size - 1)
