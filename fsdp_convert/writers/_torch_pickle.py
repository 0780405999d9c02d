"""torch.save's ``data.pkl`` pickled without importing torch: tensors as references to their storage records.

torch.save pickles a tensor (``Tensor.__reduce_ex__``, protocol 2) as a call of
``torch._utils._rebuild_tensor_v2(storage, offset, shape, stride, requires_grad, hooks)``, its storage
as the persistent id ``("storage", torch.<Legacy>Storage, key, "cpu", numel)``. Dtypes without a
legacy storage class (float8, float4, uint16/32/64, complex32, ...) go through
``torch.storage.UntypedStorage`` (its size in bytes) and ``_rebuild_tensor_v3``, which takes the
dtype last, pickled as the global ``torch.<name>`` (``dtype.__reduce__`` returns its name). Here
those torch names are stand-ins that pickle as ``GLOBAL`` opcodes by name, through the pure-Python
``pickle._Pickler``, so the bytes are the ones ``pickle.Pickler`` writes with the real objects:
same opcodes, same memo (each stand-in is one object per name, as each torch class is).

``PurePickler`` is ``pickle._Pickler`` writing what the C pickler (``pickle.Pickler``, the one
torch.save and ``pickle.dump`` use) writes: the two differ in how they batch an exact ``dict``'s
items, ``list``'s elements and ``set``'s members (``_pickle.c`` ``batch_dict_exact``,
``batch_list_exact``, ``save_set``: a list's last lone element still in ``MARK ... APPENDS``, a
dict or set of a multiple of 1,000 closed by an empty ``MARK SETITEMS`` / ``MARK ADDITEMS``), so
``dumps`` of a dict of 1,000 keys is torch.save's too. ``Global`` stand-ins pickle at any protocol
(``STACK_GLOBAL`` from protocol 4, their module and name strings memoized as the C pickler memoizes
the ones it is given).
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import sys
from typing import Any, Protocol

__all__ = ["DtypeLike", "PICKLE_PROTOCOL", "STORAGE_CLASS_NAMES", "dtype_name", "storage_class_name"]
__all__ += ["StorageRef", "TensorRef", "dumps", "dumps_with_storages", "Global", "PurePickler", "Reduced"]

PICKLE_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL


class DtypeLike(Protocol):
    """A dtype as this module needs it: ``str(dtype) == "torch.<name>"`` and its element size (a ``torch.dtype`` is one)."""

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        ...


# torch.storage._dtype_to_storage_type_map() in torch 2.13, by dtype name; every other dtype has
# no legacy storage class (tests/unit/test_torch_zip.py checks this against torch for every dtype)
STORAGE_CLASS_NAMES: dict[str, str] = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "complex128": "ComplexDoubleStorage",
    "complex64": "ComplexFloatStorage",
    "qint8": "QInt8Storage",
    "qint32": "QInt32Storage",
    "quint8": "QUInt8Storage",
    "quint4x2": "QUInt4x2Storage",
    "quint2x4": "QUInt2x4Storage",
}


def dtype_name(dtype: DtypeLike) -> str:
    """``"float32"`` for ``torch.float32`` (or any dtype whose ``str`` is ``"torch.float32"``).

    Raises:
        ValueError: ``str(dtype)`` does not start with ``torch.``.
    """
    text = str(dtype)
    if not text.startswith("torch."):
        raise ValueError(f"not a torch dtype: {text!r}")
    return text.removeprefix("torch.")


def storage_class_name(dtype: DtypeLike) -> str | None:
    """The legacy storage class torch.save pickles for ``dtype`` (``"FloatStorage"``); None where it has none.

    Raises:
        ValueError: ``dtype`` is not a torch dtype.
    """
    return STORAGE_CLASS_NAMES.get(dtype_name(dtype))


class Global:
    """Stands for the module-level object ``module.name``: pickles as ``GLOBAL module name``, never called.

    From protocol 4 it pickles as the strings ``module`` and ``name`` then ``STACK_GLOBAL``; each
    string is memoized by identity, so where torch's objects share one module-name string (the
    classes of one module) the stand-ins must share one ``str`` object too, and where they do not
    (``torch.Size`` and the dtypes each have their own ``"torch"``), distinct ones.
    """

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # save_reduce needs a callable; unpicklers call the real one
        raise TypeError(f"{self.module}.{self.name} is a stand-in")


@functools.cache
def _global(module: str, name: str) -> Global:
    """One stand-in per name, so the pickle's memo refers back to it as it would to the torch object."""
    return Global(module, name)


class Reduced:
    """Stands for an instance of the class ``module.name``, made by the unpickler from ``args`` and ``state``.

    Pickles as ``GLOBAL module name``, the ``args`` tuple, ``NEWOBJ`` (``cls.__new__(cls, *args)``,
    as protocol 2 pickles a plain object) or ``REDUCE`` (``cls(*args)``, as an ``Enum`` member
    pickles), then ``state`` and ``BUILD`` unless it is None: a class of another package (DeepSpeed's
    loss scaler) written without importing it.
    """

    __slots__ = ("cls", "args", "state", "newobj")

    def __init__(self, module: str, name: str, args: tuple[Any, ...], state: Any, *, newobj: bool) -> None:
        self.cls, self.args, self.state, self.newobj = _global(module, name), args, state, newobj


class StorageRef:
    """Stands for the storage of record ``data/<key>``: ``numel`` elements of ``dtype``."""

    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key: str, dtype: DtypeLike, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class TensorRef:
    """Pickles exactly as torch.save pickles a contiguous CPU tensor of ``shape`` (elements) over its own storage."""

    __slots__ = ("storage", "shape")

    def __init__(self, storage: StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        args: tuple[Any, ...] = (
            self.storage,
            0,
            tuple(self.shape),  # as Tensor.__reduce_ex__ pickles it (a tuple, not a torch.Size)
            _contiguous_stride(self.shape),
            False,
            collections.OrderedDict(),
        )
        if storage_class_name(self.storage.dtype) is None:
            # dtypes without a legacy storage class: untyped storage, dtype passed explicitly
            return (_global("torch._utils", "_rebuild_tensor_v3"), (*args, _global("torch", dtype_name(self.storage.dtype))))
        return (_global("torch._utils", "_rebuild_tensor_v2"), args)


def _save_global(pickler: Any, obj: Global) -> None:
    # pickle._Pickler.save_global, without looking the object up
    if pickler.proto >= 4:
        pickler.save(obj.module)
        pickler.save(obj.name)
        pickler.write(pickle.STACK_GLOBAL)
    else:
        pickler.write(pickle.GLOBAL + obj.module.encode("ascii") + b"\n" + obj.name.encode("ascii") + b"\n")
    pickler.memoize(obj)


def _save_reduced(pickler: Any, obj: Reduced) -> None:
    # pickle._Pickler.save_reduce of (copyreg.__newobj__ | cls, args, state), the class a stand-in
    pickler.save(obj.cls)
    pickler.save(obj.args)
    pickler.write(pickle.NEWOBJ if obj.newobj else pickle.REDUCE)
    pickler.memoize(obj)
    if obj.state is not None:
        pickler.save(obj.state)
        pickler.write(pickle.BUILD)


_BATCHSIZE = 1000  # _pickle.c's BATCHSIZE, as pickle._Pickler._BATCHSIZE


def _save_dict(pickler: Any, obj: dict[Any, Any]) -> None:
    # _pickle.c save_dict + batch_dict_exact (protocol >= 1): one item alone with SETITEM; else
    # batches of 1,000 in MARK ... SETITEMS, the loop ending after a batch short of 1,000 (so a
    # dict of 1,000 items ends with an empty one, where pickle._Pickler writes none)
    pickler.write(pickle.EMPTY_DICT)
    pickler.memoize(obj)
    if not obj:
        return
    save, write = pickler.save, pickler.write
    if len(obj) == 1:
        ((key, value),) = obj.items()
        save(key)
        save(value)
        write(pickle.SETITEM)
        return
    items = iter(obj.items())
    while True:
        write(pickle.MARK)
        n = 0
        for key, value in items:
            save(key)
            save(value)
            n += 1
            if n == _BATCHSIZE:
                break
        write(pickle.SETITEMS)
        if n != _BATCHSIZE:
            return


def _save_list(pickler: Any, obj: list[Any]) -> None:
    # _pickle.c save_list + batch_list_exact (protocol >= 1): one element alone with APPEND; else
    # batches of up to 1,000 in MARK ... APPENDS until none is left (a last lone element included,
    # where pickle._Pickler writes it with APPEND)
    pickler.write(pickle.EMPTY_LIST)
    pickler.memoize(obj)
    if not obj:
        return
    save, write = pickler.save, pickler.write
    if len(obj) == 1:
        save(obj[0])
        write(pickle.APPEND)
        return
    for start in range(0, len(obj), _BATCHSIZE):
        write(pickle.MARK)
        for value in obj[start : start + _BATCHSIZE]:
            save(value)
        write(pickle.APPENDS)


def _save_set(pickler: Any, obj: set[Any]) -> None:
    # _pickle.c save_set: from protocol 4, batches of 1,000 in MARK ... ADDITEMS, ending after a
    # batch short of 1,000 (an empty one after a multiple of 1,000, where pickle._Pickler writes none)
    if pickler.proto < 4:
        pickler.save_reduce(set, (list(obj),), obj=obj)
        return
    pickler.write(pickle.EMPTY_SET)
    pickler.memoize(obj)
    if not obj:
        return
    items = iter(obj)
    while True:
        pickler.write(pickle.MARK)
        n = 0
        for item in items:
            pickler.save(item)
            n += 1
            if n == _BATCHSIZE:
                break
        pickler.write(pickle.ADDITEMS)
        if n != _BATCHSIZE:
            return


class PurePickler(pickle._Pickler):
    """``pickle._Pickler`` writing the C pickler's bytes, ``Global`` stand-ins included (see the module docstring).

    Protocol 2 or more (torch.save's 2, ``pickle.dump``'s default 4 or 5).
    """

    dispatch = {**pickle._Pickler.dispatch, Global: _save_global, Reduced: _save_reduced, dict: _save_dict, list: _save_list}
    dispatch[set] = _save_set


_PLAIN_TYPES = frozenset({str, int, float, bool, type(None), tuple, list, dict, bytes, collections.OrderedDict})


class _Pickler(PurePickler):
    def __init__(self, file: io.BytesIO, first_key: int) -> None:
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self.first_key = first_key
        self.storages: dict[str, Any] = {}  # key -> torch.UntypedStorage, in first-seen order
        self._keys: dict[int, str] = {}  # storage._cdata -> key

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            name = storage_class_name(obj.dtype)
            if name is None:
                return ("storage", _global("torch.storage", "UntypedStorage"), obj.key, "cpu", obj.numel * obj.dtype.itemsize)
            return ("storage", _global("torch", name), obj.key, "cpu", obj.numel)
        return self._torch_storage_id(obj)

    def _torch_storage_id(self, obj: Any) -> Any:
        # a real tensor inside a value (read with torch's loader, so torch is imported): its storage
        # as torch.save's own persistent_id names it (torch/serialization.py, _save), not the
        # storage's __reduce__ (torch.storage._load_from_bytes, which weights_only refuses)
        if type(obj) in _PLAIN_TYPES:
            return None  # the state dict's own keys and values: asked for each one, answered at once
        torch = sys.modules.get("torch")
        # another thread may be importing torch (a mover that casts): its module is in sys.modules half made,
        # and no storage of it can be in a value until the import is done
        storage_module, is_storage = getattr(torch, "storage", None), getattr(torch, "is_storage", None)
        typed = getattr(storage_module, "TypedStorage", None)
        if torch is None or typed is None or is_storage is None or not (isinstance(obj, typed) or is_storage(obj)):
            return None
        if isinstance(obj, typed):
            storage, storage_type, numel = obj._untyped_storage, getattr(torch, obj._pickle_storage_type()), obj._size()
        else:
            storage, storage_type, numel = obj, torch.serialization.normalize_storage_type(type(obj)), obj.nbytes()
        if storage.device.type != "cpu":
            raise ValueError(f"a tensor on {storage.device.type} inside a value; only CPU storages are written")
        key = self._keys.setdefault(storage._cdata, str(self.first_key + len(self._keys)))
        self.storages[key] = storage
        return ("storage", storage_type, key, "cpu", numel)


def dumps(obj: Any) -> bytes:
    """``obj`` pickled as torch.save pickles ``data.pkl`` (protocol 2), ``TensorRef`` values as tensors.

    Args:
        obj: the nested state dict: dicts, lists, tuples, str, int, float, bool, None and
            ``TensorRef`` (other objects pickle as ``pickle`` pickles them).

    Returns:
        The pickle's bytes.

    Raises:
        ValueError: ``obj`` holds a real tensor (``dumps_with_storages`` writes those).
    """
    pickled, storages = dumps_with_storages(obj, 0)
    if storages:
        raise ValueError("a tensor inside a value needs storage records of its own (dumps_with_storages)")
    return pickled


def dumps_with_storages(obj: Any, first_key: int) -> tuple[bytes, dict[str, Any]]:
    """``dumps``, real ``torch.Tensor`` values included: pickled as torch.save pickles them, over storage records.

    A tensor inside a value (a tuple of tensors in a DCP bytes entry, read with torch's loader)
    pickles as ``Tensor.__reduce_ex__`` has it (``_rebuild_tensor_v2`` and the rest, views and
    shared storages kept), its storage as the persistent id torch.save gives it, so
    ``torch.load(weights_only=True)`` reads it. Torch is imported only if ``obj`` holds a tensor.

    Args:
        obj: as ``dumps``, and CPU tensors anywhere in it.
        first_key: the key of the first storage found (``str(first_key)``); the next ones count up.

    Returns:
        The pickle's bytes, and the storages it names (``torch.UntypedStorage`` by key, in key
        order): each must be written as record ``data/<key>``.

    Raises:
        ValueError: a tensor not on the CPU.
    """
    buf = io.BytesIO()
    pickler = _Pickler(buf, first_key)
    pickler.dump(obj)
    return buf.getvalue(), pickler.storages
