"""torch.save output placed before any data is read: storage records first, at known offsets; the pickle last.

torch.save's container (``torch/serialization.py``, ``_save``) is a zip of one record per storage
(``data/<key>``), a pickle ``data.pkl`` that refers to storages only by key through
``persistent_id``, and small records ``.format_version``, ``.storage_alignment``, ``byteorder``;
``version`` and ``.data/serialization_id`` are added by the zip writer. Record order does not
matter to ``torch.load``, so here the storage records come first, in item order, and ``data.pkl``
after them: every storage's byte range then depends only on the storages' sizes.

The zip is torch's own writer's (``torch._C.PyTorchFileWriter``, ``caffe2/serialize/inline_container.cc``),
byte for byte, as ``writers._torch_zip`` rewrites it in Python, driven over ``_HeaderImage``, a
file object that keeps what it is given in memory and remembers seeks over the data: reserving a
record (what ``torch.serialization.skip_data`` does through ``write_record_metadata``) writes its
local header, 64-byte aligned, and its data descriptor, and skips its data. So the headers,
``data.pkl``, the central directory and zip64 records where needed are exactly torch's, and every
storage's data offset is known (``torch_save_offsets``). Workers ``pwrite`` the storages there;
rank 0 writes the headers last (``write_torch_save_headers``), with the CRC-32s the workers
computed patched in (``_zipcrc``), so ``torch.load(weights_only=True, mmap=True)``,
``zipfile.testzip()`` and ``unzip -t`` all pass. ``data.pkl`` is pickled by
``writers._torch_pickle``, which names torch's classes and functions without importing them.
A small tensor rank 0 holds itself (a merged file's 0-dim step) gets a storage record of its own
too, placed as the others, its bytes written by rank 0 with the headers.

Nothing here imports torch unless a value is a ``torch.Tensor`` (then torch is loaded already):
``TensorSlot.dtype`` is any dtype whose ``str`` is ``torch.<name>`` and that has ``itemsize``.
"""

from __future__ import annotations

import bisect
import io
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdp_convert.dtypes import is_tensor
from fsdp_convert.formats.crc import crc32
from fsdp_convert.formats.index import ObjPath, unflatten
from fsdp_convert.writers._torch_pickle import (
    PICKLE_PROTOCOL,
    DtypeLike,
    Reduced,
    StorageRef,
    TensorRef,
    dumps,
    dumps_with_storages,
)
from fsdp_convert.writers._torch_zip import STORAGE_ALIGNMENT, TorchZipWriter
from fsdp_convert.writers._zipcrc import patch_crcs
from fsdp_convert.zip_records import read_records

if TYPE_CHECKING:
    import torch

__all__ = [
    "TensorSlot",
    "torch_save_offsets",
    "write_torch_save_headers",
    "PayloadPlacement",
    "tensor_payload_placement",
    "write_tensor_payload_headers",
    "PICKLE_PROTOCOL",
    "Reduced",  # a class of another package, pickled by name (``_torch_pickle.Reduced``)
    "STORAGE_ALIGNMENT",  # bytes a storage's data is aligned to (``_torch_zip``)
    "dumps_with_storages",  # data.pkl of a nested dict (``_torch_pickle``): a plan sizes its files with it
]


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """A tensor of the output whose bytes the workers write: its dtype and shape (elements).

    ``dtype`` is a ``torch.dtype`` or any record with its ``itemsize`` whose ``str`` is ``torch.<name>``.
    """

    dtype: DtypeLike
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size of its storage, in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize


class _HeaderImage:
    """A write-only, seekable file that keeps what is written in memory and skips what is seeked over.

    The zip writer (``TorchZipWriter``, or torch's own) writes through it (``write``/``seek``/``tell``);
    afterwards it is the zip with its storage data missing (read as zeros), a ``ZipImage`` for ``patch_crcs``.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._parts: list[bytearray] = []
        self._pos = 0
        self.size = 0

    def write(self, data: Any) -> int:
        raw = bytes(memoryview(data))
        if self._parts and self._starts[-1] + len(self._parts[-1]) == self._pos:
            self._parts[-1] += raw
        else:
            self._starts.append(self._pos)
            self._parts.append(bytearray(raw))
        self._pos += len(raw)
        self.size = max(self.size, self._pos)
        return len(raw)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = base + offset
        self.size = max(self.size, self._pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def pread(self, length: int, offset: int) -> bytes:
        # O(log parts + parts touched): a zip of a million records is read a record at a time
        out = bytearray(max(0, min(length, self.size - offset)))
        end = offset + len(out)
        j = max(0, bisect.bisect_right(self._starts, offset) - 1)
        while j < len(self._starts) and self._starts[j] < end:
            start, part = self._starts[j], self._parts[j]
            lo, hi = max(start, offset), min(start + len(part), end)
            if lo < hi:
                out[lo - offset : hi - offset] = part[lo - start : hi - start]
            j += 1
        return bytes(out)

    def pwrite(self, data: bytes, offset: int) -> None:
        i = bisect.bisect_right(self._starts, offset) - 1
        start, part = (self._starts[i], self._parts[i]) if i >= 0 else (0, bytearray())
        if i < 0 or offset + len(data) > start + len(part):
            raise ValueError(f"bytes [{offset}, {offset + len(data)}) are not a header")
        part[offset - start : offset - start + len(data)] = data

    def parts(self) -> list[tuple[int, bytearray]]:
        """What was written: ``(offset, bytes)`` runs, in file order."""
        return list(zip(self._starts, self._parts, strict=True))


def _container(entries: Sequence[TensorSlot | None], pickled: bytes, extra: Sequence[tuple[str, int]] = ()) -> _HeaderImage:
    """The zip torch's writer makes of these storages (position ``j`` is record ``data/<j>``) and ``data.pkl``.

    ``extra``: ``(key, nbytes)`` of the storages of tensors inside values, reserved after the
    entries' own (so those stay where ``torch_save_offsets`` placed them).
    """
    image = _HeaderImage()
    writer = TorchZipWriter(image)
    for j, slot in enumerate(entries):
        if slot is not None:
            writer.reserve_record(f"data/{j}", slot.nbytes)
    for key, nbytes in extra:
        writer.reserve_record(f"data/{key}", nbytes)
    records = [("data.pkl", pickled), (".format_version", b"1"), (".storage_alignment", str(STORAGE_ALIGNMENT).encode())]
    records.append(("byteorder", sys.byteorder.encode()))
    for name, raw in records:
        writer.write_record(name, raw)
    writer.write_end_of_file()
    return image


def _data_offsets(image: _HeaderImage, count: int) -> list[int | None]:
    """Per entry (record ``data/<j>``, ``j < count``), its data offset; the storages of values' tensors are not entries."""
    offsets: list[int | None] = [None] * count
    for name, offset in _storage_offsets(image).items():
        if int(name) < count:
            offsets[int(name)] = offset
    return offsets


def _storage_offsets(image: _HeaderImage) -> dict[str, int]:
    """Every storage record's data offset, by key (``data/<key>``)."""
    return {r.short_name[5:]: r.data_offset for r in read_records(image.pread, image.size) if r.short_name.startswith("data/")}


def torch_save_offsets(entries: Sequence[TensorSlot | None]) -> tuple[int | None, ...]:
    """Where each storage's bytes go in the torch.save file of these entries, in bytes from its start.

    Args:
        entries: the file's items in order: a ``TensorSlot`` for a tensor, None for a plain value.

    Returns:
        Per entry, the offset of its storage data (None for a value); aligned as torch aligns
        them (``storage_alignment``), so ``torch.load(mmap=True)`` maps them in place.
    """
    return tuple(_data_offsets(_container(entries, b""), len(entries)))


def write_torch_save_headers(
    fd: int,
    items: Sequence[tuple[ObjPath, TensorSlot | Any]],
    crcs: dict[int, int],
    data_offsets: Sequence[int | None],
) -> int:
    """Write everything of a torch.save file but its storage data, which the workers wrote. Rank 0 only.

    Builds ``data.pkl`` (the nested state dict, tensors as references to their storage records),
    builds the zip again with it, checks every storage lands where ``torch_save_offsets`` said,
    patches in the CRC-32s, and writes the headers, pickle and central directory into ``fd``.
    A ``torch.Tensor`` value is written here: its bytes (contiguous, in element order) at its
    storage offset, a storage record as torch.save writes one (``torch_save_offsets`` saw its
    ``TensorSlot``). A tensor inside a plain value (a DCP bytes entry's tuple of tensors, or a
    bytes entry that is a tensor) is pickled as torch.save pickles it, its storages as records
    after the planned ones (``_torch_pickle.dumps_with_storages``), so the planned offsets hold
    and ``torch.load(weights_only=True)`` reads it.

    Args:
        fd: the output file, open for writing, the workers' storage data in place.
        items: ``(path, TensorSlot, tensor or plain value)`` in file order (the order
            ``torch_save_offsets`` saw, a tensor as its ``TensorSlot``).
        crcs: CRC-32 of each ``TensorSlot`` storage's bytes, by position in ``items``.
        data_offsets: what ``torch_save_offsets`` returned for these items.

    Returns:
        The file's size, in bytes.

    Raises:
        ValueError: the storage offsets moved (the items differ from the ones planned), or a
            tensor inside a value is not on the CPU.
    """
    missing = [j for j, (_, value) in enumerate(items) if isinstance(value, TensorSlot) and j not in crcs]
    if missing:
        raise ValueError(f"no CRC-32 for the storages of items {missing[:5]}")
    crcs = dict(crcs)
    slots: list[TensorSlot | None] = []
    tree: list[tuple[ObjPath, Any]] = []
    for j, (path, value) in enumerate(items):
        if is_tensor(value) and data_offsets[j] is not None:  # rank 0's own: its bytes written now, then referenced
            offset = data_offsets[j]
            assert offset is not None
            crcs[j] = _write_tensor_bytes(fd, value, offset)
            value = TensorSlot(value.dtype, tuple(value.shape))
        if isinstance(value, TensorSlot):
            slots.append(value)
            tree.append((path, TensorRef(StorageRef(str(j), value.dtype, math.prod(value.shape)), value.shape)))
        else:  # a plain value; a tensor in it (a bytes entry's tuple, or bare) gets a storage record after the entries'
            slots.append(None)
            tree.append((path, value))
    state = unflatten(tree)
    storages: dict[str, Any]
    try:
        pickled, storages = dumps(state), {}
    except ValueError:  # a tensor inside a value: its storages get records of their own, keys after the items'
        pickled, storages = dumps_with_storages(state, len(items))
    extra = [(key, storage.nbytes()) for key, storage in storages.items()]
    image = _container(slots, pickled, extra)
    if _data_offsets(image, len(items)) != list(data_offsets):
        raise ValueError("torch.save storage offsets changed between planning and writing")
    at = _storage_offsets(image)
    named_crcs = {f"data/{key}": _write_storage_bytes(fd, storage, at[key]) for key, storage in storages.items()}
    patch_crcs(image, named_crcs | {f"data/{j}": crc for j, crc in crcs.items()})
    _pwrite_parts(fd, image, 0)
    os.ftruncate(fd, image.size)
    return image.size


def _write_tensor_bytes(fd: int, tensor: torch.Tensor, offset: int) -> int:
    """Write ``tensor``'s bytes (contiguous, element order) at ``offset`` (bytes) in ``fd``; their CRC-32.

    Read through a byte view of the tensor (``writers.buffer``), without NumPy.
    """
    from fsdp_convert.writers.buffer import byte_view, dense  # imports torch, loaded already: a tensor exists

    flat = dense(tensor.resolve_conj().resolve_neg())
    raw = byte_view(flat)
    view = raw
    while view:
        view = view[os.pwrite(fd, view, offset + len(raw) - len(view)) :]
    return crc32(raw)


def _write_storage_bytes(fd: int, storage: Any, offset: int) -> int:
    """Write a CPU ``torch.UntypedStorage``'s bytes at ``offset`` (bytes) in ``fd``; their CRC-32."""
    import torch  # loaded already: the storage is torch's

    return _write_tensor_bytes(fd, torch.empty(0, dtype=torch.uint8).set_(storage), offset)


@dataclass(frozen=True, slots=True)
class PayloadPlacement:
    """A torch.save of one tensor (``torch.save(tensor)``, as DCP stores a chunk), placed ahead.

    Attributes:
        size: the payload's length, in bytes.
        data_offset: where its storage bytes start within it, in bytes.
    """

    size: int
    data_offset: int


def _payload_image(slot: TensorSlot) -> _HeaderImage:
    return _container([slot], dumps(TensorRef(StorageRef("0", slot.dtype, math.prod(slot.shape)), slot.shape)))


def tensor_payload_placement(slot: TensorSlot) -> PayloadPlacement:
    """Size and storage offset of the torch.save payload of a contiguous tensor of ``slot``'s dtype and shape."""
    image = _payload_image(slot)
    (offset,) = _data_offsets(image, 1)
    assert offset is not None
    return PayloadPlacement(size=image.size, data_offset=offset)


def write_tensor_payload_headers(fd: int, at: int, slot: TensorSlot, crc: int) -> None:
    """Write a one-tensor payload's zip headers and pickle around its storage bytes, already at ``at + data_offset``.

    Args:
        fd: the data file, open for writing.
        at: where the payload starts in it, in bytes.
        slot: the tensor's dtype and shape.
        crc: CRC-32 of the storage bytes.
    """
    image = _payload_image(slot)
    patch_crcs(image, {"data/0": crc})
    _pwrite_parts(fd, image, at)


def _pwrite_parts(fd: int, image: _HeaderImage, at: int) -> None:
    for offset, part in image.parts():
        view = memoryview(part)
        while view:
            view = view[os.pwrite(fd, view, at + offset + len(part) - len(view)) :]
