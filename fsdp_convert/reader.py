"""Transitional re-exports of ``fsdp_convert.formats`` (issue 12); removed once every importer moved.

``ChunkReader(checkpoint_id, check_crc=...)`` now opens the reader of the checkpoint's own format
(``formats.open_reader``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fsdp_convert.formats._range import ByteRangeFile
from fsdp_convert.formats._reader import READ_LOG_ENV, ChunkedReader, check_data_files
from fsdp_convert.formats.index import Location

__all__ = ["check_data_files", "ChunkReader", "ByteRangeFile", "READ_LOG_ENV"]

if TYPE_CHECKING:
    ChunkReader = ChunkedReader
else:

    def ChunkReader(checkpoint_id: str | os.PathLike[str] | Location, *, check_crc: bool = True) -> ChunkedReader:  # noqa: N802
        """The reader of the checkpoint's own format (``formats.open_reader``)."""
        from fsdp_convert.formats import open_reader

        return open_reader(checkpoint_id, check_crc=check_crc)
