"""DeepSpeed ZeRO checkpoints, reading: a save's chunks as bare byte ranges of its partitions, its values by record.

``formats/deepspeed.py`` indexes the save (each chunk one byte range of a partition, each value a
record path in a model or optimizer states file); this reads them.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from fsdp_convert.formats._rank_unpickler import local_value
from fsdp_convert.formats.deepspeed_files import load_ds_file
from fsdp_convert.formats.index import BytesEntry, ChunkEntry, TensorEntry
from fsdp_convert.formats.reader import ChunkedReader, StoredBytes, read_bare_chunk

__all__ = ["DeepSpeedReader"]


class DeepSpeedReader(ChunkedReader):
    """Reads a DeepSpeed save's chunks as bare elements (each a byte range of a partition) and its values.

    Args:
        checkpoint_id: the folder given to ``deepspeed_index`` (local only).
        check_crc: unused (torch.save files store no CRC per tensor); kept for the shared signature.
    """

    def __init__(self, checkpoint_id: Any, *, check_crc: bool = True, follow_symlinks: bool | None = None) -> None:
        super().__init__(checkpoint_id, check_crc=check_crc, follow_symlinks=follow_symlinks)
        self._loaded: dict[str, Any] = {}

    def locate(self, entry: TensorEntry, chunk: ChunkEntry) -> StoredBytes | None:
        """Where ``chunk``'s elements lie: a byte range of a partition, as they are (no CRC stored).

        Raises:
            MissingDataFileError, CorruptChunkError: the file is gone or shorter than the range.
        """
        if chunk.relative_path is None:
            return None
        where = self._where(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, entry.fqn)
        fd, at = self._range(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, where)
        return StoredBytes(fd=fd, offset=at, nbytes=chunk.length_bytes, crc32=None, where=where)

    def _load_chunk(self, entry: TensorEntry, chunk: ChunkEntry) -> Any:
        assert chunk.relative_path is not None
        where = self._where(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, entry.fqn)
        fd, at = self._range(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, where)
        return read_bare_chunk(fd, at, entry, chunk, where)

    def read_value(self, entry: BytesEntry) -> Any:
        """The value at ``entry.record`` of its file; ``("param_shapes", i, ...)``: the names in those ``param_shapes``.

        Raises:
            MissingDataFileError, CorruptChunkError, UnsafeContentError: as their names say.
        """
        loaded = self._loaded.get(entry.relative_path)
        if loaded is None:
            loaded = self._loaded[entry.relative_path] = load_ds_file(Path(self.root), entry.relative_path, self.follow_symlinks)[
                0
            ]
        if entry.record[:1] == ("param_shapes",):  # a param group's parameter names, in order
            return [name for i in entry.record[1:] for name in local_value(loaded, ("param_shapes", i))]
        return local_value(loaded, entry.record)

    def read_raw(self, entry: BytesEntry) -> bytes:
        """The value as DCP stores a bytes entry: its torch.save payload."""
        buf = io.BytesIO()
        torch.save(self.read_value(entry), buf)
        return buf.getvalue()

    def close(self) -> None:
        """Drop the loaded files and close the data files."""
        self._loaded.clear()
        super().close()
