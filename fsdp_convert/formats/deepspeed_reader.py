"""DeepSpeed ZeRO checkpoints, reading: a save's chunks as bare byte ranges of its partitions, its values by record.

``formats/deepspeed.py`` indexes the save (each chunk one byte range of a partition, each value a
record path in a model or optimizer states file); this reads them, without torch: a value holding a
tensor or a ``torch.Size`` is read from its file loaded with torch's loader, as torch's objects.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from fsdp_convert.formats._ds_records import holds_records
from fsdp_convert.formats._records import local_value
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
        self._loaded: dict[tuple[str, bool], Any] = {}  # (file, with torch) -> its object

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
        value = self._value(entry, use_torch=False)
        return self._value(entry, use_torch=True) if holds_records(value) else value

    def _value(self, entry: BytesEntry, use_torch: bool) -> Any:
        key = (entry.relative_path, use_torch)
        loaded = self._loaded.get(key)
        if loaded is None:
            root = Path(self.root)
            loaded = self._loaded[key] = load_ds_file(root, entry.relative_path, self.follow_symlinks, use_torch=use_torch)[0]
        if entry.record[:1] == ("param_shapes",):  # a param group's parameter names, in order
            return [name for i in entry.record[1:] for name in local_value(loaded, ("param_shapes", i))]
        return local_value(loaded, entry.record)

    def read_raw(self, entry: BytesEntry) -> bytes:
        """The value as DCP stores a bytes entry: its torch.save payload."""
        import torch

        buf = io.BytesIO()
        torch.save(self.read_value(entry), buf)
        return buf.getvalue()

    def close(self) -> None:
        """Drop the loaded files and close the data files."""
        self._loaded.clear()
        super().close()
