r"""CRC-32 fix-up for zips written by ``torch._C.PyTorchFileWriter`` with its own CRC turned off.

torch's zip writer computes CRC-32 with miniz at about 0.35 GB/s here, a quarter of the disk's
write speed; ``formats.crc.crc32`` (ISA-L's) runs at 15 GB/s or more and releases the GIL. So the torch.save writer
asks torch's writer for no CRCs, the workers hash each record's data as they write it, and the
values are patched in afterwards: into the data descriptor after the record's data (torch's
writer sets flag bit 3) and into the central-directory entry (``fsdp_convert.zip_records`` finds both).
"""

from __future__ import annotations

import os
import struct
from typing import Protocol

from fsdp_convert.formats.crc import crc32
from fsdp_convert.zip_records import DESCRIPTOR_SIGNATURE, read_records

__all__ = ["ZipImage", "FileImage", "patch_crcs"]


class ZipImage(Protocol):
    """Random access to a zip's bytes: a file, or the headers of one kept in memory."""

    @property
    def size(self) -> int:
        """Length of the zip, in bytes."""
        ...

    def pread(self, length: int, offset: int) -> bytes:
        """``length`` bytes at ``offset`` (fewer at the end)."""
        ...

    def pwrite(self, data: bytes, offset: int) -> None:
        """Overwrite ``len(data)`` bytes at ``offset``."""
        ...


class FileImage:
    """A ``ZipImage`` over an open file descriptor (read and write)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @property
    def size(self) -> int:
        """The file's size, in bytes."""
        return os.fstat(self.fd).st_size

    def pread(self, length: int, offset: int) -> bytes:
        """Read from the file."""
        return os.pread(self.fd, length, offset)

    def pwrite(self, data: bytes, offset: int) -> None:
        """Write into the file."""
        os.pwrite(self.fd, data, offset)


def patch_crcs(image: ZipImage, crcs: dict[str, int]) -> None:
    """Write the right CRC-32 of every record of a finished zip into its descriptor and central entry.

    Args:
        image: the zip's bytes.
        crcs: CRC-32 by record name (without the archive folder prefix) for records whose data
            the caller hashed; any other record (``data.pkl``, torch's ``version``,
            ``.data/serialization_id``) is small and is read back and hashed here.

    Raises:
        ZipFormatError: the image is not a zip of the expected shape.
    """
    for record in read_records(image.pread, image.size):
        crc = crcs.get(record.short_name)
        if crc is None:
            crc = crc32(image.pread(record.size, record.data_offset))
        packed = struct.pack("<I", crc)
        if record.has_descriptor:
            descriptor = record.data_offset + record.size
            if image.pread(4, descriptor) == DESCRIPTOR_SIGNATURE:
                descriptor += 4
            image.pwrite(packed, descriptor)
        else:
            image.pwrite(packed, record.local_offset + 14)
        image.pwrite(packed, record.central_offset + 16)
