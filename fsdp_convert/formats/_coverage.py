"""Index stage: whether a tensor's chunks tile its global shape exactly (``check_coverage``), in O(n log n).

Kept beside ``index`` (which re-exports it) for its size: FSDP cuts one dim, tensor parallelism
one more; any mesh of ``Shard`` placements, after DCP drops replicas, tiles the tensor.
"""

from __future__ import annotations

import heapq
import operator
from typing import Any

from fsdp_convert.errors import CoverageError

__all__ = ["check_coverage", "MAX_CHUNKS_PER_TENSOR", "MAX_CORNERS", "MAX_PAIRS"]

MAX_CHUNKS_PER_TENSOR = 1 << 20
MAX_CORNERS = 1 << 20  # chunks x 2^(dims they split): check_coverage's work and memory
MAX_PAIRS = 1 << 20  # box pairs compared to name two overlapping chunks (a corrupt checkpoint only)


def _at(values: tuple[int, ...]) -> str:
    """Offsets, sizes or a shape for a message: the first 8 dims (a tensor may claim thousands)."""
    return str(list(values)) if len(values) <= 8 else f"[{', '.join(map(str, values[:8]))}, ...]"


def check_coverage(entry: Any) -> None:
    """Check that a ``TensorEntry``'s chunks tile its global shape exactly: inside it, no overlap, no gap.

    Only the ``k`` dims some chunk splits matter (FSDP: dim 0; tensor parallelism: one more).
    For ``k = 1`` the chunks, sorted along it, must follow one another. For more, each box's
    ``2^k`` corners weigh +1 or -1 (-1 for an odd number of ends), the tensor's the opposite: the
    boxes tile it exactly when the weights cancel at every point (their indicators then sum to
    its). Sorted, never hashed (the ints are the file's): O(n 2^k log n) for n chunks (at most
    ``MAX_CHUNKS_PER_TENSOR``; n 2^k at most ``MAX_CORNERS``); ``MAX_PAIRS`` to name an overlap.

    Raises:
        CoverageError: too many chunks, a chunk lies outside the shape, two chunks overlap, or
            elements are missing; the message names the FQN and the chunks' offsets.
    """
    fqn, shape = entry.fqn, entry.shape
    if len(entry.chunks) > MAX_CHUNKS_PER_TENSOR:
        raise CoverageError(f"{fqn}: more than {MAX_CHUNKS_PER_TENSOR} chunks, far more than a checkpoint stores; not reading it")
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (offsets, ends) of the non-empty chunks
    for c in entry.chunks:  # map() over C functions, not generators: millions of chunks at 1024 ranks
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape):
            raise CoverageError(f"{fqn}: chunk at offsets {_at(c.offsets)} has not the {len(shape)} dims of its tensor")
        if shape and (min(c.offsets) < 0 or min(c.sizes) < 0):
            raise CoverageError(f"{fqn}: chunk at offsets {_at(c.offsets)} with sizes {_at(c.sizes)} is negative")
        if 0 in c.sizes:
            continue  # an empty box may lie anywhere
        ends = tuple(map(operator.add, c.offsets, c.sizes))
        if any(map(operator.gt, ends, shape)):
            raise CoverageError(
                f"{fqn}: chunk at offsets {_at(c.offsets)} with sizes {_at(c.sizes)} lies outside shape {_at(shape)}"
            )
        boxes.append((c.offsets, ends))
    split = [d for d, extent in enumerate(shape) if any(o[d] != 0 or e[d] != extent for o, e in boxes)]
    if len(split) > 20 or len(boxes) << len(split) > MAX_CORNERS:
        raise CoverageError(f"{fqn}: chunks split {len(split)} dims into more boxes than this tool checks; not reading it")
    if _tiles(boxes, shape, split):
        return
    pair = _overlapping_pair(boxes, split)
    if pair is not None:
        raise CoverageError(f"{fqn}: chunks at offsets {_at(pair[0])} and {_at(pair[1])} overlap")
    covered = sum(c.numel for c in entry.chunks)
    if covered < entry.numel:
        cover = f"cover {covered} of {entry.numel} elements" if entry.numel < 1 << 63 else "miss elements"  # may not print
        raise CoverageError(f"{fqn}: chunks {cover}; the checkpoint has a gap")
    raise CoverageError(f"{fqn}: chunks overlap; some elements are stored twice")  # a pair MAX_PAIRS comparisons missed


def _corners(lo: tuple[int, ...], hi: tuple[int, ...], split: list[int], radix: list[int]) -> list[tuple[int, bool]]:
    """The box ``[lo, hi)``'s corners on the ``split`` dims as mixed-radix codes, each with its sign (+ when True)."""
    corners = [(0, True)]
    scale = 1
    for d, r in zip(split, radix, strict=True):
        corners = [(code + lo[d] * scale, sign) for code, sign in corners] + [
            (code + hi[d] * scale, not sign) for code, sign in corners
        ]
        scale *= r
    return corners


def _tiles(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...], split: list[int]) -> bool:
    """Whether the non-empty boxes ``(offsets, ends)``, inside ``shape``, tile it exactly."""
    if not split:  # every box is the whole tensor
        return len(boxes) == 1 or (not boxes and 0 in shape)
    if len(split) == 1:
        d, end = split[0], 0
        for start, stop in sorted((lo[d], hi[d]) for lo, hi in boxes):
            if start != end:
                return False
            end = stop
        return end == shape[d]
    radix = [shape[d] + 1 for d in split]  # a coordinate is at most its extent: one code per point
    plus: list[int] = []
    minus: list[int] = []
    for lo, hi in boxes:
        for code, positive in _corners(lo, hi, split, radix):
            (plus if positive else minus).append(code)
    for code, positive in _corners((0,) * len(shape), shape, split, radix):
        (minus if positive else plus).append(code)
    plus.sort()
    minus.sort()
    return plus == minus


def _overlapping_pair(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], split: list[int]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Offsets of two overlapping boxes, found by a sweep along ``split[0]``; None if none in ``MAX_PAIRS`` comparisons."""
    if not split:
        return (boxes[0][0], boxes[1][0]) if len(boxes) > 1 else None
    d = split[0]
    active: list[tuple[int, int]] = []  # heap of (end along d, box) of the boxes the sweep is inside
    budget = MAX_PAIRS
    for i in sorted(range(len(boxes)), key=lambda i: boxes[i][0][d]):
        lo, hi = boxes[i]
        while active and active[0][0] <= lo[d]:
            heapq.heappop(active)
        for _, j in active:
            if (budget := budget - 1) < 0:
                return None
            other_lo, other_hi = boxes[j]
            if all(max(lo[e], other_lo[e]) < min(hi[e], other_hi[e]) for e in split):
                return other_lo, lo
        heapq.heappush(active, (hi[d], i))
    return None
