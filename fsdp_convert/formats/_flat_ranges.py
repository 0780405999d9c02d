"""Index stage, shared: a flat element range of a row-major tensor as the boxes it is made of.

DeepSpeed ZeRO (``deepspeed/runtime/zero/stage_1_and_2.py``, ``stage3.py``) stores each parameter
flattened and cut into ranks' partitions at any element, not at row boundaries. A range
``[start, stop)`` of the flat, row-major elements of a tensor of shape ``S`` is the union of at most
``2 * len(S) - 1`` boxes (a partial first row, whole rows, a partial last row, recursively), each
contiguous in row-major order, so each box is one byte range of the partition that stores it.
Pure arithmetic, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["FlatBox", "Piece", "flat_boxes", "pieces_of", "zero12_pieces", "zero3_pieces"]

FlatBox = tuple[tuple[int, ...], tuple[int, ...], int]
"""A box of a tensor: (offsets, sizes, flat index of its first element), in elements."""
Piece = tuple[int, int, int, int, int]
"""Part of a parameter in a rank's flat tensor: (rank, which flat tensor, its first element there, the
parameter's flat range [lo, hi) it holds), in elements."""


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[FlatBox]:
    """The boxes whose union is the row-major element range ``[start, stop)`` of a tensor of ``shape``, in order.

    Each box is contiguous in row-major order: its elements are ``[first, first + numel)`` of the
    flat tensor, and the boxes follow each other. ``[]`` for an empty range.

    Raises:
        ValueError: the range lies outside ``[0, numel]``.
    """
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"range [{start}, {stop}) is outside a tensor of {numel} elements")
    out: list[FlatBox] = []
    if start < stop:
        _boxes(shape, start, stop, (), 0, out)
    return out


def _boxes(shape: tuple[int, ...], start: int, stop: int, prefix: tuple[int, ...], base: int, out: list[FlatBox]) -> None:
    """Append the boxes of ``[start, stop)`` (non-empty) of the sub-tensor at ``prefix`` (its first element ``base``)."""
    ones = (1,) * len(prefix)
    if not shape:
        out.append((prefix, ones, base))
        return
    row = math.prod(shape[1:])
    first, last = start // row, stop // row  # the row start lies in; the row stop lies in (stop excluded)
    if start % row == 0 and stop % row == 0:  # whole rows
        out.append(((*prefix, first, *(0,) * (len(shape) - 1)), (*ones, last - first, *shape[1:]), base + start))
        return
    if first == last:  # inside one row
        _boxes(shape[1:], start - first * row, stop - first * row, (*prefix, first), base + first * row, out)
        return
    whole_from = first
    if start % row:
        _boxes(shape[1:], start - first * row, row, (*prefix, first), base + first * row, out)
        whole_from = first + 1
    if last > whole_from:
        out.append(
            ((*prefix, whole_from, *(0,) * (len(shape) - 1)), (*ones, last - whole_from, *shape[1:]), base + whole_from * row)
        )
    if stop % row:
        _boxes(shape[1:], 0, stop - last * row, (*prefix, last), base + last * row, out)


def pieces_of(start: int, stop: int, bounds: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Where the range ``[start, stop)`` of a flat space lies in consecutive parts of it.

    Args:
        start: the range's first element.
        stop: the element past its last.
        bounds: the parts, each ``(first, length)``, sorted and not overlapping (ranks' partitions).

    Returns:
        ``(part index, range start, range stop)`` for each part the range meets, in order.
    """
    import bisect

    firsts = [b[0] for b in bounds]
    out = []
    i = max(bisect.bisect_right(firsts, start) - 1, 0)
    while i < len(bounds) and bounds[i][0] < stop:
        lo, hi = max(start, bounds[i][0]), min(stop, bounds[i][0] + bounds[i][1])
        if lo < hi:
            out.append((i, lo, hi))
        i += 1
    return out


def zero3_pieces(shapes: list[list[tuple[str, tuple[int, ...]]]], sizes: list[list[int]]) -> dict[str, list[Piece]]:
    """ZeRO-3's layout (``deepspeed/runtime/zero/stage3.py``, read back as ``zero_to_fp32`` does).

    Every parameter is split into ``ceil(numel / N)`` elements per rank (the last ranks' padded),
    and each rank concatenates its shares in ``param_shapes`` order across its sub-groups.

    Args:
        shapes: ``param_shapes``: per (sub-)group, (name, shape) in order.
        sizes: per rank, the element count of each of its flat tensors (``fp32_flat_groups``).

    Raises:
        ValueError: the ranks' flat tensors differ, or hold fewer elements than the parameters need.
    """
    ws = len(sizes)
    if any(s != sizes[0] for s in sizes) or any(n < 0 for n in sizes[0]):
        raise ValueError("the ranks' fp32_flat_groups differ in number or size")
    bounds = [(sum(sizes[0][:j]), n) for j, n in enumerate(sizes[0])]
    out: dict[str, list[Piece]] = {}
    pos = 0
    for name, shape in (p for group in shapes for p in group):
        numel = math.prod(shape)
        part = -(-numel // ws)
        if pos + part > sum(sizes[0]):
            raise ValueError(f"param_shapes need more elements than fp32_flat_groups hold (at {name})")
        pieces = out.setdefault(name, [])
        for rank in range(ws):
            lo, hi = min(rank * part, numel), min((rank + 1) * part, numel)
            for j, a, b in pieces_of(pos, pos + (hi - lo), bounds):
                pieces.append((rank, j, a - bounds[j][0], lo + a - pos, lo + b - pos))
        pos += part
    return out


def zero12_pieces(
    shapes: list[list[tuple[str, tuple[int, ...]]]], sizes: list[list[int]], paddings: Sequence[object]
) -> dict[str, list[Piece]]:
    """ZeRO-1/2's and BF16_Optimizer's layout (``deepspeed/runtime/zero/stage_1_and_2.py``, ``bf16_optimizer.py``).

    Each param group is one flat vector, parameters in ``param_shapes`` order with
    ``param_alignment_paddings`` after each, cut into equal partitions (the last saved without its
    tail padding): rank ``r`` holds elements ``[r * P, r * P + n_r)``, ``P`` the largest ``n_r``.

    Args:
        shapes: ``param_shapes``: per param group, (name, shape) in order.
        sizes: per rank, the element count of its partition of each group.
        paddings: ``param_alignment_paddings``: per group, one padding (elements) per parameter.

    Raises:
        ValueError: the groups disagree in number, paddings do not fit, or a parameter lies past the partitions.
    """
    ws = len(sizes)
    if any(len(s) != len(shapes) for s in sizes) or len(paddings) != len(shapes):
        raise ValueError(f"{len(shapes)} param groups in param_shapes, another number of partitions or paddings")
    out: dict[str, list[Piece]] = {}
    for g, group in enumerate(shapes):
        part = max(s[g] for s in sizes)
        bounds = [(r * part, sizes[r][g]) for r in range(ws)]
        pads = paddings[g]
        if not isinstance(pads, list) or len(pads) != len(group) or not all(type(p) is int and p >= 0 for p in pads):
            raise ValueError(f"param_alignment_paddings[{g}] is not one padding per parameter")
        offset = 0
        for (name, shape), pad in zip(group, pads, strict=True):
            numel = math.prod(shape)
            out[name] = [(r, g, a - r * part, a - offset, b - offset) for r, a, b in pieces_of(offset, offset + numel, bounds)]
            if sum(p[4] - p[3] for p in out[name]) != numel:
                raise ValueError(f"{name} lies past the end of param group {g}'s partitions")
            offset += numel + pad
    return out
