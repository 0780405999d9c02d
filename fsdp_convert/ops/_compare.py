"""Comparing two values of ``verify``: tensors bit for bit or within tolerances, plain values by equality.

A tensor pair is equal when dtype, shape and every element's bytes agree (``same_bytes``, as wide
integers); with ``atol``/``rtol``, floating tensors may differ within ``torch.allclose`` (NaNs
equal). A side cast as ``consolidate --dtype`` casts is compared after the cast (``cast``).
"""

from __future__ import annotations

import reprlib
from typing import Any

import torch

from fsdp_convert.constants import UNCASTABLE_DTYPES
from fsdp_convert.formats.index import dtype_name, values_equal

__all__ = ["cast", "compare", "same_bytes"]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors of one dtype and shape hold the same bytes, compared as wide integers.

    Their bytes are seen as the widest integer (8, 4, 2 or 1 bytes) that divides their size, so a
    gigabyte compares in a few hundredths of a second where a byte-by-byte compare takes ten times that.
    """
    bytes_a, bytes_b = (_element_bytes(t).reshape(-1) for t in (a, b))
    for wide in (torch.int64, torch.int32, torch.int16):
        if bytes_a.numel() % wide.itemsize == 0:
            try:
                return torch.equal(bytes_a.view(wide), bytes_b.view(wide))
            except RuntimeError:  # a view at an offset not aligned to the wider type
                break
    return torch.equal(bytes_a, bytes_b)


def _element_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a ``(numel, itemsize)`` uint8 tensor, in element order (any dtype, 0-dim too).

    Works for every dtype, where ``torch.equal`` and ``!=`` do not (float8 and float4 have no
    CPU kernels for them, and NaN != NaN).
    """
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).reshape(-1, t.dtype.itemsize)


def _values(t: torch.Tensor) -> torch.Tensor | None:
    """A real floating tensor's values as float64 (exact for every float dtype, float8 included); None otherwise."""
    if not t.is_floating_point() or t.dtype in UNCASTABLE_DTYPES:
        return None
    return t.detach().to(torch.float64)


def cast(value: Any, dtype: torch.dtype | None) -> tuple[Any, bool]:
    """``value`` cast element by element (as consolidate's writers cast), if a castable floating tensor of another dtype."""
    if not isinstance(value, torch.Tensor) or dtype in (None, value.dtype) or not value.is_floating_point():
        return value, False
    if value.dtype in UNCASTABLE_DTYPES:
        return value, False
    return value.reshape(-1).to(dtype).reshape(value.shape), True


def compare(a: Any, b: Any, atol: float | None, rtol: float | None, *, any_nan: bool = False) -> str | None:
    """None when equal, else what differs.

    Tensors are equal when their bytes are (so NaNs with the same bits are equal and -0.0 differs
    from 0.0), compared as bytes for every dtype; with ``atol``/``rtol``, real floating tensors
    (float8 too, through float64) are equal within ``torch.allclose`` (NaNs equal). Complex,
    integer, bool and float4 tensors are always compared bitwise. With ``any_nan`` (a side was
    cast: torch's casts give a NaN's sign and payload bits by code path, vectorised or not), a
    NaN equals any NaN; every other element still compares by its bytes. Plain values are equal
    when of the same types and equal item by item, floats by their bits too (``formats.index.values_equal``).
    """
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype:
            return f"dtype {dtype_name(a.dtype)} != {dtype_name(b.dtype)}"
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
        if same_bytes(a, b):
            return None
        bytes_a, bytes_b = _element_bytes(a), _element_bytes(b)
        values_a, values_b = _values(a), _values(b)
        if any_nan and values_a is not None and values_b is not None:
            other_bits = (bytes_a != bytes_b).any(dim=1) & ~(values_a.isnan() & values_b.isnan()).reshape(-1)
            if not other_bits.any():
                return None
        if values_a is not None and values_b is not None:
            if (atol is not None or rtol is not None) and torch.allclose(
                values_a, values_b, rtol=rtol or 0.0, atol=atol or 0.0, equal_nan=True
            ):
                return None
            nan_a, nan_b = values_a.isnan(), values_b.isnan()
            # a NaN on both sides, or equal values, is no difference in value (inf - inf would be NaN)
            alike = (nan_a & nan_b) | (values_a == values_b)
            one_nan = int((nan_a ^ nan_b).sum())
            diff = torch.where(alike | nan_a | nan_b, 0.0, (values_a - values_b).abs()).max().item()
            if one_nan:
                elsewhere = f"; max abs difference {diff:.3g} elsewhere" if diff else ""
                return f"values differ (a NaN on one side in {one_nan} of {a.numel()} elements{elsewhere})"
            if diff == 0:
                return "values differ in bits only (-0.0 and 0.0, or NaNs of other bits)"
            return f"values differ (max abs difference {diff:.3g})"
        differing = int((bytes_a != bytes_b).any(dim=1).sum())
        return f"values differ ({differing} of {a.numel()} elements)"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return f"{type(a).__name__} != {type(b).__name__}"

    # plain values: a walk of their own (shared parts once, Ctrl-C heard), floats by their bits as tensors'
    def tensors(x: Any, y: Any) -> bool | None:
        return compare(x, y, atol, rtol, any_nan=any_nan) is None if isinstance(x, torch.Tensor) else None

    if not values_equal(a, b, tensors):
        return f"{_shown(a)} != {_shown(b)}"
    return None


_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother = 3, 40, 40


def _shown(value: Any) -> str:
    """A plain value for a message, at most 80 characters (``reprlib``: a few levels and items, never the whole)."""
    text = _short.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
