"""formats/index.py: coverage checks of a tensor's chunks, dtype and key names, and unflatten of (path, value) pairs."""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdp_convert.formats._coverage as coverage_module
from fsdp_convert.errors import CoverageError
from fsdp_convert.formats.index import (
    CheckpointIndex,
    ChunkEntry,
    DictKey,
    TensorEntry,
    check_coverage,
    dcp_key,
    dtype_name,
    plain_path,
    unflatten,
)


def _entry(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> TensorEntry:
    chunks = tuple(ChunkEntry(offsets=o, sizes=s, relative_path="__0_0.distcp", offset_bytes=0, length_bytes=0) for o, s in boxes)
    return TensorEntry(fqn="model.w", path=("model", "w"), shape=shape, dtype=torch.float32, chunks=chunks)


def test_chunks_that_tile_the_shape_pass_coverage() -> None:
    # a 2-d grid of four boxes that only touch at their edges, and an empty box recorded without data
    check_coverage(_entry((4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3)), ((4, 0), (0, 6))]))
    check_coverage(_entry((5,), [((0,), (2,)), ((2,), (3,))]))


@pytest.mark.parametrize(
    ("shape", "boxes", "message"),
    [
        ((6,), [((0,), (3,)), ((4,), (2,))], "cover 5 of 6 elements"),  # a gap at element 3
        ((6,), [((0,), (4,)), ((3,), (3,))], r"offsets \[0\] and \[3\] overlap"),
        ((4, 4), [((0, 0), (2, 4)), ((1, 1), (2, 2)), ((3, 0), (1, 4))], "overlap"),  # overlap inside, 2-d
        ((6,), [((0,), (3,)), ((3,), (4,))], "lies outside shape"),
        ((6,), [((0,), (6,)), ((2,), (0,))], None),  # an empty box anywhere is fine: not an error
        ((2, 3), [((0,), (6,))], "has not the 2 dims"),
        ((6,), [((-1,), (7,))], "negative"),
    ],
)
def test_gaps_overlaps_and_outside_chunks_are_coverage_errors(
    shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], message: str | None
) -> None:
    entry = _entry(shape, boxes)
    if message is None:
        check_coverage(entry)
        return
    with pytest.raises(CoverageError, match=message) as info:
        check_coverage(entry)
    assert "model.w" in str(info.value)


def test_dtype_name_and_dcp_key() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"
    assert dcp_key(("optim", "param_groups", 0, "lr")) == "optim.param_groups.0.lr"
    assert dcp_key(("optim", "state", DictKey(3), "exp_avg")) == "optim.state.3.exp_avg"


def test_plain_path_turns_only_dict_keys_into_strings() -> None:
    path = plain_path(("optim", "state", DictKey(0), "step", 1))
    assert path == ("optim", "state", "0", "step", 1)
    assert type(path[2]) is str and type(path[4]) is int


def test_unflatten_nests_lists_dicts_and_dict_keys() -> None:
    state = unflatten(
        [
            (("model", "w"), 1),
            (("optim", "param_groups", 1, "lr"), 0.2),
            (("optim", "param_groups", 0, "lr"), 0.1),
            (("optim", "state", DictKey(1), "step"), 5),
            (("optim", "state", DictKey(0), "step"), 4),
        ]
    )
    assert state == {
        "model": {"w": 1},
        "optim": {"param_groups": [{"lr": 0.1}, {"lr": 0.2}], "state": {1: {"step": 5}, 0: {"step": 4}}},
    }
    assert isinstance(state["optim"]["param_groups"], list)
    assert all(type(k) is int for k in state["optim"]["state"])  # DictKey comes back as a plain int


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([(("a", 0), 1), (("a", "x"), 2)], "mixes list and dict"),
        ([(("a", "b"), 1), (("a", "b"), 2)], "given twice"),
        ([(("a",), 1), (("a", "b"), 2)], "runs through a value"),
        ([(("a", 0), 1), (("a", 2), 2)], r"list indices \[0, 2\]"),
    ],
)
def test_unflatten_refuses_inconsistent_paths(items: list[tuple[tuple[str | int, ...], int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        unflatten(items)


def test_unflatten_rebuilds_lists_and_dicts() -> None:
    items = [
        (("optim", "state", "a.b", "step"), 1),
        (("optim", "param_groups", 1, "lr"), 0.2),
        (("optim", "param_groups", 0, "lr"), 0.1),
        (("optim", "param_groups", 0, "params"), ["a.b"]),
    ]
    assert unflatten(items) == {
        "optim": {"state": {"a.b": {"step": 1}}, "param_groups": [{"lr": 0.1, "params": ["a.b"]}, {"lr": 0.2}]}
    }


def test_unflatten_rejects_sparse_lists_and_mixed_levels() -> None:
    with pytest.raises(ValueError, match="list indices"):
        unflatten([(("g", 1), 0)])
    with pytest.raises(ValueError, match="mixes"):
        unflatten([(("g", 0), 0), (("g", "x"), 1)])


# --- coverage in O(n log n): exact against a brute-force count, and fast on what files may claim ---


def _counts(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> torch.Tensor:
    """How many boxes hold each element (the brute force ``check_coverage`` must agree with)."""
    counts = torch.zeros(shape, dtype=torch.int64)
    for offsets, sizes in boxes:
        counts[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    return counts


def _guillotine(shape: tuple[int, ...], cuts: list[tuple[int, int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes that tile ``shape``: split the largest box on dim ``d`` at fraction ``f/7`` for each ``(d, f)``."""
    boxes = [((0,) * len(shape), shape)]
    for d, f in cuts:
        boxes.sort(key=lambda b: -math.prod(b[1]))
        offsets, sizes = boxes[0]
        d %= len(shape)
        at = sizes[d] * f // 7
        if 0 < at < sizes[d]:
            boxes[0] = (offsets, sizes[:d] + (at,) + sizes[d + 1 :])
            boxes.append((offsets[:d] + (offsets[d] + at,) + offsets[d + 1 :], sizes[:d] + (sizes[d] - at,) + sizes[d + 1 :]))
    return boxes


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    cuts=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6)), max_size=8),
    change=st.one_of(st.none(), st.tuples(st.integers(0, 50), st.integers(0, 2), st.integers(-2, 2), st.booleans())),
)
def test_coverage_agrees_with_counting_elements(
    shape: tuple[int, ...], cuts: list[tuple[int, int]], change: tuple[int, int, int, bool] | None
) -> None:
    """Tilings pass; a box moved or resized makes the error brute force sees: outside, overlap (named), or gap."""
    boxes = _guillotine(shape, cuts)
    if change is not None:  # move (or resize) one box by a few elements along one dim
        k, d, by, resize = change
        offsets, sizes = boxes[k % len(boxes)]
        d %= len(shape)
        if resize:
            sizes = sizes[:d] + (max(0, sizes[d] + by),) + sizes[d + 1 :]
        else:
            offsets = offsets[:d] + (max(0, offsets[d] + by),) + offsets[d + 1 :]
        boxes[k % len(boxes)] = (offsets, sizes)
    if any(o + s > n for offsets, sizes in boxes for o, s, n in zip(offsets, sizes, shape)):
        expected: str | None = "lies outside shape"
    else:
        counts = _counts(shape, boxes)
        expected = "overlap" if counts.max() > 1 else "gap" if counts.min() == 0 else None
    entry = _entry(shape, boxes)
    if expected is None:
        check_coverage(entry)
        return
    with pytest.raises(CoverageError, match=expected):
        check_coverage(entry)


@pytest.mark.parametrize(
    ("shape", "boxes"),
    [
        # a pinwheel: five boxes no straight cut separates (not a grid, not a guillotine)
        ((3, 3), [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2)), ((1, 1), (1, 1))]),
        # 3-d: tensor parallelism on dim 2 under FSDP's dim-0 cut, each half cut differently
        ((4, 2, 6), [((0, 0, 0), (4, 2, 3)), ((0, 0, 3), (1, 2, 3)), ((1, 0, 3), (3, 2, 3))]),
    ],
)
def test_tilings_that_are_no_grid_pass_and_an_overlap_with_an_equal_gap_does_not(
    shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> None:
    check_coverage(_entry(shape, boxes))
    (o, s), rest = boxes[-1], boxes[:-1]
    moved = (tuple(max(0, x - 1) for x in o), s)  # as many elements, one row stored twice and one missing
    with pytest.raises(CoverageError, match="overlap"):
        check_coverage(_entry(shape, [*rest, moved]))


def test_many_chunks_are_checked_in_n_log_n() -> None:
    """8,000 one-element chunks took 106 s (all pairs compared); 100k of them, or a 300 x 300 grid, take about a second."""
    n = 100_000
    flat = _entry((n,), [((i,), (1,)) for i in reversed(range(n))])
    grid = _entry((300, 300), [((i, j), (1, 1)) for i in range(300) for j in range(300)])
    start = time.monotonic()
    check_coverage(flat)
    check_coverage(grid)
    assert time.monotonic() - start < 20  # generous: the old check took hours here
    moved = _entry((n,), [((i,), (1,)) for i in range(n - 1)] + [((n - 2,), (1,))])
    with pytest.raises(CoverageError, match=rf"offsets \[{n - 2}\] and \[{n - 2}\] overlap"):
        check_coverage(moved)


def test_chunk_and_corner_caps_refuse_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coverage_module, "MAX_CHUNKS_PER_TENSOR", 100)
    with pytest.raises(CoverageError, match=r"^model.w: more than 100 chunks"):
        check_coverage(_entry((101,), [((i,), (1,)) for i in range(101)]))
    # 64 boxes split on 5 dims: 2048 corners, past a cap of 1024
    monkeypatch.setattr(coverage_module, "MAX_CORNERS", 1024)
    shape = (2, 2, 2, 2, 4)
    boxes = [(tuple(c) + (k,), (1, 1, 1, 1, 1)) for c in itertools.product(range(2), repeat=4) for k in range(4)]
    with pytest.raises(CoverageError, match=r"^model.w: chunks split 5 dims into more boxes than this tool checks") as info:
        check_coverage(_entry(shape, boxes))
    assert "\n" not in str(info.value)


def test_a_box_of_many_dims_is_named_by_its_first_eight() -> None:
    shape = (2,) * 1000
    with pytest.raises(CoverageError) as info:
        check_coverage(_entry(shape, [((1,) * 1000, (2,) * 1000)]))
    assert "lies outside" in str(info.value) and len(str(info.value)) < 200


def test_world_size_is_parsed_once_not_per_call() -> None:
    """layout asks for the world size once per entry; with a data file per entry that was quadratic."""
    files = tuple(f"__{r}_{k}.distcp" for r in range(1000) for k in range(200))
    index = CheckpointIndex(checkpoint_id=Path("/ck"), entries=(), data_files=files)
    start = time.monotonic()
    assert all(index.world_size == 1000 for _ in range(len(files)))
    assert time.monotonic() - start < 10  # 200k calls; each parsed 200k names before (hours)
    assert CheckpointIndex(checkpoint_id=Path("/ck"), entries=(), data_files=(f"__{'9' * 5000}_0.distcp",)).world_size == 0


def test_unflatten_refuses_ints_past_64_bits() -> None:
    """Ints past 64 bits can be made to share one hash (k * (2**61 - 1)): a dict of them fills in O(n^2)."""
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        unflatten([(("optim", "param_groups", 5 * (2**61 - 1), "lr"), 0.1)])
    with pytest.raises(ValueError, match=r"list indices \[0, 2, 4, 6, 8, 10, 12, 14, \.\.\.\]"):
        unflatten([(("a", i), i) for i in range(0, 40, 2)])


def test_a_gap_in_a_tensor_of_astronomic_size_is_one_line() -> None:
    """300 dims of 2^62: the element count has 5,600 digits, more than str() turns into text (4,300)."""
    shape = (1 << 62,) * 300
    with pytest.raises(CoverageError, match=r"^model.w: chunks miss elements; the checkpoint has a gap$"):
        check_coverage(_entry(shape, [((0,) * 300, (1,) + shape[1:])]))  # one row of dim 0
