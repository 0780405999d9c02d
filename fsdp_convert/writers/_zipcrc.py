r"""CRC-32 fix-up for zips written by ``torch._C.PyTorchFileWriter`` with its own CRC turned off.

torch's zip writer computes CRC-32 with miniz at about 0.35 GB/s here, a quarter of the disk's
write speed; zlib's ``crc32`` runs at several GB/s. So the torch.save writer asks torch's writer
for no CRCs, computes each record's CRC with zlib while the data is in memory, and patches the
values in afterwards: into the data descriptor after the record's data (torch's writer sets flag
bit 3) and into the central-directory entry (``fsdp_convert._zip`` finds both).
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import IO

from fsdp_convert._zip import DESCRIPTOR_SIGNATURE, read_records

__all__ = ["patch_crcs"]


def patch_crcs(file: IO[bytes], crcs: dict[str, int]) -> None:
    """Write the right CRC-32 of every record of a finished zip into its descriptor and central entry.

    Args:
        file: the zip, open for reading and writing, flushed.
        crcs: CRC-32 by record name (without the archive folder prefix) for records whose data
            the caller hashed; any other record (torch's ``version``, ``.data/serialization_id``)
            is small and is read back and hashed here.

    Raises:
        ZipFormatError: the file is not a zip of the expected shape.
    """
    fd = file.fileno()

    def pread(length: int, offset: int) -> bytes:
        return os.pread(fd, length, offset)

    for record in read_records(pread, os.fstat(fd).st_size):
        crc = crcs.get(record.short_name)
        if crc is None:
            crc = zlib.crc32(pread(record.size, record.data_offset))
        packed = struct.pack("<I", crc)
        if record.has_descriptor:
            descriptor = record.data_offset + record.size
            if pread(4, descriptor) == DESCRIPTOR_SIGNATURE:
                descriptor += 4
            os.pwrite(fd, packed, descriptor)
        else:
            os.pwrite(fd, packed, record.local_offset + 14)
        os.pwrite(fd, packed, record.central_offset + 16)
