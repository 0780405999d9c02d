"""Comparison of two checkpoints of any formats, one tensor of each at a time (``verify``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp_convert.layout import Group, group_of_top
from fsdp_convert.metadata import dtype_name
from fsdp_convert.plan import Only
from fsdp_convert.sources import open_source
from fsdp_convert.transform import TransformOptions

__all__ = ["Difference", "VerifyResult", "verify"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Difference:
    """One way two checkpoints differ.

    Attributes:
        key: the flat key (``model.layers.0.attn.wq.weight``, ``optim.param_groups.0.lr``).
        kind: ``differs`` (both have it), ``missing`` (only in A) or ``extra`` (only in B).
        detail: what differs (dtype, shape, max abs difference, values).
    """

    key: str
    kind: str
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyResult:
    """Outcome of ``verify``: equal when ``differences`` is empty."""

    a: Path
    b: Path
    compared: int
    differences: tuple[Difference, ...]

    @property
    def equal(self) -> bool:
        """True when every key is in both and every value matches."""
        return not self.differences

    def to_json_dict(self) -> dict[str, Any]:
        """JSON-ready form with ``schema_version`` 1."""
        return {
            "schema_version": 1,
            "a": str(self.a),
            "b": str(self.b),
            "equal": self.equal,
            "compared": self.compared,
            "differences": [{"key": d.key, "kind": d.kind, "detail": d.detail} for d in self.differences],
        }


def _key_group(key: str) -> Group:
    return group_of_top(key.split(".", 1)[0])


def _compare(a: Any, b: Any, atol: float | None, rtol: float | None) -> str | None:
    """None when equal, else what differs."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype:
            return f"dtype {dtype_name(a.dtype)} != {dtype_name(b.dtype)}"
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
        if atol is None and rtol is None or not a.is_floating_point():
            # bitwise, so NaNs with the same bits compare equal and -0.0 differs from 0.0
            if torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)):
                return None
        elif torch.allclose(a, b, rtol=rtol or 0.0, atol=atol or 0.0, equal_nan=True):
            return None
        if a.is_floating_point() and a.numel():
            return f"values differ (max abs difference {(a.double() - b.double()).abs().max().item():.3g})"
        return f"values differ ({int((a != b).sum())} of {a.numel()} elements)"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return f"{type(a).__name__} != {type(b).__name__}"
    if type(a) is not type(b) or a != b:
        return f"{a!r} != {b!r}"
    return None


def verify(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    only: Only = "all",
    check_crc: bool = True,
    options: TransformOptions | None = None,
) -> VerifyResult:
    """Compare two checkpoints of any formats (DCP, .pt, safetensors, HF folder) key by key.

    Keys are DCP's flattened keys (see ``sources``); when either side holds model weights only
    (safetensors), only ``model.*`` keys are compared. Tensors must have the same dtype and shape
    and, by default, the same bits; with ``atol``/``rtol`` floating tensors may differ within
    ``torch.allclose``. Plain values must be equal and of the same type. One tensor of each side
    is in memory at a time.

    Args:
        a: the reference checkpoint.
        b: the checkpoint to check against it.
        atol: absolute tolerance for floating tensors.
        rtol: relative tolerance for floating tensors.
        only: compare only this top-level group (``model``, ``optim``) or ``all``.
        check_crc: check CRC-32s of DCP payloads while reading.
        options: the transforms a DCP side is seen through (see ``sources.open_source``).

    Returns:
        The keys compared and every difference (``missing``: only in A; ``extra``: only in B).

    Raises:
        CheckpointNotFoundError, NotADcpCheckpointError, UnsafeContentError, CorruptChunkError,
        MissingDataFileError, CoverageError: a side cannot be read.
    """
    source_a = open_source(a, check_crc=check_crc, options=options)
    try:
        source_b = open_source(b, check_crc=check_crc, options=options)
    except BaseException:
        source_a.close()
        raise
    try:
        keys_a, keys_b = source_a.keys(), source_b.keys()
        if source_a.model_only or source_b.model_only:
            keys_a = [k for k in keys_a if _key_group(k) == "model"]
            keys_b = [k for k in keys_b if _key_group(k) == "model"]
        if only != "all":
            keys_a = [k for k in keys_a if _key_group(k) == only]
            keys_b = [k for k in keys_b if _key_group(k) == only]
        in_b = set(keys_b)
        in_a = set(keys_a)
        diffs = [Difference(key=k, kind="missing", detail="only in A") for k in keys_a if k not in in_b]
        diffs += [Difference(key=k, kind="extra", detail="only in B") for k in keys_b if k not in in_a]
        compared = 0
        for key in keys_a:
            if key in in_b:
                detail = _compare(source_a.get(key), source_b.get(key), atol, rtol)
                compared += 1
                if detail is not None:
                    diffs.append(Difference(key=key, kind="differs", detail=detail))
    finally:
        source_a.close()
        source_b.close()
    return VerifyResult(a=Path(a), b=Path(b), compared=compared, differences=tuple(diffs))
