"""formats/index.py: coverage checks of a tensor's chunks, dtype and key names, and unflatten of (path, value) pairs."""

from __future__ import annotations

import pytest
import torch

from fsdp_convert.errors import CoverageError
from fsdp_convert.formats.index import (
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
