"""Read stage, DCP: a chunk payload's ``data.pkl`` read as an inert tensor record, without torch.

DCP's ``FileSystemWriter`` stores each chunk as ``torch.save(tensor)``; its ``data.pkl``
(``torch/serialization.py``, ``_save``; ``Tensor.__reduce_ex__``) is one call of
``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
OrderedDict())``, or ``_rebuild_tensor_v3(..., dtype)`` for dtypes without a legacy storage
class, where ``storage`` is the persistent id ``("storage", <storage class>, key, "cpu", numel)``.

``read_payload_tensor`` reads exactly that shape of pickle with ``_safe_pickle``'s interpreter
and returns a ``PayloadTensor`` (dtype name, sizes and strides in elements, the storage's record
and length in bytes), or None for anything else (a tensor subclass, a view kept with its base's
hooks, a quantized or non-CPU storage): the caller then takes torch's own loader, which raises
the right errors. It is how ``DcpReader.locate`` finds a chunk's bytes with no torch import and
about a tenth of ``torch.load``'s time per chunk.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fsdp_convert.constants import STORAGE_DTYPE_NAMES, TORCH_DTYPE_NAMES
from fsdp_convert.formats._range import PayloadEdges
from fsdp_convert.formats._safe_pickle import MalformedError, RefusedError, SafeUnpickler
from fsdp_convert.formats.index import DTYPE_ITEMSIZES
from fsdp_convert.zip_records import ZipFormatError, ZipRecord, read_records

__all__ = ["PayloadTensor", "read_payload_tensor", "contiguous", "whole_storage", "plain_value"]


@dataclass(frozen=True, slots=True)
class PayloadTensor:
    """The tensor a chunk payload's ``data.pkl`` rebuilds, as read.

    Attributes:
        dtype_name: element type, as torch names it without ``torch.`` (``"bfloat16"``).
        storage_key: the storage's record name under ``data/`` (``"0"``).
        storage_nbytes: the storage's length, in bytes.
        storage_offset: the tensor's first element in its storage, in elements.
        sizes: shape, in elements.
        stride: strides, in elements.
    """

    dtype_name: str
    storage_key: str
    storage_nbytes: int
    storage_offset: int
    sizes: tuple[int, ...]
    stride: tuple[int, ...]


class _Global:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


_REBUILD_V2, _REBUILD_V3, _ORDERED_DICT = _Global("v2"), _Global("v3"), _Global("OrderedDict")
_UNTYPED = "UntypedStorage"


@dataclass(frozen=True, slots=True)
class _Storage:
    storage_class: str
    key: str
    numel: int


class _PayloadUnpickler(SafeUnpickler):
    """Admits the names a plain CPU tensor's pickle uses; refuses the rest (the caller falls back to torch)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _REBUILD_V2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _REBUILD_V3
        if module == "collections" and name == "OrderedDict":
            return _ORDERED_DICT
        if module == "torch" and name in STORAGE_DTYPE_NAMES:
            return _Global(name)
        if module == "torch.storage" and name == _UNTYPED:
            return _Global(_UNTYPED)
        if module == "torch" and name in TORCH_DTYPE_NAMES:
            return _Global("dtype:" + TORCH_DTYPE_NAMES[name])
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage" or pid[3] != "cpu":
            raise RefusedError("not a CPU storage")
        _, cls, key, _, numel = pid
        if not isinstance(cls, _Global) or type(key) is not str or type(numel) is not int or numel < 0:
            raise RefusedError("not a storage reference")
        return _Storage(cls.name, key, numel)

    def call(self, func: Any, args: tuple[Any, ...]) -> Any:
        if func is _ORDERED_DICT and not args:
            return OrderedDict()
        if func is _REBUILD_V2 and len(args) == 6:
            storage, dtype_name = args[0], None
            if isinstance(storage, _Storage):
                dtype_name = STORAGE_DTYPE_NAMES.get(storage.storage_class)
            return _tensor(args[:5], args[5], dtype_name)
        if func is _REBUILD_V3 and len(args) == 7 and isinstance(args[6], _Global) and args[6].name.startswith("dtype:"):
            if isinstance(args[0], _Storage) and args[0].storage_class == _UNTYPED:
                return _tensor(args[:5], args[5], args[6].name[6:], untyped=True)
        return super().call(func, args)


def _ints(value: Any) -> bool:
    return type(value) is tuple and all(type(v) is int and v >= 0 for v in value)


def _tensor(args: tuple[Any, ...], hooks: Any, dtype_name: str | None, *, untyped: bool = False) -> PayloadTensor:
    storage, offset, sizes, stride, requires_grad = args
    if dtype_name is None or type(offset) is not int or offset < 0 or not _ints(sizes) or not _ints(stride):
        raise RefusedError("not a plain tensor")
    if len(sizes) != len(stride) or type(requires_grad) is not bool or type(hooks) is not OrderedDict or hooks:
        raise RefusedError("not a plain tensor")
    itemsize = DTYPE_ITEMSIZES.get(dtype_name)
    if untyped:
        nbytes = storage.numel
    elif itemsize is None:
        raise RefusedError("a storage class of unknown element size")
    else:
        nbytes = storage.numel * itemsize
    return PayloadTensor(dtype_name, storage.key, nbytes, offset, tuple(sizes), tuple(stride))


def read_payload_tensor(data: bytes) -> PayloadTensor | None:
    """The plain CPU tensor ``data`` (a chunk payload's ``data.pkl``) rebuilds; None for any other pickle.

    Never raises for bad bytes: None sends the caller to torch's loader, which names the fault.
    A model's chunks of one shape share one pickle, so a short one (all real ones) is read once.
    """
    return _read_cached(data) if len(data) <= 4096 else _read(data)


@functools.lru_cache(maxsize=4096)
def _read_cached(data: bytes) -> PayloadTensor | None:
    return _read(data)


def _read(data: bytes) -> PayloadTensor | None:
    try:
        value = _PayloadUnpickler(data).load()
    except (RefusedError, MalformedError, RecursionError, MemoryError):
        return None
    return value if isinstance(value, PayloadTensor) else None


def contiguous(sizes: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """``Tensor.is_contiguous()`` for these sizes and strides (c10's ``compute_contiguous``): size-1 dims skip."""
    if 0 in sizes:
        return True
    expected = 1
    for size, step in zip(reversed(sizes), reversed(stride), strict=True):
        if size != 1:
            if step != expected:
                return False
            expected *= size
    return True


def whole_storage(tensor: PayloadTensor, storage: ZipRecord) -> bool:
    """Whether ``storage`` (the payload's one storage record) holds the tensor's elements alone, in C order from its start."""
    return (
        storage.short_name == f"data/{tensor.storage_key}"
        and tensor.storage_offset == 0
        and tensor.storage_nbytes == storage.size
        and contiguous(tensor.sizes, tensor.stride)
    )


class _PlainUnpickler(SafeUnpickler):
    """Plain data and ``OrderedDict`` only: a DCP bytes entry (a param group's ``lr``, its ``params``)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return _ORDERED_DICT
        return super().find_class(module, name)

    def call(self, func: Any, args: tuple[Any, ...]) -> Any:
        if func is _ORDERED_DICT and not args:
            return OrderedDict()
        return super().call(func, args)


def plain_value(edges: PayloadEdges, length: int, check_crc: bool) -> tuple[Any, list[tuple[ZipRecord, int]]] | None:
    """A torch.save payload of plain data (no tensor, no class but ``OrderedDict``), read without torch.

    Args:
        edges: the payload's ends (``formats._range.PayloadEdges``).
        length: the payload's length, in bytes.
        check_crc: also compare every record's CRC-32 with its data.

    Returns:
        ``(value, CRC-32 mismatches)``, or None for any other payload (torch's loader then reads
        it and names the fault).
    """
    try:
        records = read_records(edges.pread, length)
    except ZipFormatError:
        return None
    pickles = [r for r in records if r.short_name == "data.pkl"]
    if len(pickles) != 1 or any(r.compression or r.short_name.startswith("data/") for r in records):
        return None
    try:
        value = _PlainUnpickler(edges.pread(pickles[0].size, pickles[0].data_offset)).load()
    except (RefusedError, MalformedError, RecursionError, MemoryError):
        return None
    return value, edges.crc_mismatches(records) if check_crc else []
