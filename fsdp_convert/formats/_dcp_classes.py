"""Index stage, DCP: torch's ``.metadata`` classes as this package's own inert records, and its scalars.

Same names and fields as torch 2.13's (``torch/distributed/checkpoint/metadata.py``,
``planner.py``, ``filesystem.py``), so reading a ``.metadata`` imports neither
``torch.distributed.checkpoint`` (~0.5 s) nor torch (~1 s): dtypes, layouts, memory formats and
``torch.Size`` are read as names and tuples (``TorchDtype``, ``TorchLayout``,
``TorchMemoryFormat``, ``Size``). ``_dcp_records`` admits and checks them; ``as_torch`` turns
them into torch's own objects (importing torch and ``torch.distributed.checkpoint``) for callers
that want those: to change a ``.metadata`` and pickle it again, or to compare it with torch's.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import sys
from typing import Any

from fsdp_convert.constants import TORCH_DTYPE_NAMES
from fsdp_convert.formats._safe_pickle import MalformedError

__all__ = [
    "TORCH_TWINS",
    "as_torch",
    "Size",
    "TorchDtype",
    "TorchLayout",
    "TorchMemoryFormat",
    "torch_dtype",
    "torch_size",
    "torch_layout",
    "MEM_FORMAT_ENCODING",
    "WriteItemType",
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "StorageInfo",
    "SavePlan",
    "WriteItem",
    "TensorWriteData",
    "BytesIOWriteData",
    "MCoreMetadata",
    "MCoreSavePlan",
    "StoragePrefix",
]


class Size(tuple[int, ...]):
    """``torch.Size`` as read: a tuple of 64-bit ints (``torch.Size((2, 3))`` pickles as a call)."""

    __slots__ = ()


class TorchDtype(str):
    """A torch dtype a pickle names (``torch.bfloat16``), as its canonical name (``"bfloat16"``)."""

    __slots__ = ()


class TorchLayout(str):
    """A torch layout (``torch.serialization._get_layout("torch.strided")``), as its name (``"strided"``)."""

    __slots__ = ()


class TorchMemoryFormat(str):
    """A memory format (``TensorProperties``' encoding of it), as its name (``"contiguous_format"``)."""

    __slots__ = ()


_LAYOUTS = frozenset({"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged"})


def torch_dtype(name: str) -> TorchDtype | None:
    """``GLOBAL torch <name>``: the dtype it names, or None (refused) for any other name of torch's."""
    canonical = TORCH_DTYPE_NAMES.get(name)
    return None if canonical is None else TorchDtype(canonical)


def torch_size(dims: Any) -> Size:
    """``torch.Size(dims)`` of a tuple or list of 64-bit ints, as ``Size``; else MalformedError."""
    if type(dims) is not tuple and type(dims) is not list:
        raise MalformedError("a torch.Size of something other than a sequence")
    for d in dims:  # a plain loop: a third faster than all() over a generator for a few dims (millions of them)
        if type(d) is not int or not -(2**63) <= d < 2**63:
            raise MalformedError("a torch.Size of something other than 64-bit ints")
    return Size(dims)


def torch_layout(name: Any) -> TorchLayout:
    """``torch.serialization._get_layout(name)`` of ``"torch.<layout>"``, as ``TorchLayout``; else MalformedError."""
    if type(name) is not str or name.removeprefix("torch.") not in _LAYOUTS or not name.startswith("torch."):
        raise MalformedError("an unknown torch layout")
    return TorchLayout(name.removeprefix("torch."))


@dataclasses.dataclass
class ChunkStorageMetadata:
    """torch's ``ChunkStorageMetadata``: a stored box, ``offsets`` and ``sizes`` in elements (``torch.Size``)."""

    offsets: Any
    sizes: Any


@dataclasses.dataclass
class TensorProperties:
    """torch's ``TensorProperties``; pickled as a 5-tuple state (``_tensor_properties``)."""

    dtype: Any = None
    layout: Any = None
    requires_grad: bool = False
    memory_format: Any = None
    pin_memory: bool = False


@dataclasses.dataclass
class TensorStorageMetadata:
    """torch's ``TensorStorageMetadata``: ``properties``, the global ``size`` and the stored ``chunks``."""

    properties: TensorProperties
    size: Any
    chunks: list[ChunkStorageMetadata]


@dataclasses.dataclass
class BytesStorageMetadata:
    """torch's ``BytesStorageMetadata``: a non-tensor entry."""


@dataclasses.dataclass(frozen=True)
class MetadataIndex:
    """torch's ``MetadataIndex``: ``storage_data``'s key; hashes and compares as torch's, by ``(fqn, offset)``."""

    fqn: str
    offset: Any = None
    index: int | None = dataclasses.field(hash=False, compare=False, default=None)


@dataclasses.dataclass
class StorageMeta:
    """torch's ``StorageMeta``: the save's ``checkpoint_id``, ``save_id``, ``load_id`` and ``modules``."""

    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Metadata:
    """torch's ``Metadata``: the whole ``.metadata``."""

    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclasses.dataclass
class StorageInfo:
    """torch's private ``filesystem._StorageInfo``: a payload's data file and byte range."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


StorageInfo.__name__ = StorageInfo.__qualname__ = "_StorageInfo"


class WriteItemType(enum.Enum):
    """torch's ``planner.WriteItemType``."""

    TENSOR = 1
    SHARD = 2
    BYTE_IO = 3


class MEM_FORMAT_ENCODING(enum.Enum):  # noqa: N801  (torch's name)
    """torch's ``metadata._MEM_FORMAT_ENCODING``: how ``TensorProperties`` pickles its memory format."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


MEM_FORMAT_ENCODING.__name__ = MEM_FORMAT_ENCODING.__qualname__ = "_MEM_FORMAT_ENCODING"


@dataclasses.dataclass(frozen=True)
class TensorWriteData:
    """torch's ``planner.TensorWriteData``."""

    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: Any


@dataclasses.dataclass(frozen=True)
class BytesIOWriteData:
    """torch's ``planner.BytesIOWriteData``."""

    nbytes: int


@dataclasses.dataclass(frozen=True)
class WriteItem:
    """torch's ``planner.WriteItem``."""

    index: MetadataIndex
    type: WriteItemType
    bytes_io_data: BytesIOWriteData | None = None
    tensor_data: TensorWriteData | None = None


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """torch's ``planner.SavePlan``."""

    items: list[WriteItem]
    storage_data: Any = None
    planner_data: Any = None
    usable: bool = True


@dataclasses.dataclass
class MCoreMetadata(Metadata):
    """Megatron-Core 0.15's ``Metadata``: torch's fields plus ``mcore_data``.

    ``mcore_data`` maps an FQN to ``{"nd_reformulated_orig_global_shape": shape}`` (or ``{}``).
    """

    mcore_data: dict[str, dict[str, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class MCoreSavePlan(SavePlan):
    """Megatron-Core 0.15's ``SavePlan``: torch's fields plus ``mcore_data`` (as ``MCoreMetadata``'s)."""

    mcore_data: dict[str, dict[str, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class StoragePrefix:
    """torch's private ``filesystem._StoragePrefix``: a plan's data file prefix (``"__0_"``), not imported."""

    prefix: str


_DCP = "torch.distributed.checkpoint"
# torch's module of each record of its own: ``as_torch`` finds its class there
TORCH_TWINS: dict[type, str] = {
    **dict.fromkeys(
        (
            Metadata,
            TensorStorageMetadata,
            BytesStorageMetadata,
            ChunkStorageMetadata,
            TensorProperties,
            MetadataIndex,
            StorageMeta,
        ),
        f"{_DCP}.metadata",
    ),
    **dict.fromkeys((SavePlan, WriteItem, TensorWriteData, BytesIOWriteData), f"{_DCP}.planner"),
    StorageInfo: f"{_DCP}.filesystem",
}

_ENUMS: dict[type, tuple[str, str]] = {
    MEM_FORMAT_ENCODING: ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    WriteItemType: ("torch.distributed.checkpoint.planner", "WriteItemType"),
}


def as_torch(obj: Any) -> Any:
    """``obj`` (records as ``_metadata_unpickler`` made them) with each record of torch's as torch's own class.

    Records only other writers pickle (``MCoreMetadata``, ``StoragePrefix``) stay as they are,
    their fields converted. Objects the file shares stay shared. Made from records the
    unpickler built and checked: no record's code runs (``object.__new__``, then its ``__dict__``).

    Raises:
        RecursionError: containers nested deeper than Python's recursion limit.
    """
    return _Converter().convert(obj)


def _torch() -> Any:
    import torch

    return torch


class _Converter:
    def __init__(self) -> None:
        self.done: dict[int, Any] = {}
        self.classes: dict[type, type] = {}

    def convert(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in (str, int, float, bool, bytes, type(None)):
            return obj
        found = self.done.get(id(obj))
        if found is not None:
            return found
        if kind is list:
            made: Any = []
            self.done[id(obj)] = made
            made.extend(self.convert(v) for v in obj)
        elif kind is dict:
            made = {}
            self.done[id(obj)] = made
            for k, v in obj.items():
                made[self.convert(k)] = self.convert(v)
        elif kind is tuple:
            made = tuple(self.convert(v) for v in obj)
        elif kind is Size:
            made = _torch().Size(obj)
        elif kind in (TorchDtype, TorchLayout, TorchMemoryFormat):
            made = getattr(_torch(), obj)  # a name from a fixed table (_dcp_classes), never one from the file
        elif isinstance(obj, enum.Enum) and kind in _ENUMS:
            module, name = _ENUMS[kind]
            made = getattr(importlib.import_module(module), name)(obj.value)
        elif hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
            made = object.__new__(self._torch_class(kind))
            self.done[id(obj)] = made
            object.__setattr__(made, "__dict__", {k: self.convert(v) for k, v in vars(obj).items()})
            return made
        else:
            return obj  # pure paths, sets: already what torch makes
        self.done[id(obj)] = made
        return made

    def _torch_class(self, kind: type) -> type:
        module = TORCH_TWINS.get(kind)
        if module is None:
            return kind
        cls = self.classes.get(kind)
        if cls is None:
            cls = getattr(sys.modules.get(module) or importlib.import_module(module), kind.__name__)
            self.classes[kind] = cls
        return cls
