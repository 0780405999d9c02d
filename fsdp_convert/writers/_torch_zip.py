r"""torch.save's zip container written in pure Python: the bytes torch's own writer writes, without importing torch.

``torch._C.PyTorchFileWriter(stream, compute_crc32=False, 64)`` (``caffe2/serialize/inline_container.cc``
over miniz's ``mz_zip_writer_add_mem_ex_v2`` and ``mz_zip_writer_finalize_archive``), for the calls
``writers.torch_save`` makes: records reserved (``write_record_metadata``: headers written, data
seeked over), small records written whole, then the end of file. Each record, under the archive
folder ``archive/`` (torch's name when it writes to a stream):

- a local header: version needed 0, flags 0x0808 (UTF-8 names; bit 3, sizes in a data descriptor,
  for a non-empty record), stored, DOS time and date 0, CRC-32 and sizes 0;
- extra fields: a zip64 one (id 1) where the size or the header's offset reaches 0xFFFFFFFF (size
  and a 0 compressed size, then the offset, each 8 bytes, where they are that large), then torch's
  ``FB`` field, padded with ``Z`` so the data starts at a multiple of ``STORAGE_ALIGNMENT``;
- the data, then (non-empty records only) a data descriptor: signature, CRC-32 (0: the caller
  patches CRCs in, ``writers._zipcrc``), the sizes in 4 bytes each, or 8 where a zip64 field was
  written.

At the end torch adds ``version`` (``"3\\n"``) and ``byteorder`` where they were not written, then
``.data/serialization_id`` (``writers._serialization_id``); then the central directory (entries
in record order, made-by and needed versions 0, sizes and offset capped at 0xFFFFFFFF with a zip64
field holding the real values), and, always, the zip64 end record (made by 0x031E, needs 0x002D),
its locator and the end record (counts capped at 0xFFFF).
"""

from __future__ import annotations

import io
import struct
import sys
from typing import Protocol

from fsdp_convert.writers._serialization_id import serialization_id

__all__ = ["STORAGE_ALIGNMENT", "ARCHIVE_NAME", "TorchZipWriter", "Seekable"]

STORAGE_ALIGNMENT = 64  # torch.serialization._get_storage_alignment(); tests check it against torch's
ARCHIVE_NAME = "archive"  # the folder torch's writer names the records under when writing to a stream
_FILE_FORMAT_VERSION = 3  # caffe2 kMinProducedFileFormatVersion: the "version" record torch.save's writer adds

_U16 = 0xFFFF
_U32 = 0xFFFFFFFF
_LOCAL = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL = b"PK\x01\x02"
_FLAG_DESCRIPTOR = 0x0008
_FLAG_UTF8 = 0x0800
_SERIALIZATION_ID = ".data/serialization_id"


class Seekable(Protocol):
    """Where the zip goes: a binary stream that can write and seek (``writers.torch_save._HeaderImage``, a file)."""

    def write(self, data: bytes, /) -> int:
        """Write ``data`` at the position and move past it."""
        ...

    def seek(self, offset: int, whence: int = io.SEEK_SET, /) -> int:
        """Move the position."""
        ...


def _zip64_field(*values: int) -> bytes:
    """The zip64 extra field (miniz's ``mz_zip_writer_create_zip64_extra_data``): id 1, then the 8-byte values given."""
    if not values:
        return b""
    return struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values)


class TorchZipWriter:
    """torch's zip writer (``PyTorchFileWriter(stream, compute_crc32=False, 64)``), reimplemented; see the module docstring.

    Every CRC-32 field is 0, as torch's writer leaves them with ``compute_crc32=False``.
    """

    def __init__(self, stream: Seekable) -> None:
        self._stream = stream
        self._pos = 0  # miniz's m_archive_size: where the next record's local header goes, in bytes
        self._central: list[bytes] = []
        self._names: list[str] = []  # in the order written, for the serialization id
        self._written: set[str] = set()
        self._descriptor_crcs: list[int] = []
        self._finished = False

    def reserve_record(self, name: str, nbytes: int) -> None:
        """Write record ``name``'s headers and seek over its ``nbytes`` of data (``write_record_metadata``).

        Raises:
            ValueError: the name was written before, or the zip is finished.
        """
        self._add(name, nbytes, None)

    def write_record(self, name: str, data: bytes) -> None:
        """Write record ``name`` with its data (``write_record(name, data, len(data))``).

        A record named ``.data/serialization_id`` is skipped, as torch's writer skips it: the
        writer adds its own at the end.

        Raises:
            ValueError: the name was written before, or the zip is finished.
        """
        if name == _SERIALIZATION_ID:
            return
        self._add(name, len(data), bytes(data))

    def write_end_of_file(self) -> None:
        """Add ``version``, ``byteorder`` (where not written) and ``.data/serialization_id``; write the directory.

        Raises:
            ValueError: the zip is finished already.
        """
        if not self._written & {"version", ".data/version"}:
            raw = f"{_FILE_FORMAT_VERSION}\n".encode()
            self._add("version", len(raw), raw)
        if "byteorder" not in self._written:
            raw = sys.byteorder.encode()
            self._add("byteorder", len(raw), raw)
        raw = serialization_id(self._names, self._descriptor_crcs)
        self._add(_SERIALIZATION_ID, len(raw), raw)
        self._finished = True
        directory = b"".join(self._central)
        start, count = self._pos, len(self._central)
        end64 = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 0x002D, 0, 0, count, count, len(directory), start)
        locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, start + len(directory), 1)
        short = min(count, _U16)
        end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, short, short, min(len(directory), _U32), min(start, _U32), 0)
        self._write(directory + end64 + locator + end)

    def _add(self, name: str, size: int, data: bytes | None) -> None:
        if self._finished:
            raise ValueError(f"zip record {name!r} written after the end of file")
        if name in self._written:
            raise ValueError(f"zip record {name!r} written twice")
        full = f"{ARCHIVE_NAME}/{name}".encode()
        at = self._pos
        big, far = size >= _U32, at >= _U32
        # torch's getPadding: the FB field makes the data start aligned, counting the zip64 field
        start = at + 30 + len(full) + 4 + (4 + 16 * big + 8 * far if big or far else 0)
        pad = -start % STORAGE_ALIGNMENT
        local64 = _zip64_field(*((size, 0) if big else ()), *((at,) if far else ()))
        extra = local64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        flags = _FLAG_UTF8 | (_FLAG_DESCRIPTOR if size else 0)
        header = struct.pack("<4sHHHHHIIIHH", _LOCAL, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra))
        self._write(header + full + extra)
        if data is None:
            self._seek(size)
        else:
            self._write(data)
            if len(data) >= 8 and data[:4] == _DESCRIPTOR:
                # torch's write callback takes any write that starts like a descriptor for one
                self._descriptor_crcs.append(int.from_bytes(data[4:8], "little"))
        if size:
            sizes = struct.pack("<QQ", size, size) if local64 else struct.pack("<II", size, size)
            self._write(_DESCRIPTOR + bytes(4) + sizes)
            self._descriptor_crcs.append(0)
        central64 = _zip64_field(*((size, size) if big else ()), *((at,) if far else ()))
        capped = min(size, _U32)
        fields = (0, 0, flags, 0, 0, 0, 0, capped, capped, len(full), len(central64), 0, 0, 0, 0, min(at, _U32))
        self._central.append(struct.pack("<4sHHHHHHIIIHHHHHII", _CENTRAL, *fields) + full + central64)
        self._names.append(name)
        self._written.add(name)

    def _write(self, raw: bytes) -> None:
        self._stream.write(raw)
        self._pos += len(raw)

    def _seek(self, nbytes: int) -> None:
        if nbytes:
            self._stream.seek(nbytes, io.SEEK_CUR)
            self._pos += nbytes
