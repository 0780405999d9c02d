"""Index stage, DeepSpeed: a ZeRO save's torch.save file read as records of where its tensors lie, without torch.

DeepSpeed's files (``deepspeed_files``) are torch.save zips whose pickles name, besides a plain
tensor's globals (``_pt_records``): ``torch.Size(dims)`` (``param_shapes``), a tensor with
attributes (``ds_id``...) as ``torch._tensor._rebuild_from_type_v2(_rebuild_tensor_v2, Tensor,
args, state)``, and DeepSpeed's own classes (``LossScaler``, ``ZeroStageEnum``,
``fragment_address``), made by REDUCE or NEWOBJ and BUILD. ``load_ds_records`` reads exactly
these with ``_pt_records.load_records``: tensors become ``StoredTensor`` records, a size a
``Size`` (a tuple), a DeepSpeed class the same inert ``_records.Record`` torch's loader path
(``_rank_unpickler``) makes. Anything else, or anything those would read otherwise (an attribute
that is not a number or string, a size not of 64-bit dims), gives None: the caller then takes
that loader, which reads the file or refuses it naming the fault, so this path never reads a
file that one refuses.
"""

from __future__ import annotations

from typing import Any

from fsdp_convert.formats._payload_pickle import _REBUILD_V2
from fsdp_convert.formats._pt_records import StoredTensor, _FileUnpickler, load_records
from fsdp_convert.formats._records import BuildsRecords, Record
from fsdp_convert.formats._safe_pickle import RefusedError
from fsdp_convert.zip_records import ZipRecord

__all__ = ["Size", "holds_records", "load_ds_records"]

_SCALARS = (int, float, str, bool, type(None))
_MAX_DIM = 1 << 63  # torch.Size holds 64-bit ints


class Size(tuple[int, ...]):
    """``torch.Size(dims)`` as read without torch: its dims, told apart from a plain tuple (a shape, not a value)."""

    __slots__ = ()


class _Name:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


_SIZE, _FROM_TYPE, _TENSOR_TYPE = _Name("torch.Size"), _Name("_rebuild_from_type_v2"), _Name("torch.Tensor")
_GLOBALS = {
    "torch.Size": _SIZE,
    "torch._tensor._rebuild_from_type_v2": _FROM_TYPE,
    "torch.Tensor": _TENSOR_TYPE,  # only as _rebuild_from_type_v2's type: never called nor built
    "torch.nn.parameter.Parameter": _TENSOR_TYPE,
}


def _scalar_state(state: Any) -> bool:
    """A tensor's pickled ``__dict__`` state: None or a dict of numbers, strings, bools and None; or two of those."""
    parts = state if type(state) is tuple and len(state) == 2 else (state,)
    return all(p is None or (type(p) is dict and all(type(v) in _SCALARS for v in p.values())) for p in parts)


class _DeepSpeedUnpickler(BuildsRecords, _FileUnpickler):
    """``_pt_records``' allow-list, with ``torch.Size``, a tensor's scalar attributes and DeepSpeed's classes as records.

    Refuses (``RefusedError``: the caller takes torch's loader) every other global, a call of a
    record instance, BUILD on a class, and anything ``_rank_unpickler`` would read otherwise.
    """

    def __init__(self, data: bytes, storages: dict[str, ZipRecord], classes: dict[str, type[Record]]) -> None:
        super().__init__(data, storages)
        self._classes = classes
        self._record_by_id = {id(cls): cls for cls in classes.values()}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        found = self._classes.get(full) or _GLOBALS.get(full)
        return found if found is not None else super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        # torch's loader path maps every storage from the file whatever device it names (a GPU run's "cuda:0")
        if type(pid) is tuple and len(pid) == 5 and type(pid[3]) is str:
            pid = (*pid[:3], "cpu", pid[4])
        return super().persistent_load(pid)

    def _record(self, cls: Any) -> type[Record] | None:
        record = self._record_by_id.get(id(cls))
        return record if record is cls else None

    def call(self, func: Any, args: tuple[Any, ...]) -> Any:
        record = self._record(func)
        if record is not None:
            return record(*args)
        if func is _SIZE:
            if len(args) != 1 or type(args[0]) not in (tuple, list):
                raise RefusedError("a torch.Size of something other than a sequence")
            if not all(type(d) is int and 0 <= d < _MAX_DIM for d in args[0]):
                raise RefusedError("a torch.Size of dims that are not 64-bit counts")
            return Size(args[0])
        if func is _FROM_TYPE:
            if len(args) != 4 or args[0] is not _REBUILD_V2 or args[1] is not _TENSOR_TYPE or type(args[2]) is not tuple:
                raise RefusedError("rebuilding something other than a tensor")
            if not _scalar_state(args[3]):
                raise RefusedError("a tensor with Python attributes other than numbers and strings")
            tensor = self.call(args[0], args[2])  # the attributes (DeepSpeed's ``ds_id``) are dropped, as torch's path does
            if type(tensor) is not StoredTensor:
                raise RefusedError("not a tensor")
            return tensor
        return super().call(func, args)

    def new(self, cls: Any, args: tuple[Any, ...]) -> Any:
        record = self._record(cls)
        if record is None:
            return super().new(cls, args)
        return record.made_by_newobj(args)


def load_ds_records(fd: int, size: int, classes: dict[str, type[Record]]) -> Any | None:
    """The object a DeepSpeed torch.save file holds, tensors as ``StoredTensor``, sizes as ``Size``; None for anything else.

    Reads the zip's directory and ``data.pkl``, never a storage; never raises for what the file
    holds (None: the caller takes ``_rank_unpickler.load_with_offsets``).

    Args:
        fd: an open descriptor of the file (read with ``os.pread``; kept open).
        size: the file's length, in bytes.
        classes: the DeepSpeed classes read as records, by ``module.Qualname`` (``_records.record_classes``).

    Raises:
        OSError: the file cannot be read.
    """
    return load_records(fd, size, lambda data, storages: _DeepSpeedUnpickler(data, storages, classes))


def holds_records(value: Any) -> bool:
    """Whether ``value`` holds a ``StoredTensor`` or a ``Size`` anywhere (in containers and records' arguments and state).

    Such a value is read with torch's loader path where it is used as a value: there it is a
    tensor or a ``torch.Size``. Each object is looked into once (no recursion: any depth).
    """
    seen: set[int] = set()
    todo = [value]
    while todo:
        obj = todo.pop()
        if type(obj) is StoredTensor or type(obj) is Size:
            return True
        if id(obj) in seen or type(obj) in _SCALARS or type(obj) is bytes:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif isinstance(obj, Record):
            todo.extend((obj.args, obj.state))
    return False
