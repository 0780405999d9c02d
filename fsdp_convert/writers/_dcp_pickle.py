"""DCP writer's pickles without torch: ``.metadata`` and a bytes entry's payload, byte for byte as torch writes them.

``.metadata`` is ``pickle.dump(metadata, f)`` of torch's ``Metadata`` (default protocol, the C
pickler). Each of torch's dataclasses pickles through ``object.__reduce_ex__``: its class
(``STACK_GLOBAL``), ``EMPTY_TUPLE NEWOBJ``, then its state and ``BUILD``: the instance dict in
field order (none for ``BytesStorageMetadata``, whose dict is empty), ``TensorProperties``' 5-tuple
from its ``__getstate__`` (dtype, layout, requires_grad, ``_MEM_FORMAT_ENCODING`` member,
pin_memory), ``_StorageInfo``'s dict without its None fields. ``torch.Size`` pickles as the call
``torch.Size((d0, d1, ...))`` of a new tuple, a dtype as the global ``torch.<name>``, ``torch.strided``
as ``torch.serialization._get_layout("torch.strided")`` and an enum member as a call of its class
with its value. Here each is a stand-in of the same shape, pickled by ``_torch_pickle.PurePickler``,
so opcodes, memo numbering and frames are the C pickler's: every stand-in is one object where
torch's object is one (a class, a dtype, the layout, the enum member), and the module names are one
``str`` object where torch's are (one per module; ``torch.Size``'s ``"torch"`` is another object
than the dtypes' ``"torch"``). The strings and paths the caller passes are pickled as given, so
what the caller shares (an FQN as a key and in its index) is shared as it was with torch's objects.

``value_payload`` is ``torch.save(value, buffer)`` of a value without tensors, as DCP stores a
bytes entry: ``data.pkl`` by ``_torch_pickle.dumps`` (protocol 2), the zip by
``_torch_zip.TorchZipWriter``, then, as torch.save computes CRC-32s by default, every record's
CRC-32 and the ``.data/serialization_id`` computed from them (``_serialization_id``).
"""

from __future__ import annotations

import functools
import io
import pickle
import sys
from collections.abc import Sequence
from typing import Any

from fsdp_convert.formats.crc import crc32
from fsdp_convert.writers._serialization_id import serialization_id
from fsdp_convert.writers._torch_pickle import Global, PurePickler, dumps
from fsdp_convert.writers._torch_zip import STORAGE_ALIGNMENT, TorchZipWriter
from fsdp_convert.writers._zipcrc import patch_crcs
from fsdp_convert.zip_records import read_records

__all__ = [
    "METADATA_PROTOCOL",
    "Size",
    "MetadataIndex",
    "chunk_storage_metadata",
    "tensor_storage_metadata",
    "bytes_storage_metadata",
    "storage_info",
    "storage_meta",
    "metadata_pickle",
    "is_plain",
    "value_payload",
]

METADATA_PROTOCOL = pickle.DEFAULT_PROTOCOL  # pickle.dump(metadata, f)'s, as FileSystemWriter and before this module


def _distinct(text: str) -> str:
    """A ``str`` object equal to ``text`` but no other object (a literal may be shared, interned)."""
    return "".join(list(text))


# one object per module name, as each torch module's classes share their __module__ string
_METADATA_MODULE = _distinct("torch.distributed.checkpoint.metadata")
_FILESYSTEM_MODULE = _distinct("torch.distributed.checkpoint.filesystem")
_SIZE_MODULE = _distinct("torch")  # torch.Size.__module__
_DTYPE_MODULE = _distinct("torch")  # every dtype's __module__: one object, not torch.Size's

_METADATA = Global(_METADATA_MODULE, "Metadata")
_TENSOR_STORAGE = Global(_METADATA_MODULE, "TensorStorageMetadata")
_BYTES_STORAGE = Global(_METADATA_MODULE, "BytesStorageMetadata")
_CHUNK_STORAGE = Global(_METADATA_MODULE, "ChunkStorageMetadata")
_TENSOR_PROPERTIES = Global(_METADATA_MODULE, "TensorProperties")
_METADATA_INDEX = Global(_METADATA_MODULE, "MetadataIndex")
_STORAGE_META = Global(_METADATA_MODULE, "StorageMeta")
_STORAGE_INFO = Global(_FILESYSTEM_MODULE, "_StorageInfo")
_SIZE = Global(_SIZE_MODULE, "Size")


class _Call:
    """Stands for an object torch pickles as a call (``REDUCE``): ``func(*args)``."""

    __slots__ = ("func", "args")

    def __init__(self, func: Global, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args


# torch.strided (copyreg's reducer: _get_layout(str(layout))) and _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
_STRIDED = _Call(Global(_distinct("torch.serialization"), "_get_layout"), ("torch.strided",))
_CONTIGUOUS = _Call(Global(_METADATA_MODULE, "_MEM_FORMAT_ENCODING"), (0,))


@functools.cache
def _dtype(name: str) -> Global:
    """``torch.<name>`` (``dtype.__reduce__`` returns its name): one stand-in per dtype, as each is one object."""
    return Global(_DTYPE_MODULE, name)


class Size:
    """``torch.Size(dims)``: pickles as ``torch.Size`` called with a new tuple of the dims (``__reduce__``'s ``tuple(self)``)."""

    __slots__ = ("dims",)

    def __init__(self, dims: Sequence[int]) -> None:
        self.dims = tuple(map(int, dims))  # a new tuple (but for the empty one, which pickle never memoizes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Size) and self.dims == other.dims

    def __hash__(self) -> int:
        return hash(self.dims)


class _Record:
    """One of torch's dataclasses: ``NEWOBJ`` of its class, then ``state`` (``BUILD``; none when None)."""

    __slots__ = ("cls", "state")

    def __init__(self, cls: Global, state: Any) -> None:
        self.cls, self.state = cls, state


class MetadataIndex(_Record):
    """Stands for torch's ``MetadataIndex(fqn, offset)``: ``storage_data``'s key, equal and hashed by ``(fqn, offset)``."""

    __slots__ = ("key",)

    def __init__(self, fqn: str, offset: Sequence[int] | None) -> None:
        # torch's __init__ sets fqn, index, then offset (a torch.Size) only when given
        state: dict[str, Any] = {"fqn": fqn, "index": None}
        size = None
        if offset is not None:
            size = Size(offset)
            state["offset"] = size
        super().__init__(_METADATA_INDEX, state)
        self.key = (fqn, size)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


def chunk_storage_metadata(offsets: Sequence[int], sizes: Sequence[int]) -> _Record:
    """Stands for torch's ``ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))``, in elements."""
    return _Record(_CHUNK_STORAGE, {"offsets": Size(offsets), "sizes": Size(sizes)})


def tensor_storage_metadata(dtype_name: str, shape: Sequence[int], chunks: list[_Record]) -> _Record:
    """Stands for torch's ``TensorStorageMetadata(TensorProperties(dtype=torch.<dtype_name>), torch.Size(shape), chunks)``.

    The properties are the defaults but the dtype: strided, no grad, contiguous, not pinned.
    """
    properties = _Record(_TENSOR_PROPERTIES, (_dtype(dtype_name), _STRIDED, False, _CONTIGUOUS, False))
    return _Record(_TENSOR_STORAGE, {"properties": properties, "size": Size(shape), "chunks": chunks})


def bytes_storage_metadata() -> _Record:
    """Stands for torch's ``BytesStorageMetadata()`` (no state: its dict is empty)."""
    return _Record(_BYTES_STORAGE, None)


def storage_info(relative_path: str, offset: int, length: int, transform_descriptors: list[str] | None) -> _Record:
    """Stands for torch's ``_StorageInfo``, pickled as its ``__getstate__`` gives it: the fields that are not None.

    ``offset`` and ``length`` are in bytes.
    """
    fields = {
        "relative_path": relative_path,
        "offset": offset,
        "length": length,
        "transform_descriptors": transform_descriptors,
    }
    return _Record(_STORAGE_INFO, {k: v for k, v in fields.items() if v is not None})


def storage_meta(save_id: str) -> _Record:
    """Stands for torch's ``StorageMeta(save_id=save_id)``."""
    return _Record(_STORAGE_META, {"checkpoint_id": None, "save_id": save_id, "load_id": None, "modules": []})


def _save_call(pickler: Any, obj: _Call) -> None:
    # pickle's save_reduce of (func, args): func, args, REDUCE, the object memoized
    pickler.save(obj.func)
    pickler.save(obj.args)
    pickler.write(pickle.REDUCE)
    pickler.memoize(obj)


def _save_size(pickler: Any, obj: Size) -> None:
    pickler.save(_SIZE)
    pickler.save((obj.dims,))  # each Size's own tuple, as torch.Size.__reduce__'s tuple(self) is new each time
    pickler.write(pickle.REDUCE)
    pickler.memoize(obj)


def _save_record(pickler: Any, obj: _Record) -> None:
    # save_reduce of object.__reduce_ex__'s (copyreg.__newobj__, (cls,), state)
    pickler.save(obj.cls)
    pickler.save(())
    pickler.write(pickle.NEWOBJ)
    pickler.memoize(obj)
    if obj.state is not None:
        pickler.save(obj.state)
        pickler.write(pickle.BUILD)


class _MetadataPickler(PurePickler):
    dispatch = {**PurePickler.dispatch, _Call: _save_call, Size: _save_size, _Record: _save_record}
    dispatch[MetadataIndex] = _save_record


def metadata_pickle(
    state_dict_metadata: dict[str, _Record],
    planner_data: Any,
    storage_data: dict[MetadataIndex, _Record],
    save_id: str,
    version: str,
) -> bytes:
    """``pickle.dumps`` of torch's ``Metadata`` of these fields (``storage_meta=StorageMeta(save_id=save_id)``).

    Args:
        state_dict_metadata: FQN -> ``tensor_storage_metadata`` or ``bytes_storage_metadata``.
        planner_data: FQN -> its path, as DCP records it.
        storage_data: ``MetadataIndex`` -> ``storage_info``.
        save_id: the save's id (a uuid4 string).
        version: DCP metadata version.

    Returns:
        The ``.metadata`` file's bytes.
    """
    metadata = _Record(
        _METADATA,
        {
            "state_dict_metadata": state_dict_metadata,
            "planner_data": planner_data,
            "storage_data": storage_data,
            "storage_meta": storage_meta(save_id),
            "version": version,
        },
    )
    buf = io.BytesIO()
    _MetadataPickler(buf, protocol=METADATA_PROTOCOL).dump(metadata)
    return buf.getvalue()


_PLAIN_SCALARS = frozenset({type(None), bool, int, float, complex, str, bytes})
_PLAIN_CONTAINERS = frozenset({dict, list, tuple})


def is_plain(value: Any) -> bool:
    """Whether ``value`` is built of None, bool, int, float, complex, str, bytes, dict, list and tuple only (exact types).

    Such a value holds no tensor, and ``value_payload`` writes it as torch.save does.
    """
    seen: set[int] = set()
    todo = [value]
    while todo:
        obj = todo.pop()
        kind = type(obj)
        if kind in _PLAIN_SCALARS:
            continue
        if kind not in _PLAIN_CONTAINERS:
            return False
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        todo.extend(obj.keys() if kind is dict else ())
        todo.extend(obj.values() if kind is dict else obj)
    return True


class _BytesImage:
    """A zip in a ``bytearray``, for ``_zipcrc.patch_crcs``."""

    def __init__(self, raw: bytes) -> None:
        self.raw = bytearray(raw)

    @property
    def size(self) -> int:
        return len(self.raw)

    def pread(self, length: int, offset: int) -> bytes:
        return bytes(self.raw[offset : offset + length])

    def pwrite(self, data: bytes, offset: int) -> None:
        self.raw[offset : offset + len(data)] = data


_SERIALIZATION_ID = ".data/serialization_id"


def value_payload(value: Any) -> bytes:
    """``torch.save(value, buffer)``'s bytes for a plain value (``is_plain``), without torch.

    Args:
        value: a plain value (a bytes entry's: an optimizer's ``param_groups`` field, a step...).

    Returns:
        The torch.save zip, as DCP stores a bytes entry.

    Raises:
        ValueError: ``value`` is not plain.
    """
    if not is_plain(value):
        raise ValueError(f"not a plain value: {type(value).__name__}")
    stream = io.BytesIO()
    writer = TorchZipWriter(stream)
    writer.write_record("data.pkl", dumps(value))
    writer.write_record(".format_version", b"1")
    writer.write_record(".storage_alignment", str(STORAGE_ALIGNMENT).encode())
    writer.write_record("byteorder", sys.byteorder.encode())
    writer.write_end_of_file()
    # TorchZipWriter writes torch's zip as with compute_crc32=False; torch.save computes them
    # (torch.serialization.config.save.compute_crc32), and so folds them into the serialization id
    image = _BytesImage(stream.getvalue())
    records = read_records(image.pread, image.size)
    names: list[str] = []
    crcs: list[int] = []
    for record in records:
        if record.short_name == _SERIALIZATION_ID:
            image.pwrite(serialization_id(names, crcs), record.data_offset)
        else:
            names.append(record.short_name)
            crcs.append(crc32(image.pread(record.size, record.data_offset)))
    patch_crcs(image, {})
    return bytes(image.raw)
