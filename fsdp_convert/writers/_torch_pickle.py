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
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
from typing import Any, Protocol

__all__ = ["DtypeLike", "PICKLE_PROTOCOL", "STORAGE_CLASS_NAMES", "dtype_name", "storage_class_name"]
__all__ += ["StorageRef", "TensorRef", "dumps"]

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


class _Global:
    """Stands for the module-level object ``module.name``: pickles as ``GLOBAL module name``, never called."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # save_reduce needs a callable; unpicklers call the real one
        raise TypeError(f"{self.module}.{self.name} is a stand-in")


@functools.cache
def _global(module: str, name: str) -> _Global:
    """One stand-in per name, so the pickle's memo refers back to it as it would to the torch object."""
    return _Global(module, name)


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


def _save_global(pickler: Any, obj: _Global) -> None:
    # pickle._Pickler.save_global for protocol 2, without looking the object up
    pickler.write(pickle.GLOBAL + obj.module.encode("ascii") + b"\n" + obj.name.encode("ascii") + b"\n")
    pickler.memoize(obj)


class _Pickler(pickle._Pickler):
    dispatch = {**pickle._Pickler.dispatch, _Global: _save_global}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            name = storage_class_name(obj.dtype)
            if name is None:
                return ("storage", _global("torch.storage", "UntypedStorage"), obj.key, "cpu", obj.numel * obj.dtype.itemsize)
            return ("storage", _global("torch", name), obj.key, "cpu", obj.numel)
        return None


def dumps(obj: Any) -> bytes:
    """``obj`` pickled as torch.save pickles ``data.pkl`` (protocol 2), ``TensorRef`` values as tensors.

    Args:
        obj: the nested state dict: dicts, lists, tuples, str, int, float, bool, None and
            ``TensorRef`` (other objects pickle as ``pickle`` pickles them).

    Returns:
        The pickle's bytes.
    """
    buf = io.BytesIO()
    _Pickler(buf, protocol=PICKLE_PROTOCOL).dump(obj)
    return buf.getvalue()
