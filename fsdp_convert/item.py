"""The output item: one value of the output, where it goes and where it comes from.

The record every stage after the items passes on: ``transform.build_items`` (with ``plan.items``,
``lora`` and the adapters) makes them, the plans (``plan``, ``plan.reshard``) place them in files,
the output kinds write them and the movers fill them. Pure data; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fsdp_convert.derive import Derived
from fsdp_convert.dtypes import DType
from fsdp_convert.formats.index import Entry, ObjPath, TensorEntry
from fsdp_convert.roles import Group

__all__ = ["OutputItem"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputItem:
    """One value of the output: where it goes, and where it comes from.

    Attributes:
        entry: the checkpoint entry read for it (for a ``constant``, the entry it replaces, named
            in errors).
        path: its place in the output's nested state dict.
        group: ``model``, ``optim`` or ``other``.
        dtype: output dtype of a tensor (a cast when it differs from ``entry.dtype``); None for values.
        constant: True when ``value`` is written instead of reading ``entry`` (a param group's
            ``params`` after renaming or re-keying, a regrouped param group field).
        value: the constant's value.
        derived: how the tensor is computed from ``sources``, row block by row block (``derive``).
        sources: the entries ``derived.inputs`` name, in their order (``entry`` is the first).
    """

    entry: Entry
    path: ObjPath
    group: Group
    dtype: DType | None = None
    constant: bool = False
    value: Any = None
    derived: Derived | None = None
    sources: tuple[TensorEntry, ...] = ()

    @property
    def is_tensor(self) -> bool:
        """True for a tensor read from the checkpoint."""
        return isinstance(self.entry, TensorEntry) and not self.constant

    @property
    def shape(self) -> tuple[int, ...]:
        """Global shape of a tensor item, in elements (a derived tensor's own)."""
        if self.derived is not None:
            return self.derived.shape
        assert isinstance(self.entry, TensorEntry)
        return self.entry.shape

    @property
    def nbytes(self) -> int:
        """Output size of a tensor (elements x output item size), or the payload size of a value, in bytes."""
        if self.is_tensor:
            assert isinstance(self.entry, TensorEntry) and self.dtype is not None
            return math.prod(self.shape) * self.dtype.itemsize
        return 0 if self.constant else self.entry.nbytes

    @property
    def read_bytes(self) -> int:
        """Bytes held while this item is read and converted: the larger of source and output size."""
        return max(self.nbytes, self.entry.nbytes) if not self.constant else 0
