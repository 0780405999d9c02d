"""Leaf: element types by name, without torch.

A checkpoint's index, a conversion's plan and the move of its bytes need only a dtype's name and
element size, so they use ``DType``: one interned record per torch dtype name (``"bfloat16"``),
equal and hashed by name, printed as torch prints the dtype (``torch.bfloat16``). Code that calls
torch takes ``DType.torch`` (the ``torch.dtype``; imports torch at first use). ``as_dtype`` turns a
``torch.dtype``, a ``DType`` or a canonical name into a ``DType``.

A ``DType`` compares equal to the ``torch.dtype`` of its name (either way round), but does not
share its hash: a set or dict of torch dtypes is looked up with ``.torch``, or keyed by name.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any, ClassVar, TypeGuard

if TYPE_CHECKING:
    import torch

__all__ = [
    "DType",
    "as_dtype",
    "ITEMSIZES",
    "UNCASTABLE",
    "SAFETENSORS_NAMES",
    "VALUES_PER_ELEMENT",
    "CAST_NAMES",
    "is_tensor",
    "safetensors_dtype",
]

# element size in bytes of each dtype this tool handles (``torch.dtype.itemsize``);
# tests/unit/test_dtypes.py checks each against torch
ITEMSIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}  # fmt: skip
_FLOATING = frozenset(n for n in ITEMSIZES if n.startswith(("float", "bfloat")))
# floating dtypes torch has no cast for (float4_e2m1fn_x2 packs two 4-bit values per element):
# --dtype/--optim-dtype keep them as they are (constants.UNCASTABLE_DTYPES, by name)
UNCASTABLE = frozenset({"float4_e2m1fn_x2"})

# dtype name -> safetensors dtype name (the header's "dtype"): the one table (constants.SAFETENSORS_DTYPES
# is it keyed by torch dtypes), used by the writer (writers/safetensors.py) and both readers
# (formats/hf_storage.py, formats/full_file.py). The names are the ones safetensors 0.8 writes for
# each torch dtype (``safetensors.torch.save``; its Rust ``Dtype``); tests/unit/test_constants.py
# checks each. safetensors has no complex128 or complex32 (ComplexHalf).
SAFETENSORS_NAMES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0", "complex64": "C64", "float4_e2m1fn_x2": "F4",
}  # fmt: skip
# dtypes packing several safetensors values into one element: safetensors' header shape counts the
# values (F4: two 4-bit floats per byte), so its last dim is this many times torch's
VALUES_PER_ELEMENT: dict[str, int] = {"float4_e2m1fn_x2": 2}

# the one table of the names --dtype / --optim-dtype and TransformOptions take (torchtitan's
# TORCH_DTYPE_MAP) to the dtype each means (constants.DTYPE_NAMES is it with torch dtypes). Each
# dtype's first name is the one the CLI lists (cli._options.DtypeChoice); the others are aliases,
# matched without regard to case.
CAST_NAMES: dict[str, str] = {
    "fp32": "float32", "float32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
}  # fmt: skip


class DType:
    """A torch dtype by its canonical name (``str(torch_dtype)`` without ``torch.``); one instance per name.

    Attributes:
        name: ``"bfloat16"``.
        itemsize: bytes per element.
        is_floating_point: as ``torch.dtype.is_floating_point`` (float8 and float4 included).
    """

    __slots__ = ("name", "itemsize", "is_floating_point")
    _interned: ClassVar[dict[str, DType]] = {}
    name: str
    itemsize: int
    is_floating_point: bool

    def __new__(cls, name: str) -> DType:
        """The one ``DType`` of ``name`` (a canonical torch name); a name outside ``ITEMSIZES`` asks torch its size."""
        known = cls._interned.get(name)
        if known is not None:
            return known
        itemsize = ITEMSIZES.get(name)
        if itemsize is None:
            itemsize = _torch_dtype(name).itemsize  # a dtype outside the table (quantized, bits): ask torch
        obj = object.__new__(cls)
        object.__setattr__(obj, "name", name)
        object.__setattr__(obj, "itemsize", itemsize)
        object.__setattr__(obj, "is_floating_point", name in _FLOATING)
        return cls._interned.setdefault(name, obj)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("DType is immutable")

    def __reduce__(self) -> tuple[type[DType], tuple[str]]:
        return (DType, (self.name,))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return self is other
        if _is_torch_dtype(other):  # a user's adapter may compare with torch.bfloat16
            return f"torch.{self.name}" == str(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(("DType", self.name))

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    __str__ = __repr__

    @property
    def torch(self) -> torch.dtype:
        """The ``torch.dtype`` of this name (imports torch at first use)."""
        return _torch_dtype(self.name)


@functools.cache
def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch {torch.__version__} has no dtype {name!r}")
    return dtype


def _is_torch_dtype(value: object) -> bool:
    return type(value).__name__ == "dtype" and type(value).__module__ == "torch"


def as_dtype(dtype: Any) -> DType:
    """``dtype`` (a ``DType``, a ``torch.dtype`` or a canonical name such as ``"bfloat16"``) as a ``DType``.

    Raises:
        TypeError: ``dtype`` is none of those.
    """
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, str):
        return DType(dtype)
    if _is_torch_dtype(dtype):
        return DType(str(dtype).removeprefix("torch."))
    raise TypeError(f"not a dtype: {dtype!r}")


def is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    """``isinstance(value, torch.Tensor)`` without importing torch: no object is a tensor before torch is imported."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


_FROM_SAFETENSORS = {code: name for name, code in SAFETENSORS_NAMES.items()}


def safetensors_dtype(code: str) -> DType | None:
    """The dtype of a safetensors header's ``"dtype"`` (``"BF16"``), or None for one this tool does not read."""
    name = _FROM_SAFETENSORS.get(code)
    return None if name is None else DType(name)
