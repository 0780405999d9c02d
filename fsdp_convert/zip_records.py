"""The zip container of torch.save payloads: records, their data ranges and CRC-32s.

Layout per PKWARE's APPNOTE (sections 4.3-4.5): local headers, record data, optional data
descriptors (flag bit 3; torch's writer sets it), the central directory, and the end record
(zip64 variants when sizes or offsets pass 4 GiB). Only what this tool needs is parsed:
for each record its name, where its data lies, its size and its CRC-32. Stored (uncompressed)
records only, as torch.save writes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ZipRecord", "ZipFormatError", "read_records"]

_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
DESCRIPTOR_SIGNATURE = b"PK\x07\x08"

Pread = Callable[[int, int], bytes]  # (length, offset) -> exactly that many bytes, or fewer at the end


class ZipFormatError(ValueError):
    """The bytes are not a zip of the shape torch.save writes."""


@dataclass(frozen=True, slots=True)
class ZipRecord:
    """One record of a zip.

    Attributes:
        name: full name inside the zip (``archive/data/0``).
        central_offset: start of its central-directory entry, in bytes from the zip's start.
        local_offset: start of its local header, in bytes.
        data_offset: start of its data, in bytes.
        size: data length, in bytes (stored records: compressed == uncompressed).
        crc32: the CRC-32 the central directory records.
        has_descriptor: whether a data descriptor follows the data (flag bit 3).
        compression: compression method (0 = stored).
    """

    name: str
    central_offset: int
    local_offset: int
    data_offset: int
    size: int
    crc32: int
    has_descriptor: bool
    compression: int

    @property
    def short_name(self) -> str:
        """The name without the archive folder (``data/0``)."""
        return self.name.split("/", 1)[1] if "/" in self.name else self.name


def _exact(pread: Pread, length: int, offset: int) -> bytes:
    data = pread(length, offset)
    if len(data) != length:
        raise ZipFormatError("the zip ends inside one of its structures")  # offsets read from the zip: not quoted
    return data


def _central_directory(pread: Pread, size: int) -> tuple[int, int, int]:
    tail_len = min(size, 22 + 20)  # the end record and the zip64 locator before it: no comment is searched for
    if tail_len < 22:
        raise ZipFormatError(f"{size} bytes is too short for a zip")
    tail = _exact(pread, tail_len, size - tail_len)
    # torch writes no zip comment, so the end record closes the range exactly; a range that is
    # too long (taking in the next payload) or too short shows here
    pos = len(tail) - 22
    if tail[pos : pos + 4] != _EOCD or struct.unpack_from("<H", tail, pos + 20)[0] != 0:
        raise ZipFormatError("no end-of-central-directory record at the end of the range")
    count, cd_size, cd_offset = struct.unpack_from("<HII", tail, pos + 10)
    cd_end = size - 22
    loc = pos - 20
    has_zip64 = loc >= 0 and tail[loc : loc + 4] == _ZIP64_LOCATOR  # torch's writer always adds one
    if cd_offset == 0xFFFFFFFF or count == 0xFFFF or cd_size == 0xFFFFFFFF or has_zip64:
        if not has_zip64:
            raise ZipFormatError("zip64 fields without a zip64 locator")
        (eocd64_offset,) = struct.unpack_from("<Q", tail, loc + 8)
        eocd64 = _exact(pread, 56, eocd64_offset)
        if eocd64[:4] != _ZIP64_EOCD:
            raise ZipFormatError("bad zip64 end-of-central-directory record")
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", eocd64, 32)
        cd_end = eocd64_offset
    if cd_offset + cd_size != cd_end or count > cd_size // 46:
        raise ZipFormatError("the central directory does not end where the end record is")
    return cd_offset, cd_size, count


SMALL_DIRECTORY_BYTES = 64 << 10  # read at once; a larger directory (a file of many records) entry by entry


class _Overlay:
    """``pread`` served from ``data`` (the bytes at ``base``) where it covers the range, else from the file."""

    __slots__ = ("_pread", "_data", "_base")

    def __init__(self, pread: Pread, data: bytes, base: int) -> None:
        self._pread, self._data, self._base = pread, data, base

    def pread(self, length: int, offset: int) -> bytes:
        at = offset - self._base
        if 0 <= at and at + length <= len(self._data):
            return self._data[at : at + length]
        return self._pread(length, offset)


def _zip64_fields(extra: bytes, uncomp: int, comp: int, local_offset: int) -> tuple[int, int, int]:
    i = 0
    while i + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, i)
        if tag == 0x0001:
            values = iter(struct.unpack_from(f"<{length // 8}Q", extra, i + 4))
            try:
                if uncomp == 0xFFFFFFFF:
                    uncomp = next(values)
                if comp == 0xFFFFFFFF:
                    comp = next(values)
                if local_offset == 0xFFFFFFFF:
                    local_offset = next(values)
            except StopIteration:
                raise ZipFormatError("zip64 extra field too short") from None
            return uncomp, comp, local_offset
        i += 4 + length
    raise ZipFormatError("zip64 sizes without a zip64 extra field")


def read_records(pread: Pread, size: int) -> list[ZipRecord]:
    """Parse the central directory and local headers of a zip of ``size`` bytes.

    Args:
        pread: reads ``length`` bytes at ``offset`` of the zip (offsets relative to its start).
        size: the zip's length, in bytes.

    Returns:
        The records in central-directory order, each with its data range checked to lie
        inside the zip.

    Raises:
        ZipFormatError: a structure is missing, truncated or out of bounds.
    """
    cd_offset, cd_size, count = _central_directory(pread, size)
    if cd_size <= SMALL_DIRECTORY_BYTES:  # a chunk payload's few records: the directory read once, parsed in memory
        directory, base = _exact(pread, cd_size, cd_offset), cd_offset
        pread = _Overlay(pread, directory, base).pread
    records = []
    pos = cd_offset
    for _ in range(count):
        head = _exact(pread, 46, pos)
        if head[:4] != _CENTRAL:
            raise ZipFormatError("bad central directory entry")
        flags, compression = struct.unpack_from("<HH", head, 8)
        (crc,) = struct.unpack_from("<I", head, 16)
        comp, uncomp, name_len, extra_len, comment_len = struct.unpack_from("<IIHHH", head, 20)
        (local_offset,) = struct.unpack_from("<I", head, 42)
        name = _exact(pread, name_len, pos + 46).decode("utf-8", errors="replace")
        extra = _exact(pread, extra_len, pos + 46 + name_len)
        if 0xFFFFFFFF in (comp, uncomp, local_offset):
            uncomp, comp, local_offset = _zip64_fields(extra, uncomp, comp, local_offset)
        local = _exact(pread, 30, local_offset)
        if local[:4] != _LOCAL:
            raise ZipFormatError("bad local header of a record")
        l_name, l_extra = struct.unpack_from("<HH", local, 26)
        data_offset = local_offset + 30 + l_name + l_extra
        if data_offset + comp > size:
            raise ZipFormatError("a record runs past the end of the zip")
        records.append(
            ZipRecord(
                name=name,
                central_offset=pos,
                local_offset=local_offset,
                data_offset=data_offset,
                size=comp,
                crc32=crc,
                has_descriptor=bool(flags & 0x8),
                compression=compression,
            )
        )
        pos += 46 + name_len + extra_len + comment_len
    return records
