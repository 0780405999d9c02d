"""Read stage, full files: a torch.save zip's ``data.pkl`` read as records of where each tensor's bytes lie, without torch.

torch.save (``torch/serialization.py``, ``_save``, pickle protocol 2) writes a zip of stored records:
``<archive>/data.pkl``, the pickled object, and one record ``<archive>/data/<key>`` per storage,
its bytes as they lie in memory. In the pickle a tensor is one call of
``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
OrderedDict())`` (``_rebuild_tensor_v3(..., dtype)`` for dtypes without a legacy storage class), a
``Parameter`` that call wrapped in ``torch._utils._rebuild_parameter(tensor, requires_grad,
OrderedDict())``, and a storage the persistent id ``("storage", <storage class>, key, "cpu", numel)``.

``load_records`` reads exactly that with ``_payload_pickle``'s interpreter (no torch; nothing is
called but these rebuilds, made inert): each tensor becomes a ``StoredTensor`` (dtype, shape,
stride, and where its storage lies in the file), everything else the plain values torch's own
loader gives. Anything else gives None: a legacy non-zip file, another pickle protocol or global,
a storage not on the CPU, not of its record's size or named twice as two classes or lengths, a
tensor reaching past its storage, a byte order not this machine's, a zip naming a record twice
or holding one outside the first record's folder, a pickle or zip that does not parse. The caller
then takes torch's loader, which reads it or names the fault: where this path reads a file, it
reads what that loader would.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsdp_convert.formats._payload_pickle import PayloadTensor, _PayloadUnpickler, contiguous
from fsdp_convert.formats._safe_pickle import RefusedError
from fsdp_convert.formats.crc import crc32
from fsdp_convert.formats.index import DTYPE_ITEMSIZES
from fsdp_convert.zip_records import ZipFormatError, ZipRecord, read_records

__all__ = ["MAX_PICKLE_BYTES", "StoredTensor", "load_records"]

MAX_PICKLE_BYTES = 256 << 20  # a data.pkl read into memory here; a larger one (millions of keys) is torch's loader's
_PROTOCOL_2 = b"\x80\x02"  # torch.save's default, and the only protocol torch's weights_only loader reads whole


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A tensor of a torch.save file, as its pickle describes it and its zip places it.

    Attributes:
        dtype_name: element type, as torch names it without ``torch.`` (``"bfloat16"``).
        shape: its shape, in elements.
        stride: its strides, in elements.
        storage_offset: its first element in its storage, in elements.
        storage_at: where its storage's bytes start in the file, in bytes.
        storage_nbytes: its storage's length, in bytes (its zip record's).
    """

    dtype_name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_at: int
    storage_nbytes: int

    @property
    def nbytes(self) -> int:
        """The tensor's own bytes (elements x element size)."""
        count = 1
        for size in self.shape:
            count *= size
        return count * DTYPE_ITEMSIZES[self.dtype_name]

    def byte_range(self) -> tuple[int, int] | None:
        """``(offset, nbytes)`` in the file of its elements when they lie there in C order, back to back; else None."""
        if not contiguous(self.shape, self.stride):
            return None
        return self.storage_at + self.storage_offset * DTYPE_ITEMSIZES[self.dtype_name], self.nbytes


class _Parameter:
    """``torch._utils._rebuild_parameter`` as the pickle names it: unwrapped to its tensor, never called."""


_PARAMETER = _Parameter()


class _FileUnpickler(_PayloadUnpickler):
    """A chunk payload's allow-list (``_payload_pickle``), with ``Parameter`` and the file's storage records.

    Refuses (``RefusedError``: the caller takes torch's loader) a storage the zip does not hold
    whole, a dtype this tool does not read, and a tensor reaching past its storage.
    """

    def __init__(self, data: bytes, storages: dict[str, ZipRecord]) -> None:
        super().__init__(data)
        self._storages = storages
        self._claims: dict[str, tuple[str, int]] = {}  # storage key -> (class, numel) its first reference gave

    def persistent_load(self, pid: Any) -> Any:
        storage = super().persistent_load(pid)
        # torch's loader makes a storage once, as its first reference says: a key named again as
        # another class or length would be read otherwise there, so it is left to that loader
        claim = (storage.storage_class, storage.numel)
        if self._claims.setdefault(storage.key, claim) != claim:
            raise RefusedError("a storage named twice, as two classes or lengths")
        return storage

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _PARAMETER
        return super().find_class(module, name)

    def call(self, func: Any, args: tuple[Any, ...]) -> Any:
        if func is _PARAMETER:
            if len(args) != 3 or type(args[0]) is not StoredTensor or type(args[1]) is not bool:
                raise RefusedError("not a plain parameter")
            if type(args[2]) is not OrderedDict or args[2]:
                raise RefusedError("a parameter with backward hooks")
            return args[0]
        made = super().call(func, args)
        return self._placed(made) if type(made) is PayloadTensor else made

    def _placed(self, tensor: PayloadTensor) -> StoredTensor:
        record = self._storages.get(tensor.storage_key)
        itemsize = DTYPE_ITEMSIZES.get(tensor.dtype_name)
        if record is None or itemsize is None or record.size != tensor.storage_nbytes:
            raise RefusedError("a storage the file does not hold as the pickle says")
        if 0 not in tensor.sizes:  # the last element it reaches lies inside the storage
            last = tensor.storage_offset + sum((n - 1) * step for n, step in zip(tensor.sizes, tensor.stride))
            if (last + 1) * itemsize > record.size:
                raise RefusedError("a tensor reaching past its storage")
        return StoredTensor(
            dtype_name=tensor.dtype_name,
            shape=tensor.sizes,
            stride=tensor.stride,
            storage_offset=tensor.storage_offset,
            storage_at=record.data_offset,
            storage_nbytes=record.size,
        )


def _exactly(fd: int, length: int, offset: int) -> bytes | None:
    data = os.pread(fd, length, offset)
    return data if len(data) == length else None


def load_records(
    fd: int, size: int, unpickler: Callable[[bytes, dict[str, ZipRecord]], _FileUnpickler] | None = None
) -> Any | None:
    """The object a torch.save zip holds, its tensors as ``StoredTensor`` records; None for anything else.

    Reads the zip's directory and ``data.pkl`` (at most ``MAX_PICKLE_BYTES``), never a storage.
    Never raises for what the file holds: None sends the caller to torch's loader.

    Args:
        fd: an open descriptor of the file (read with ``os.pread``; kept open).
        size: the file's length, in bytes.
        unpickler: makes the unpickler from ``data.pkl`` and the storage records by key: a
            ``_FileUnpickler`` admitting a format's own globals too (``_ds_records``); this one by default.

    Raises:
        OSError: the file cannot be read.
    """
    try:
        records = read_records(lambda length, offset: os.pread(fd, length, offset), size)
    except ZipFormatError:
        return None
    if not records or any(r.compression for r in records) or len({r.name for r in records}) != len(records):
        return None  # a name twice: which record torch's loader takes is its zip library's choice
    archive = records[0].name.partition("/")[0] + "/"  # torch's loader: the first record's folder
    pickles = [r for r in records if r.name == archive + "data.pkl"]
    if not pickles or pickles[0].size > MAX_PICKLE_BYTES or not all(r.name.startswith(archive) for r in records):
        return None
    order = next((r for r in records if r.name == archive + "byteorder"), None)
    if order is not None and _exactly(fd, order.size, order.data_offset) != sys.byteorder.encode():
        return None  # torch's loader byte-swaps such a file's storages
    data = _exactly(fd, pickles[0].size, pickles[0].data_offset)
    if data is None or not data.startswith(_PROTOCOL_2) or crc32(data) != pickles[0].crc32:
        return None
    storages = {r.name[len(archive) + len("data/") :]: r for r in records if r.name.startswith(archive + "data/")}
    reading = (unpickler or _FileUnpickler)(data, storages)
    try:
        obj = reading.load()
    except (pickle.UnpicklingError, RecursionError, MemoryError):
        return None
    return obj if reading.end == len(data) else None
