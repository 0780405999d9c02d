"""Read stage, DCP payloads: a chunk payload's zip parsed once per shape; later payloads of that shape matched against it.

``FileSystemWriter`` stores every chunk as a torch.save zip (``torch/serialization.py``,
``PyTorchStreamWriter``): ``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``,
``data/0``, ``version``, ``.data/serialization_id`` and the central directory. Two chunks of one
shape and dtype are the same bytes but in three places: the storage's data, the serialization id
(a per-save value) and the CRC-32s of those two records (in the central directory, and in the
local header or data descriptor, which no reader here uses). A payload that equals one already
parsed everywhere else has the same records at the same offsets and the same ``data.pkl``, so
what ``DcpReader.locate`` learned from the first one (its records checked, its tensor's dtype and
shape, a whole storage in C order) holds for it too; only the varying records are read: the
serialization id's CRC-32 checked and the storage's CRC-32 taken from the central directory.

About 3 µs a chunk where parsing the zip and its pickle takes about 40 µs; a 1024-rank
checkpoint has millions of chunks, of a few hundred shapes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from fsdp_convert.formats._payload_pickle import PayloadTensor
from fsdp_convert.formats.crc import crc32
from fsdp_convert.zip_records import DESCRIPTOR_SIGNATURE, Pread, ZipRecord

__all__ = ["PayloadShape", "PayloadShapes"]

_VARYING = frozenset({".data/serialization_id"})  # records other than the storage whose bytes differ between payloads
_CENTRAL_CRC_AT = 16  # the CRC-32 field in a central directory entry (APPNOTE 4.3.12)
_LOCAL_CRC_AT = 14  # and in a local header (4.3.7)
_U32 = struct.Struct("<I")
_SHAPES_PER_LENGTH = 8  # payloads of one length but other bytes kept apart; past that, each parsed whole
_MAX_SHAPES = 4096  # a checkpoint's distinct chunk payloads (a few per parameter shape); past that, parsed whole


@dataclass(frozen=True, slots=True)
class PayloadShape:
    """What one parsed payload says about every payload that matches it.

    Attributes:
        length: the payload's length, in bytes.
        fixed: ``(start, end, bytes)`` of every span a matching payload holds as this one does, in bytes.
        checked: ``(data offset, size, CRC-32 offset)`` of each varying record besides the storage, in bytes.
        storage: the storage's zip record (its ``crc32`` this payload's; a match reads its own).
        storage_crc_at: offset of the storage's CRC-32 in the central directory, in bytes.
        dtype_name: the tensor's dtype, as ``data.pkl`` gives it (``"float32"``).
        sizes: the tensor's shape, in elements.
    """

    length: int
    fixed: tuple[tuple[int, int, bytes], ...]
    checked: tuple[tuple[int, int, int], ...]
    storage: ZipRecord
    storage_crc_at: int
    dtype_name: str
    sizes: tuple[int, ...]


def _varying_spans(pread: Pread, record: ZipRecord) -> list[tuple[int, int]]:
    """The ``[start, end)`` spans of ``record`` that may differ between payloads of one shape: its data and CRC-32s."""
    end = record.data_offset + record.size
    spans = [(record.data_offset, record.size), (record.central_offset + _CENTRAL_CRC_AT, 4)]
    spans.append((record.local_offset + _LOCAL_CRC_AT, 4))
    if record.has_descriptor:  # the CRC-32 right after the data, or after the descriptor's optional signature
        spans.append((end + 4 if pread(4, end) == DESCRIPTOR_SIGNATURE else end, 4))
    return [(start, start + n) for start, n in spans]


def learn(pread: Pread, length: int, records: list[ZipRecord], storage: ZipRecord, tensor: PayloadTensor) -> PayloadShape:
    """The shape of a payload whose ``records`` were parsed and checked and whose ``storage`` is whole.

    Args:
        pread: reads ``(length, offset)`` of the payload.
        length: the payload's length, in bytes.
        records: its zip records (``zip_records.read_records``), every CRC-32 but the storage's checked.
        storage: the record of its one storage.
        tensor: what its ``data.pkl`` rebuilds (``_payload_pickle.read_payload_tensor``).
    """
    varying = [r for r in records if r is not storage and r.short_name in _VARYING]
    spans = _varying_spans(pread, storage)
    for r in varying:
        spans += _varying_spans(pread, r)
    fixed, at = [], 0
    for start, end in sorted(spans):
        if start > at:
            fixed.append((at, start, pread(start - at, at)))
        at = max(at, end)
    if at < length:
        fixed.append((at, length, pread(length - at, at)))
    checked = tuple((r.data_offset, r.size, r.central_offset + _CENTRAL_CRC_AT) for r in varying)
    crc_at = storage.central_offset + _CENTRAL_CRC_AT
    return PayloadShape(length, tuple(fixed), checked, storage, crc_at, tensor.dtype_name, tensor.sizes)


class PayloadShapes:
    """The payload shapes one reader has learned, by payload length; one per thread, as its reader."""

    __slots__ = ("_by_length", "_count")

    def __init__(self) -> None:
        self._by_length: dict[int, list[PayloadShape]] = {}
        self._count = 0

    def add(self, shape: PayloadShape) -> None:
        """Keep ``shape`` (up to the caps: a checkpoint of many distinct payloads is parsed whole)."""
        same = self._by_length.setdefault(shape.length, [])
        if len(same) < _SHAPES_PER_LENGTH and self._count < _MAX_SHAPES:
            same.append(shape)
            self._count += 1

    def storage_of(
        self, pread: Pread, length: int, whole: bytes | None, tensor: tuple[str, tuple[int, ...], int], check_crc: bool
    ) -> tuple[int, int, int | None] | None:
        """Where the storage of a payload of a learned shape lies: ``(data offset, size, CRC-32)``, in bytes.

        Args:
            pread: reads ``(length, offset)`` of the payload.
            length: the payload's length, in bytes.
            whole: the whole payload where it was read at once.
            tensor: ``(dtype name, sizes, bytes)`` the index gives the chunk; a shape of another tensor does not match.
            check_crc: as ``match``; the CRC-32 is None without it.

        Returns:
            None where no learned shape of that tensor matches: parse the payload.
        """
        matched = self.match(pread, length, check_crc, whole)
        if matched is None or (matched[0].dtype_name, matched[0].sizes, matched[0].storage.size) != tensor:
            return None
        shape, crc = matched
        return shape.storage.data_offset, shape.storage.size, crc if check_crc else None

    def match(self, pread: Pread, length: int, check_crc: bool, whole: bytes | None = None) -> tuple[PayloadShape, int] | None:
        """The learned shape a payload of ``length`` bytes matches, with its storage's CRC-32.

        Args:
            pread: reads ``(length, offset)`` of the payload.
            length: the payload's length, in bytes.
            check_crc: check the CRC-32 of each varying record but the storage.
            whole: the whole payload where it was read at once (then sliced, not read again).

        Returns:
            None: no shape matches (parse it), or a varying record's CRC-32 does not match its bytes
            (``check_crc``; the full parse names it).
        """
        for shape in self._by_length.get(length, ()):
            if whole is not None:
                if any(whole[at:end] != span for at, end, span in shape.fixed):
                    continue
                read: Pread = _slicer(whole)
            elif any(pread(end - at, at) != span for at, end, span in shape.fixed):
                continue
            else:
                read = pread
            if check_crc and any(crc32(read(n, o)) != _U32.unpack(read(4, c))[0] for o, n, c in shape.checked):
                return None
            return shape, _U32.unpack(read(4, shape.storage_crc_at))[0]
        return None


def _slicer(data: bytes) -> Pread:
    return lambda length, offset: data[offset : offset + length]
