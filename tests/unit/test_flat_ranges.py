"""formats/_flat_ranges.py: a flat range is exactly its boxes, and ZeRO's pieces put every element once, in its partition.

``flat_boxes`` is checked element by element against a tensor of flat indices (each box must read
back as one run of consecutive indices, the runs following each other from ``start`` to ``stop``);
``pieces_of`` against a brute force over every part; ``zero12_pieces`` and ``zero3_pieces`` by
building the ranks' flat partitions as DeepSpeed lays them out (each element named by its parameter
and flat index, paddings named as such) and reading every parameter back through its pieces.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fsdp_convert.formats._flat_ranges import flat_boxes, pieces_of, zero3_pieces, zero12_pieces

Shapes = list[list[tuple[str, tuple[int, ...]]]]
PAD = ("pad", -1)  # a padding element in a partition

SHAPE = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=5).map(tuple)
NONEMPTY_SHAPE = st.lists(st.integers(min_value=1, max_value=5), min_size=0, max_size=5).map(tuple)


@st.composite
def shape_and_range(draw: st.DrawFn, shapes: st.SearchStrategy[tuple[int, ...]] = SHAPE) -> tuple[tuple[int, ...], int, int]:
    shape = draw(shapes)
    numel = math.prod(shape)
    start = draw(st.integers(min_value=0, max_value=numel))
    stop = draw(st.integers(min_value=start, max_value=numel))
    return shape, start, stop


# --- flat_boxes -----------------------------------------------------------------------------------


@settings(max_examples=500, deadline=None)
@given(case=shape_and_range())
def test_flat_boxes_are_consecutive_runs_covering_exactly_the_range(case: tuple[tuple[int, ...], int, int]) -> None:
    shape, start, stop = case
    flat = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    boxes = flat_boxes(shape, start, stop)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    at = start
    for offsets, sizes, first in boxes:
        assert len(offsets) == len(sizes) == len(shape)
        assert all(s > 0 for s in sizes), "an empty box"
        assert all(0 <= o and o + s <= d for o, s, d in zip(offsets, sizes, shape, strict=True)), "a box outside the tensor"
        numel = math.prod(sizes)
        inside = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
        assert first == at, "boxes out of order or with a gap"
        assert inside.tolist() == list(range(first, first + numel)), "a box that is not one contiguous run"
        at += numel
    assert at == stop
    assert (boxes == []) == (start == stop)


@settings(max_examples=200, deadline=None)
@given(case=shape_and_range(NONEMPTY_SHAPE))
def test_flat_boxes_of_whole_rows_are_one_box(case: tuple[tuple[int, ...], int, int]) -> None:
    shape, start, stop = case
    assume(len(shape) >= 1)
    row = math.prod(shape[1:])
    start, stop = start // row * row, stop // row * row
    assume(start < stop)
    ((offsets, sizes, first),) = flat_boxes(shape, start, stop)
    assert offsets == (start // row, *(0,) * (len(shape) - 1)) and sizes == ((stop - start) // row, *shape[1:])
    assert first == start


def test_flat_boxes_worst_case_count_is_reached() -> None:
    """A range from mid-way in the first row's innermost run to mid-way in the last: 2 * ndim - 1 boxes."""
    for ndim in range(1, 6):
        shape = (3,) * ndim
        assert len(flat_boxes(shape, 1, math.prod(shape) - 1)) == 2 * ndim - 1
    assert flat_boxes((), 0, 1) == [((), (), 0)]


@pytest.mark.parametrize(
    ("shape", "start", "stop"), [((2, 3), -1, 2), ((2, 3), 0, 7), ((2, 3), 4, 3), ((), 0, 2), ((0, 4), 0, 1)]
)
def test_flat_boxes_refuse_a_range_outside_the_tensor(shape: tuple[int, ...], start: int, stop: int) -> None:
    with pytest.raises(ValueError, match="outside a tensor of"):
        flat_boxes(shape, start, stop)


# --- pieces_of ------------------------------------------------------------------------------------


@st.composite
def parts(draw: st.DrawFn) -> list[tuple[int, int]]:
    """Sorted, non-overlapping ``(first, length)`` parts, with gaps and empty parts."""
    out, at = [], draw(st.integers(min_value=0, max_value=5))
    for _ in range(draw(st.integers(min_value=0, max_value=8))):
        length = draw(st.integers(min_value=0, max_value=7))
        out.append((at, length))
        at += length + draw(st.integers(min_value=0, max_value=3))
    return out


def _pieces_brute(start: int, stop: int, bounds: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    out = []
    for i, (first, length) in enumerate(bounds):
        inside = [x for x in range(start, stop) if first <= x < first + length]
        if inside:
            out.append((i, inside[0], inside[-1] + 1))
    return out


@settings(max_examples=500, deadline=None)
@given(bounds=parts(), start=st.integers(min_value=0, max_value=70), length=st.integers(min_value=0, max_value=40))
def test_pieces_of_matches_a_brute_force(bounds: list[tuple[int, int]], start: int, length: int) -> None:
    assert pieces_of(start, start + length, bounds) == _pieces_brute(start, start + length, bounds)


# --- ZeRO-1/2 and BF16_Optimizer ------------------------------------------------------------------


def _names(n: int, prefix: str) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


@st.composite
def zero12_case(draw: st.DrawFn) -> tuple[Shapes, list[list[int]], list[list[int]], list[list[list[tuple[str, int]]]]]:
    """Param groups, per-rank partition sizes, paddings, and each rank's partitions as DeepSpeed lays them out.

    Each group's flat vector is its parameters with their paddings after each, padded to ``ws * P``
    and cut into ``ws`` partitions of ``P``; a rank saves its partition whole (BF16_Optimizer) or
    without the tail padding (ZeRO-1/2), as drawn.
    """
    ws = draw(st.integers(min_value=1, max_value=5))
    whole = draw(st.booleans())
    shapes: Shapes = []
    paddings: list[list[int]] = []
    flats: list[list[tuple[str, int]]] = []
    for g in range(draw(st.integers(min_value=1, max_value=3))):
        group, pads, flat = [], [], []
        for name in _names(draw(st.integers(min_value=0, max_value=4)), f"g{g}.p"):
            shape = draw(SHAPE.filter(lambda s: math.prod(s) <= 40))
            pad = draw(st.integers(min_value=0, max_value=3))
            group.append((name, shape))
            pads.append(pad)
            flat += [(name, i) for i in range(math.prod(shape))] + [PAD] * pad
        shapes.append(group)
        paddings.append(pads)
        flats.append(flat)
    # the partition size: at least ceil(used / ws), and not 0 where the group holds elements
    partitions = [max(-(-len(flat) // ws) + draw(st.integers(min_value=0, max_value=3)), 0) for flat in flats]
    stored: list[list[list[tuple[str, int]]]] = []  # per rank, per group, the saved partition
    for r in range(ws):
        per_group = []
        for flat, part in zip(flats, partitions, strict=True):
            piece = flat[r * part : (r + 1) * part]  # ZeRO-1/2: without the group's tail padding
            per_group.append(piece + [PAD] * (part - len(piece)) if whole else piece)
        stored.append(per_group)
    sizes = [[len(p) for p in per_group] for per_group in stored]
    return shapes, sizes, paddings, stored


def _read_back(
    shapes: Shapes, pieces: dict[str, list[tuple[int, int, int, int, int]]], stored: list[list[list[tuple[str, int]]]]
) -> None:
    """Every parameter's elements, read through its pieces from the stored partitions: each once, in order."""
    assert list(pieces) == [name for group in shapes for name, _ in group]
    for group in shapes:
        for name, shape in group:
            got: list[tuple[str, int]] = []
            covered = []
            for rank, j, local, lo, hi in sorted(pieces[name], key=lambda p: p[3]):
                partition = stored[rank][j]
                assert 0 <= local and local + (hi - lo) <= len(partition), f"{name}: a piece past rank {rank}'s partition {j}"
                assert lo < hi
                got += partition[local : local + hi - lo]
                covered.append((lo, hi))
            assert got == [(name, i) for i in range(math.prod(shape))], name
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), f"{name}: pieces overlap or leave a gap"


@settings(max_examples=400, deadline=None)
@given(case=zero12_case())
def test_zero12_pieces_put_every_element_once_in_its_partition(
    case: tuple[Shapes, list[list[int]], list[list[int]], list[list[list[tuple[str, int]]]]],
) -> None:
    shapes, sizes, paddings, stored = case
    pieces = zero12_pieces(shapes, sizes, paddings)
    _read_back(shapes, pieces, stored)
    for name, found in pieces.items():  # each piece in the flat tensor its group is
        group = next(g for g, group in enumerate(shapes) if any(n == name for n, _ in group))
        assert all(j == group for _, j, _, _, _ in found)


@settings(max_examples=200, deadline=None)
@given(case=zero12_case(), data=st.data())
def test_zero12_pieces_refuse_partitions_too_small(
    case: tuple[Shapes, list[list[int]], list[list[int]], list[list[list[tuple[str, int]]]]], data: st.DataObject
) -> None:
    shapes, sizes, paddings, stored = case
    # a group's last parameter element, cut off with what follows it in its rank's partition
    ends = {
        g: (r, max(i for i, e in enumerate(stored[r][g]) if e != PAD))
        for g in range(len(shapes))
        for r in range(len(sizes))
        if any(e != PAD for e in stored[r][g])
    }
    assume(ends)
    g = data.draw(st.sampled_from(sorted(ends)))
    r, at = ends[g]
    smaller = [list(s) for s in sizes]
    smaller[r][g] = at
    # the partition size is the largest saved one: with it unchanged, the element has no rank to lie in
    # (with it smaller, the sizes may describe another layout that is whole, e.g. [[2], [1]] cut to [[1], [1]])
    assume(max(s[g] for s in smaller) == max(s[g] for s in sizes))
    with pytest.raises(ValueError, match=f"lies past the end of param group {g}"):
        zero12_pieces(shapes, smaller, paddings)


def test_zero12_pieces_refuse_a_parameter_past_the_partitions() -> None:
    shapes: Shapes = [[("a", (4,)), ("b", (3,))]]
    assert zero12_pieces(shapes, [[4], [3]], [[0, 0]])["b"] == [(1, 0, 0, 0, 3)]
    with pytest.raises(ValueError, match="b lies past the end of param group 0"):
        zero12_pieces(shapes, [[4], [2]], [[0, 0]])
    with pytest.raises(ValueError, match="b lies past the end of param group 0"):
        zero12_pieces(shapes, [[4], [3]], [[1, 0]])  # a padding after a pushes b past the partitions


@pytest.mark.parametrize(
    "paddings",
    [
        [[0]],  # one padding for two parameters
        [[0, 0, 0]],
        [[0, -1]],
        [[0, 1.0]],
        [[0, True]],
        [(0, 0)],  # not a list
        [None],
        [[0, 0], [0]],  # more groups than param_shapes
        [],
    ],
)
def test_zero12_pieces_refuse_bad_paddings(paddings: list[object]) -> None:
    with pytest.raises(ValueError, match="param_alignment_paddings|param groups"):
        zero12_pieces([[("a", (4,)), ("b", (3,))]], [[4], [3]], paddings)


def test_zero12_pieces_refuse_sizes_for_another_number_of_groups() -> None:
    with pytest.raises(ValueError, match="param groups"):
        zero12_pieces([[("a", (4,))], [("b", (3,))]], [[4], [3]], [[0], [0]])


# --- ZeRO-3 ---------------------------------------------------------------------------------------


@st.composite
def zero3_case(draw: st.DrawFn) -> tuple[Shapes, list[list[int]], list[list[list[tuple[str, int]]]]]:
    """Sub-groups, per-rank flat tensor sizes, and each rank's flat tensors as ``stage3.py`` lays them out.

    Each parameter gives every rank ``ceil(numel / ws)`` elements (the last ranks' padded); a rank
    concatenates its shares in order, then cuts them into its flat tensors (by sub-group, or
    anywhere, as drawn, with slack after the last).
    """
    ws = draw(st.integers(min_value=1, max_value=5))
    shapes: Shapes = []
    for s in range(draw(st.integers(min_value=1, max_value=3))):
        shapes.append([(n, draw(SHAPE.filter(lambda x: math.prod(x) <= 40))) for n in _names(draw(st.integers(0, 4)), f"s{s}.p")])
    concatenated: list[list[tuple[str, int]]] = [[] for _ in range(ws)]
    sub_sizes = []
    for group in shapes:
        size = 0
        for name, shape in group:
            numel = math.prod(shape)
            part = -(-numel // ws)
            for r in range(ws):
                share = [(name, i) for i in range(r * part, min((r + 1) * part, numel))]
                concatenated[r] += share + [PAD] * (part - len(share))
            size += part
        sub_sizes.append(size)
    slack = draw(st.integers(min_value=0, max_value=3))
    total = sum(sub_sizes) + slack
    if draw(st.booleans()):
        cuts = sub_sizes[:-1] + [sub_sizes[-1] + slack]
    else:  # anywhere
        points = sorted(draw(st.lists(st.integers(min_value=0, max_value=total), max_size=4)))
        cuts = [b - a for a, b in zip([0, *points], [*points, total])]
    stored = []
    for r in range(ws):
        flat = concatenated[r] + [PAD] * slack
        at, per_tensor = 0, []
        for n in cuts:
            per_tensor.append(flat[at : at + n])
            at += n
        stored.append(per_tensor)
    return shapes, [list(cuts) for _ in range(ws)], stored


@settings(max_examples=400, deadline=None)
@given(case=zero3_case())
def test_zero3_pieces_put_every_element_once_in_its_partition(
    case: tuple[Shapes, list[list[int]], list[list[list[tuple[str, int]]]]],
) -> None:
    shapes, sizes, stored = case
    _read_back(shapes, zero3_pieces(shapes, sizes), stored)


@settings(max_examples=200, deadline=None)
@given(case=zero3_case())
def test_zero3_pieces_refuse_flat_tensors_too_small(
    case: tuple[Shapes, list[list[int]], list[list[list[tuple[str, int]]]]],
) -> None:
    shapes, sizes, _ = case
    ws = len(sizes)
    needed = sum(-(-math.prod(shape) // ws) for group in shapes for _, shape in group)
    assume(needed > 0)
    short = list(sizes[0])
    excess = sum(short) - needed + 1  # take this many elements off the flat tensors, from the last
    for j in reversed(range(len(short))):
        cut = min(excess, short[j])
        short[j] -= cut
        excess -= cut
    with pytest.raises(ValueError, match="need more elements than fp32_flat_groups hold"):
        zero3_pieces(shapes, [list(short) for _ in range(ws)])


@pytest.mark.parametrize("sizes", [[[5], [4]], [[5], [5, 0]], [[-1, 6], [-1, 6]]])
def test_zero3_pieces_refuse_ranks_that_differ_or_negative_sizes(sizes: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="fp32_flat_groups differ"):
        zero3_pieces([[("a", (3, 3))]], sizes)


def test_zero3_pieces_of_a_known_layout() -> None:
    """A (3, 3) parameter at 2 ranks: 5 elements each, the last rank's fifth padding; then a (2,) one, 1 each."""
    pieces = zero3_pieces([[("a", (3, 3))], [("b", (2,))]], [[5, 1], [5, 1]])
    assert pieces == {"a": [(0, 0, 0, 0, 5), (1, 0, 0, 5, 9)], "b": [(0, 1, 0, 0, 1), (1, 1, 0, 1, 2)]}
