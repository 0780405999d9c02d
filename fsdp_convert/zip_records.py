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


_CENTRAL_HEAD = struct.Struct(
    "<4s4xHH4xIIIHHH8xI"
)  # signature, flags, method, CRC-32, sizes, name/extra/comment lengths, local offset
_LOCAL_HEAD = struct.Struct("<4s22xHH")  # signature, name and extra lengths
SMALL_ZIP_BYTES = 64 << 10  # read whole and parsed in memory: a chunk payload (~1.5 KiB of structures)


def read_records(pread: Pread, size: int) -> list[ZipRecord]:
    """Parse the central directory and local headers of a zip of ``size`` bytes.

    A zip of at most ``SMALL_ZIP_BYTES`` (a chunk's payload) is read with one call and parsed in
    memory; a larger one's directory is read at once when small, its local headers one by one.

    Args:
        pread: reads ``length`` bytes at ``offset`` of the zip (offsets relative to its start).
        size: the zip's length, in bytes.

    Returns:
        The records in central-directory order, each with its data range checked to lie
        inside the zip.

    Raises:
        ZipFormatError: a structure is missing, truncated or out of bounds.
    """
    whole = _exact(pread, size, 0) if size <= SMALL_ZIP_BYTES else None
    if whole is not None:
        pread = _Overlay(pread, whole, 0).pread
    cd_offset, cd_size, count = _central_directory(pread, size)
    directory, base = (whole, 0) if whole is not None else (None, 0)
    if directory is None and cd_size <= SMALL_DIRECTORY_BYTES:  # the directory read once, parsed in memory
        directory, base = _exact(pread, cd_size, cd_offset), cd_offset
    records = []
    pos = cd_offset
    for _ in range(count):
        head = directory[pos - base : pos - base + 46] if directory is not None else _exact(pread, 46, pos)
        if len(head) != 46 or head[:4] != _CENTRAL:
            raise ZipFormatError("bad central directory entry")
        _, flags, compression, crc, comp, uncomp, name_len, extra_len, comment_len, local_offset = _CENTRAL_HEAD.unpack(head)
        at = pos + 46
        if directory is not None:
            name_raw, extra = (
                directory[at - base : at - base + name_len],
                directory[at - base + name_len : at - base + name_len + extra_len],
            )
            if len(name_raw) != name_len or len(extra) != extra_len:
                raise ZipFormatError("the zip ends inside one of its structures")
        else:
            name_raw, extra = _exact(pread, name_len, at), _exact(pread, extra_len, at + name_len)
        if 0xFFFFFFFF in (comp, uncomp, local_offset):
            uncomp, comp, local_offset = _zip64_fields(extra, uncomp, comp, local_offset)
        local = whole[local_offset : local_offset + 30] if whole is not None else _exact(pread, 30, local_offset)
        if len(local) != 30 or local[:4] != _LOCAL:
            raise ZipFormatError("bad local header of a record")
        _, l_name, l_extra = _LOCAL_HEAD.unpack(local)
        data_offset = local_offset + 30 + l_name + l_extra
        if data_offset + comp > size:
            raise ZipFormatError("a record runs past the end of the zip")
        name = name_raw.decode("utf-8", errors="replace")
        records.append(ZipRecord(name, pos, local_offset, data_offset, comp, crc, bool(flags & 0x8), compression))
        pos = at + name_len + extra_len + comment_len
    return records
