"""Exact comparison of nested state dicts: same keys in the same order, same types, bitwise tensors."""

from __future__ import annotations

from typing import Any

import torch


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in element order, as a flat uint8 tensor (any dtype, 0-dim too)."""
    return t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same dtype, shape and bytes: -0.0 differs from 0.0, a NaN equals a NaN with the same bits."""
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(tensor_bytes(got), tensor_bytes(want))


def assert_same_state(got: Any, want: Any, path: str = "") -> int:
    """Assert ``got`` equals ``want`` exactly (tensors bit for bit); return the number of tensors compared."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: got {type(got).__name__}, want a tensor"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(tensor_bytes(got), tensor_bytes(want)), f"{path}: bytes differ"
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
