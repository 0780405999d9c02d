"""Exact comparison of nested state dicts: same keys in the same order, same types, bitwise tensors."""

from __future__ import annotations

from typing import Any

import torch


def assert_same_state(got: Any, want: Any, path: str = "") -> int:
    """Assert ``got`` equals ``want`` exactly; return the number of tensors compared."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: got {type(got).__name__}, want a tensor"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want), f"{path}: values differ"
        return 1
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{path}: got {type(got).__name__}, want a dict"
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        return sum(assert_same_state(got[k], want[k], f"{path}.{k}") for k in want)
    if isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{path}: {got!r} != {want!r}"
        return sum(assert_same_state(g, w, f"{path}[{i}]") for i, (g, w) in enumerate(zip(got, want)))
    assert type(got) is type(want) and got == want, f"{path}: {got!r} != {want!r}"
    return 0
