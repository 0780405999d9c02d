"""Index stage, DCP: the classes a ``.metadata`` may name, by writer, as inert records with checked fields.

torch's ``FileSystemWriter`` pickles torch's metadata records. Other writers pickle their own, or
more of torch's, and ``_dcp_metadata``'s unpickler admits those by module and qualified name,
never importing their packages:

- OLMo-core 3.0 (``RemoteFileSystemWriter``): its own ``_StorageInfo`` with torch's first three
  fields (``relative_path``, ``offset``, ``length``), read as torch's ``_StorageInfo``.
- Megatron-Core 0.16: every rank's ``SavePlan`` on ``Metadata.all_local_plans`` (torch's
  ``SavePlan``, ``WriteItem``, ``WriteItemType``, ``TensorWriteData``, ``BytesIOWriteData``); 0.15
  wrote ``MCoreMetadata`` and ``MCoreSavePlan``: torch's classes plus ``mcore_data``. Plans are read
  and ignored; nothing in them reaches the index.

A record is made without ``__init__`` and gets its state only through ``record_state``, which
checks it. Any other class is refused with ``unknown_global``, which names the writer that it
probably comes from.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Callable
from typing import Any

from fsdp_convert.formats._dcp_classes import (
    MEM_FORMAT_ENCODING,
    TORCH_TWINS,
    BytesIOWriteData,
    ChunkStorageMetadata,
    MCoreMetadata,
    MCoreSavePlan,
    Metadata,
    MetadataIndex,
    SavePlan,
    Size,
    StorageInfo,
    StoragePrefix,
    TensorProperties,
    TensorWriteData,
    TorchDtype,
    TorchLayout,
    TorchMemoryFormat,
    WriteItem,
    WriteItemType,
    torch_layout,
    torch_size,
)
from fsdp_convert.formats._safe_pickle import MalformedError, shown
from fsdp_convert.formats._torch_globals import VETTED_CALLS

__all__ = [
    "RECORDS",
    "RECORD_BY_ID",
    "CALLS",
    "CALL_BY_ID",
    "WRITERS",
    "record_state",
    "unknown_global",
]

_DCP = "torch.distributed.checkpoint"
_MCORE = "megatron.core.dist_checkpointing.strategies.torch"

# torch's records and scalars as inert classes: ``_dcp_classes``
RECORDS: dict[tuple[str, str], type] = {
    **{(module, cls.__name__): cls for cls, module in TORCH_TWINS.items()},
    (f"{_DCP}.filesystem", "_StoragePrefix"): StoragePrefix,
    ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    (_MCORE, "MCoreMetadata"): MCoreMetadata,
    (_MCORE, "MCoreSavePlan"): MCoreSavePlan,
}
# by id: a lookup must not hash what the pickle put on the stack (a deep tuple would crash it)
RECORD_BY_ID = {id(cls): cls for cls in RECORDS.values()}
_FIELDS = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in RECORDS.values()}

# --- the top-level package of a class -> the writer it comes from, for a refusal ----------------------

WRITERS: dict[str, str] = {
    "torch": "PyTorch",
    "olmo_core": "OLMo-core",
    "megatron": "Megatron-Core",
    "nemo": "NeMo",
    "nemo_automodel": "NeMo AutoModel",
    "torchtune": "torchtune",
    "torchtitan": "torchtitan",
    "torchao": "torchao",
    "lightning": "Lightning",
    "pytorch_lightning": "Lightning",
    "lightning_fabric": "Lightning",
    "accelerate": "Accelerate",
    "transformers": "Transformers",
    "deepspeed": "DeepSpeed",
    "verl": "verl",
}


def unknown_global(module: str, name: str) -> str:
    """A refusal of global ``module.name``, naming the writer it probably comes from, on one line."""
    top = module.partition(".")[0]
    what = f"refusing global {shown(module)}.{shown(name)}"
    if top in WRITERS:
        return f"{what}, a class of {WRITERS[top]}'s that fsdp-convert does not know yet"
    if top in sys.stdlib_module_names:
        return f"{what} of Python's standard library, which a DCP writer does not pickle"
    return f"{what}, from package {shown(top)}, which fsdp-convert does not know yet"


# --- field checks ------------------------------------------------------------------------------------

Check = Callable[[Any], bool]
_FLAT = (str, int, float, bool, type(None))
_SEQUENCES = (tuple, list, Size)


def _one_of(*types: type) -> Check:
    return lambda value: type(value) in types  # exact types: a subclass is no record


def _list_of(*types: type) -> Check:
    return lambda value: type(value) is list and all(type(v) in types for v in value)


def _key_paths(value: Any) -> bool:
    """A plan's ``planner_data``: None or ``flatten_state_dict``'s ``{fqn: (key, ...)}``."""
    return value is None or (
        type(value) is dict
        and all(type(k) is str for k in value)
        and all(type(p) in _SEQUENCES and all(type(k) is str or type(k) is int for k in p) for p in value.values())
    )


def _mcore_data(value: Any) -> bool:
    """None or ``{fqn: {name: a flat value or a shape}}``."""
    return value is None or (
        type(value) is dict
        and all(type(k) is str for k in value)
        and all(
            type(per_fqn) is dict
            and all(type(n) is str for n in per_fqn)
            and all(type(v) in _FLAT or (type(v) in _SEQUENCES and all(type(d) is int for d in v)) for v in per_fqn.values())
            for per_fqn in value.values()
        )
    )


_PLANS = _list_of(SavePlan, MCoreSavePlan)
_SAVE_PLAN: dict[str, Check] = {
    "items": _list_of(WriteItem),
    "storage_data": _one_of(type(None), StoragePrefix),
    "planner_data": _key_paths,
    "usable": _one_of(bool),
}
_CHECKED: dict[type, dict[str, Check]] = {  # records whose fields are all checked; no other field is kept
    SavePlan: _SAVE_PLAN,
    MCoreSavePlan: {**_SAVE_PLAN, "mcore_data": _mcore_data},
    WriteItem: {
        "index": _one_of(MetadataIndex),
        "type": _one_of(WriteItemType),
        "bytes_io_data": _one_of(type(None), BytesIOWriteData),
        "tensor_data": _one_of(type(None), TensorWriteData),
    },
    TensorWriteData: {
        "chunk": _one_of(ChunkStorageMetadata),
        "properties": _one_of(TensorProperties),
        "size": _one_of(Size),
    },
    BytesIOWriteData: {"nbytes": _one_of(int)},
    StoragePrefix: {"prefix": _one_of(str)},
}
_KNOWN_EXTRAS: dict[type, dict[str, Check]] = {  # fields writers add to torch's records, checked when present
    Metadata: {"all_local_plans": _PLANS},  # Megatron-Core's
    MCoreMetadata: {"all_local_plans": _PLANS, "mcore_data": _mcore_data},
}
# records no check looks into: a state of only their fields needs no check (millions in a large .metadata)
_UNCHECKED_FIELDS = {cls: fields for cls, fields in _FIELDS.items() if cls not in _CHECKED and cls not in _KNOWN_EXTRAS}


def record_state(cls: type, state: Any) -> dict[str, Any]:
    """The ``__dict__`` that BUILD gives a fresh ``cls`` record: ``state``, checked.

    Records in ``_CHECKED`` keep only their fields, each of its type. torch's metadata records
    keep their fields and other plain names, as the C unpickler would (a newer torch may add a
    field), never a dunder; fields other writers add to them are checked when present. A state of
    a record no check looks into that holds only its fields (millions in a large ``.metadata``) is
    returned as it is, not copied.

    Raises:
        MalformedError: ``state`` is not such a dict, or a checked field has a value of another type.
    """
    fields = _UNCHECKED_FIELDS.get(cls)
    if fields is not None and type(state) is dict and fields.issuperset(state):
        return state  # (hashing its keys again is safe: they were hashed when the dict was built)
    if cls is TensorProperties and type(state) is tuple:
        return _tensor_properties(state)
    if type(state) is not dict or not all(type(k) is str for k in state):
        raise MalformedError(f"state of a {cls.__name__} is not a dict of its fields")
    checked = _CHECKED.get(cls)
    checks = checked if checked is not None else _KNOWN_EXTRAS.get(cls, {})
    for key, value in state.items():
        if key in checks:
            if not checks[key](value):
                raise MalformedError(f"{cls.__name__}.{shown(key)} is a {type(value).__name__}, not what its writer puts there")
        elif checked is not None or not (key in _FIELDS[cls] or (key.isidentifier() and not key.startswith("__"))):
            raise MalformedError(f"state of a {cls.__name__} has a field {shown(key)} that it does not have")
    return dict(state)


# --- calls -------------------------------------------------------------------------------------------

_MEMORY_FORMATS = {  # TensorProperties.__setstate__'s table: _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST -> torch.channels_last
    getattr(MEM_FORMAT_ENCODING, f"TORCH_{name.upper()}"): TorchMemoryFormat(name)
    for name in ("contiguous_format", "channels_last", "preserve_format")
}


def _enum_member(enum: Any, qualname: str) -> Callable[[Any], Any]:
    """An Enum's pickle, ``Enum(value)``, for an int ``value`` only."""

    def member(value: Any) -> Any:
        if type(value) is not int:
            raise MalformedError(f"a {qualname} value is not an int")
        return enum(value)  # an Enum lookup; ValueError if out of range

    member.__qualname__ = qualname
    return member


def _path(kind: type[pathlib.PurePath]) -> Callable[..., pathlib.PurePath]:
    def make(*parts: Any) -> pathlib.PurePath:
        if not all(type(p) is str for p in parts):
            raise MalformedError("path parts are not strings")
        return kind(*parts)  # a pure path: nothing reads it; StorageMeta.checkpoint_id only names the save

    make.__qualname__ = kind.__name__
    return make


CALLS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch", "Size"): torch_size,
    ("torch.serialization", "_get_layout"): torch_layout,  # a layout pickles as _get_layout("torch.strided")
    ("collections", "OrderedDict"): VETTED_CALLS[("collections", "OrderedDict")],  # torch-free
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"): _enum_member(MEM_FORMAT_ENCODING, "_MEM_FORMAT_ENCODING"),
    (f"{_DCP}.planner", "WriteItemType"): _enum_member(WriteItemType, "WriteItemType"),
    ("pathlib", "PurePosixPath"): _path(pathlib.PurePosixPath),
    ("pathlib", "PosixPath"): _path(pathlib.PurePosixPath),
    ("pathlib", "Path"): _path(pathlib.PurePosixPath),
    ("pathlib", "PureWindowsPath"): _path(pathlib.PureWindowsPath),
    ("pathlib", "WindowsPath"): _path(pathlib.PureWindowsPath),
}
CALL_BY_ID = {id(f): f for f in CALLS.values()}


def _tensor_properties(state: tuple[Any, ...]) -> dict[str, Any]:
    """``TensorProperties.__setstate__`` with its types checked: (dtype, layout, requires_grad, encoding, pin_memory)."""
    if len(state) != 5:
        raise MalformedError("TensorProperties state is not 5 values")
    dtype, layout, requires_grad, encoding, pin_memory = state
    if (
        type(dtype) is not TorchDtype
        or type(layout) is not TorchLayout
        or type(requires_grad) is not bool
        or type(pin_memory) is not bool
        or type(encoding) is not MEM_FORMAT_ENCODING
    ):
        raise MalformedError("TensorProperties state has values of the wrong types")
    fields = {"dtype": dtype, "layout": layout, "requires_grad": requires_grad, "pin_memory": pin_memory}
    return {**fields, "memory_format": _MEMORY_FORMATS[encoding]}
