"""Layout: nesting rebuilt from planner paths; producer detection."""

from __future__ import annotations

import pytest

from fsdp_convert.formats import read_index
from fsdp_convert.layout import detect_producer, unflatten
from tests._samples import Sample


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


def test_detects_fsdp2(ws3_ckpt: Sample) -> None:
    assert detect_producer(read_index(ws3_ckpt.checkpoint)) == "fsdp2"
