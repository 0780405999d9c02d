"""A checkpoint whose format is decided: ``Source`` (format row + index), the ``Reader`` every format offers.

``formats.open_checkpoint`` decides a path's format once and returns a ``Source``; operations,
movers and workers take it and read through ``Source.open_reader()``, so nothing decides a format
twice. Picklable: its format row travels by name (``SourceFormat.__reduce__``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from fsdp_convert.errors import CorruptChunkError, MissingDataFileError
from fsdp_convert.formats.index import Url
from fsdp_convert.held_roots import following_symlinks, open_inside
from fsdp_convert.remote import size_of

if TYPE_CHECKING:
    import torch

    from fsdp_convert.formats.index import BytesEntry, CheckpointIndex, ChunkEntry, Location, TensorEntry
    from fsdp_convert.formats.reader import StoredBytes

__all__ = ["Reader", "Source", "SourceFormat", "SourceFormatName", "check_data_files"]

SourceFormatName = str  # a row's name in formats.FORMATS (the table is the one list of them)


class Reader(Protocol):
    """What every source format's reader offers: chunks, full tensors, boxes and values of its index.

    Shapes and offsets are in elements; tensors come back on CPU in the entry's dtype. Use as a
    context manager; one reader per thread.
    """

    def read_chunk(self, entry: TensorEntry, chunk: ChunkEntry) -> torch.Tensor:
        """One stored chunk of ``entry``: shape ``chunk.sizes``, dtype ``entry.dtype``."""
        ...

    def read_tensor(self, entry: TensorEntry) -> torch.Tensor:
        """The full tensor of ``entry``, contiguous, shape ``entry.shape``."""
        ...

    def locate(self, entry: TensorEntry, chunk: ChunkEntry) -> StoredBytes | None:
        """Where ``chunk``'s elements lie in its data file, to move them undecoded; None to use ``read_chunk``."""
        ...

    def read_box(self, entry: TensorEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box ``[offsets, offsets + sizes)`` of ``entry``, contiguous, shape ``sizes``."""
        ...

    def read_value(self, entry: BytesEntry) -> Any:
        """The plain Python value of a bytes entry."""
        ...

    def read_raw(self, entry: BytesEntry) -> bytes:
        """A bytes entry as DCP stores it: a torch.save payload."""
        ...

    def close(self) -> None:
        """Release open files."""
        ...

    def __enter__(self) -> Reader: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None: ...


@dataclass(frozen=True, slots=True)
class SourceFormat:
    """One row of the source format table: how a path of the format is recognised, indexed and read.

    A row pickles by name and unpickles as the same row of ``FORMATS`` (a ``Source`` travels to
    workers in jobs).

    Attributes:
        name: ``dcp``, ``rank_files``, ``hf_storage`` or ``full_file``.
        detect: True when a path (``remote.as_location``) holds this format, from file names
            (and safetensors headers) alone; asked in table order, the first yes wins.
        read_index: the ``CheckpointIndex`` of such a path (``read_index(location)``; the DeepSpeed row
            also takes ``weights=``, see ``open_checkpoint``); no tensor data is read.
        reader: the format's ``Reader`` class, called as ``reader(checkpoint_id, check_crc=...)``.
        full: a full (unsharded) checkpoint, asked only when full files are accepted.
    """

    name: SourceFormatName
    detect: Callable[[Location], bool]
    read_index: Callable[..., CheckpointIndex]
    reader: Callable[..., Reader]
    full: bool = False

    def __reduce__(self) -> tuple[Callable[[str], SourceFormat], tuple[str]]:
        return _format_named, (self.name,)

    def open(self, root: Location, *, check_crc: bool = True, follow_symlinks: bool | None = None) -> Source:
        """Read the index of ``root`` as this format, without detecting it again.

        Args:
            root: a path of this format (``remote.as_location``: a local ``Path`` or a ``Url``).
            check_crc: as for ``Source``.
            follow_symlinks: as for ``read_index``; the ``Source`` keeps it for its readers.

        Raises:
            As ``read_index``.
        """
        with following_symlinks(follow_symlinks):
            index = self.read_index(root)
        return Source(format=self, index=index, check_crc=check_crc, follow_symlinks=follow_symlinks)


def _format_named(name: str) -> SourceFormat:
    """The row of ``formats.FORMATS`` called ``name`` (a row unpickles as the table's own)."""
    table = importlib.import_module("fsdp_convert.formats")  # the table sits above the rows it holds
    row: SourceFormat = table.source_format_named(name)
    return row


@dataclass(frozen=True, slots=True)
class Source:
    """A checkpoint whose format is decided and whose index is read: what operations, movers and workers take.

    Picklable (it travels to workers in jobs): its format by name, its index as data.

    Attributes:
        format: its row of the format table (``FORMATS``).
        index: its index (``formats.index.CheckpointIndex``).
        check_crc: readers check the CRC-32s the format stores (DCP payloads' zip records) on every read.
        follow_symlinks: readers read files that symbolic links lead to outside the checkpoint;
            None: the process's setting (``location.following_symlinks``) where the reader is made.
    """

    format: SourceFormat
    index: CheckpointIndex
    check_crc: bool = True
    follow_symlinks: bool | None = None

    @property
    def checkpoint_id(self) -> Location:
        """Where the checkpoint is (its index's ``checkpoint_id``)."""
        return self.index.checkpoint_id

    def open_reader(self) -> Reader:
        """A reader of this checkpoint's bytes, of its format's reader class (one per thread; close it, or use ``with``).

        Raises:
            As the format's reader; for a full file, as ``formats.full_file.open_full_file``.
        """
        with following_symlinks(self.follow_symlinks):
            return self.format.reader(self.index.checkpoint_id, check_crc=self.check_crc)

    def check_data_files(self) -> None:
        """Check that every data file the index names exists, is readable, and lies inside the checkpoint.

        Raises:
            MissingDataFileError: naming the first missing or unreadable file.
            UnsafeContentError: a data file is a symbolic link out of the checkpoint (``location.open_inside``).
        """
        check_data_files(self.index, follow_symlinks=self.follow_symlinks)


def check_data_files(index: CheckpointIndex, *, follow_symlinks: bool | None = None) -> None:
    """Check that every data file the index names exists, is readable, and lies inside the checkpoint.

    Args:
        index: the checkpoint's index.
        follow_symlinks: as for ``read_index``.

    Raises:
        MissingDataFileError: naming the first missing or unreadable file.
        UnsafeContentError: a data file is a symbolic link out of the checkpoint (``location.open_inside``).
    """
    for name in index.data_files:
        path = index.checkpoint_id / name
        if isinstance(path, Url):
            if size_of(path) is None:
                raise MissingDataFileError(f"{path} is missing; .metadata names it as a data file")
            continue
        try:  # opened as the readers open it (location.open_inside), not checked by name
            os.close(open_inside(Path(index.checkpoint_id), path, follow_symlinks=follow_symlinks))
        except PermissionError as e:
            raise MissingDataFileError(f"{path} is not readable (permission denied)") from e
        except (OSError, CorruptChunkError) as e:  # gone, or not a regular file
            raise MissingDataFileError(f"{path} is missing; .metadata names it as a data file") from e
