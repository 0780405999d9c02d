"""Per-rank torch.save files, loading: a restricted unpickler that makes distributed classes inert records.

A per-rank file is a torch.save zip (``torch/serialization.py``) whose ``data.pkl`` names DTensor
(``torch/distributed/tensor``), DeviceMesh, ShardedTensor (``torch/distributed/_shard``) and their
placements and metadata. torch's own ``weights_only`` loader would call the real classes:
``DeviceMesh(...)`` can start a process group, and ``ShardedTensor`` needs one. Here they become
``Record`` stand-ins (``_records``) holding their pickled state; tensor storages are memory-mapped from the file
(no data is read until a chunk is); nothing else resolves, so nothing in the file runs. The pickle
is read by ``_safe_pickle``'s interpreter: only records this load made get a state, and no opcode
changes a class, a function or anything else it did not create.
"""

from __future__ import annotations

import mmap
import os
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from fsdp_convert.errors import CorruptChunkError, UnsafeContentError
from fsdp_convert.formats._records import _RECORDS as _RECORDS
from fsdp_convert.formats._records import SHARDED_TENSOR, BuildsRecords, Record, kind, local_value, record_classes
from fsdp_convert.formats._safe_pickle import MalformedError, RefusedError, SafeUnpickler, described, shown
from fsdp_convert.formats._torch_globals import TORCH_DTYPES, VETTED_CALLS, torch_size
from fsdp_convert.signals import torch_call
from fsdp_convert.torch_compat import REBUILD_TENSOR_V2
from fsdp_convert.zip_records import ZipFormatError, read_records

__all__ = ["Record", "SHARDED_TENSOR", "kind", "load_rank_file", "local_value", "record_classes"]


class _Wrapper(Record):
    """``torch._utils._rebuild_wrapper_subclass``'s result: the subclass, its dtype and global shape."""

    qualname = "wrapper subclass"


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, *rest: Any) -> _Wrapper:
    if _RECORD_BY_ID.get(id(cls)) is not cls or not isinstance(dtype, torch.dtype):
        raise RefusedError(f"wrapper subclass {described(cls)} is not allowed")
    return _Wrapper(cls, dtype, tuple(torch_size(size)))


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, *meta: Any) -> Any:
    """``torch._utils._rebuild_tensor_v2`` of a storage ``persistent_load`` made, without backward hooks."""
    if type(storage) is not torch.storage.TypedStorage or type(offset) is not int or type(requires_grad) is not bool:
        raise MalformedError("a tensor of something other than a storage of this file")
    flags = meta[0] if meta else None  # torch's tensor flags: {"conj": True}
    if hooks or len(meta) > 1 or not (flags is None or (type(flags) is dict and all(type(v) is bool for v in flags.values()))):
        raise RefusedError("a tensor with backward hooks or Python metadata is not allowed")
    return REBUILD_TENSOR_V2(storage, offset, torch_size(size), torch_size(stride), requires_grad, OrderedDict(), flags)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if func is _rebuild_wrapper_subclass and type(args) is tuple:
        wrapper = func(*args)
        if new_type is not wrapper.args[0]:
            raise MalformedError("wrapper subclass and type disagree")
        obj = new_type()
        obj.wrapper = wrapper
        obj.__setstate__(state)
        return obj
    if func is _rebuild_tensor and (new_type is torch.Tensor or new_type is torch.nn.Parameter) and type(args) is tuple:
        if not _scalar_attributes(state):
            raise RefusedError("a tensor with Python attributes other than numbers and strings is not allowed")
        return func(*args)  # scalar attributes (DeepSpeed's ``ds_id``) are dropped: the tensor is what is read
    raise RefusedError(f"rebuilding {described(new_type)} is not allowed")


def _scalar_attributes(state: Any) -> bool:
    """Whether a tensor's pickled ``__dict__`` state is empty or holds only numbers, strings, bools and None."""
    if isinstance(state, tuple):
        return all(_scalar_attributes(part) for part in state)
    if state is None:
        return True
    return type(state) is dict and all(type(v) in (int, float, str, bool, type(None)) for v in state.values())


def _restricted_getattr(obj: Any, name: Any) -> Any:
    # ShardedTensor.__reduce_ex__ names its nested dataclass as getattr(ShardedTensor, "ProcessGroupState")
    if obj is SHARDED_TENSOR and name == "ProcessGroupState":
        return _RECORDS["torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState"]
    raise RefusedError(f"getattr({described(obj)}, {shown(name)}) is not allowed")


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise MalformedError("a parameter without tensor data")
    return data


def _device(*args: Any) -> torch.device:
    if not args or type(args[0]) is not str or not all(type(a) is int for a in args[1:]):
        raise MalformedError("a device named by something other than a string")
    return torch.device(*args)


_FUNCTIONS: dict[str, Any] = {
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_wrapper_subclass": _rebuild_wrapper_subclass,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch.device": _device,
    "builtins.getattr": _restricted_getattr,
    "__builtin__.getattr": _restricted_getattr,
    **{f"{module}.{name}": f for (module, name), f in VETTED_CALLS.items()},
}
# by id: a lookup must not hash what the pickle put on the stack (a deep tuple would crash it)
_FUNCTION_BY_ID = {id(f): f for f in _FUNCTIONS.values()}
_RECORD_BY_ID: dict[int, type[Record]] = {id(cls): cls for cls in _RECORDS.values()}  # the wrapper subclasses' own
_TENSOR_TYPES = {"torch.Tensor": torch.Tensor, "torch.nn.parameter.Parameter": torch.nn.Parameter}
_STORAGE_TYPES = frozenset(name for name, v in vars(torch).items() if name.endswith("Storage") and isinstance(v, type))


class _RankFileUnpickler(BuildsRecords, SafeUnpickler):
    """Reads a rank file's ``data.pkl`` with an allow-list.

    Plain tensors (storages memory-mapped from the file), dtypes, and ``Record`` stand-ins for
    the distributed classes resolve; nothing else does, so nothing in the file runs, and only
    records this load made get a state.
    """

    def __init__(
        self, data: bytes, storages: dict[str, tuple[int, int]], buffer: mmap.mmap, classes: dict[str, type[Record]]
    ) -> None:
        super().__init__(data)
        self._storages = storages  # key -> (data offset, size) in the file, in bytes
        self._buffer = buffer
        self._classes = {**_RECORDS, **classes}
        self._record_by_id = {id(cls): cls for cls in self._classes.values()}
        self.file_offsets: dict[int, int] = {}  # a storage's data_ptr -> its first byte's offset in the file

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in _FUNCTIONS:
            return _FUNCTIONS[full]
        if full in self._classes:
            return self._classes[full]
        if full in _TENSOR_TYPES:  # only as ``_rebuild_from_type_v2``'s type: never called nor built
            return _TENSOR_TYPES[full]
        if module == "torch" and name in TORCH_DTYPES:
            return TORCH_DTYPES[name]
        if module == "torch" and name in _STORAGE_TYPES:
            return torch.serialization.StorageType(name)  # type: ignore[no-untyped-call]
        raise RefusedError(f"global {shown(full)} is not allowed")

    def call(self, func: Any, args: tuple[Any, ...]) -> Any:
        vetted = _FUNCTION_BY_ID.get(id(func)) or self._record_by_id.get(id(func))
        if vetted is None or vetted is not func:
            raise RefusedError(f"calling {described(func)} is not allowed")
        return vetted(*args)

    def new(self, cls: Any, args: tuple[Any, ...]) -> Any:
        record = self._record_by_id.get(id(cls))
        if record is None or record is not cls:
            raise RefusedError(f"creating an instance of {described(cls)} is not allowed")
        return record.made_by_newobj(args)

    def persistent_load(self, pid: Any) -> Any:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
            raise MalformedError("an unexpected persistent id")
        storage_type, key, _location, numel = pid[1:]
        dtype = storage_type.dtype if isinstance(storage_type, torch.serialization.StorageType) else torch.uint8
        if type(key) is not str or key not in self._storages or type(numel) is not int or numel < 0:
            raise MalformedError(f"storage {shown(key)} is not in the file")
        offset, size = self._storages[key]
        nbytes = numel * dtype.itemsize
        if nbytes > size:
            raise MalformedError(f"storage {shown(key)} does not fit in its record of the file")
        if nbytes:
            data = torch.frombuffer(self._buffer, dtype=torch.uint8, count=nbytes, offset=offset)
            self.file_offsets[data.data_ptr()] = offset
        else:
            data = torch.empty(0, dtype=torch.uint8)
        return torch.storage.TypedStorage(wrap_storage=data.untyped_storage(), dtype=dtype, _internal=True)  # type: ignore[no-untyped-call]


def load_rank_file(path: Path, classes: dict[str, type[Record]] | None = None) -> Any:
    """Load a per-rank torch.save file (the zip format of ``torch/serialization.py``) without running it.

    ``load_with_offsets`` also says where each tensor's bytes lie in the file.

    ``data.pkl`` is read by ``_RankFileUnpickler``: tensors are memory-mapped from the file's
    storage records (nothing is read until used); DTensor, DeviceMesh, ShardedTensor and their
    placements and metadata become ``Record`` stand-ins, so no process group or mesh is made.

    Raises:
        UnsafeContentError: the pickle names anything else (it could run code).
        CorruptChunkError: not a torch.save zip, or a storage it names is missing or short.
    """
    return load_with_offsets(path, classes)[0]


def load_with_offsets(path: Path, classes: dict[str, type[Record]] | None = None) -> tuple[Any, dict[int, int]]:
    """``load_rank_file`` of ``path``, and where its storages lie: ``{storage data_ptr: byte offset in the file}``.

    Args:
        path: a torch.save file (``FdPath`` of an open descriptor, or a path).
        classes: more classes to read as inert ``Record`` stand-ins (``record_classes``), by
            ``module.Qualname``: a format's own classes (DeepSpeed's loss scaler).

    A tensor's elements start at byte ``offsets[t.untyped_storage().data_ptr()] + t.storage_offset() * t.itemsize``
    of the file (memory-mapped: the data pointers stay valid while the loaded object lives).

    Raises:
        As ``load_rank_file``.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ZipFormatError("empty file")
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        records = read_records(lambda length, offset: buffer[offset : offset + length], size)
    except (OSError, ZipFormatError) as e:
        raise CorruptChunkError(f"{path}: not a torch.save file ({e})") from e
    pickles = [r for r in records if r.name.endswith("/data.pkl") and r.name.count("/") == 1]
    if len(pickles) != 1 or any(r.compression != 0 for r in records):
        raise CorruptChunkError(f"{path}: not a torch.save file (no single stored data.pkl)")
    prefix = pickles[0].name[: -len("data.pkl")] + "data/"
    storages = {r.name[len(prefix) :]: (r.data_offset, r.size) for r in records if r.name.startswith(prefix)}
    data = buffer[pickles[0].data_offset : pickles[0].data_offset + pickles[0].size]
    unpickler = _RankFileUnpickler(data, storages, buffer, classes or {})
    try:
        with torch_call():
            obj = unpickler.load()
    except RefusedError as e:
        raise UnsafeContentError(f"{path}: would run code when loaded, refused ({e})") from e
    except pickle.UnpicklingError as e:
        raise CorruptChunkError(f"{path}: does not load ({e})") from e
    if unpickler.end != len(data):
        raise CorruptChunkError(f"{path}: data.pkl has data after the end of its pickle (at byte {unpickler.end})")
    return obj, unpickler.file_offsets
