"""Read side: one module per source format, each owning its index and its reads; this decides which.

As torch's storage readers do (``torch/distributed/checkpoint/filesystem.py`` ``FileSystemReader``:
``read_metadata`` + ``read_data``; ``hf_storage.py``), each source format is one module that
builds a ``CheckpointIndex`` (``formats/index.py``, the data model, no I/O) and reads its bytes:

- ``dcp``: a DCP folder (``.metadata`` + ``__<rank>_<n>.distcp``), local or remote, or
  accelerate's parent folder of two DCP folders;
- ``rank_files``: one torch.save file of a sharded state dict per rank (verl, FSDP1);
- ``hf_storage``: torch's ``HuggingFaceStorageWriter`` safetensors shards;
- ``full_file``: a full (unsharded) checkpoint: one torch.save or safetensors file (told apart by
  their first bytes, whatever the name), or a Hugging Face or PEFT folder: every output of
  ``consolidate``, which ``consolidate``, ``reshard`` and ``verify`` take besides the sharded formats.

``open_checkpoint`` is the one place that decides what a path is. Submodules are imported where
used, so that importing ``formats.index`` loads nothing else.

Every local file a format opens is checked to lie inside the checkpoint (``location.inside``):
a symbolic link out of it is refused unless ``follow_symlinks=True`` (the CLI's
``--follow-symlinks``) or the process's ``location.following_symlinks`` setting allows it.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol

from fsdp_convert.constants import METADATA_FILENAME
from fsdp_convert.errors import MissingDataFileError
from fsdp_convert.location import following_symlinks, inside

if TYPE_CHECKING:
    import torch

    from fsdp_convert.formats.index import BytesEntry, CheckpointIndex, ChunkEntry, Location, TensorEntry
    from fsdp_convert.formats.reader import StoredBytes

__all__ = ["Reader", "SourceFormat", "detect_format", "read_index", "open_reader", "open_checkpoint", "check_data_files"]

SourceFormat = Literal["dcp", "rank_files", "hf_storage", "full_file"]


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


def detect_format(checkpoint_id: str | os.PathLike[str], *, full_files: bool = False) -> SourceFormat:
    """Which source format a path holds, from its file names (and safetensors headers) alone.

    With ``full_files``, a local file or a Hugging Face or PEFT folder (no ``.metadata``; see
    ``full_file.is_hf_folder``) is ``full_file``. Otherwise a remote URL, a folder
    with ``.metadata`` or with DCP folders inside is ``dcp`` (whose reader also names what is
    wrong with any other path); a folder of ``*rank*.pt`` files is ``rank_files``; one of
    safetensors files carrying DCP sharding info is ``hf_storage``.

    Raises:
        NotADcpCheckpointError: the folder cannot be listed, or holds rank files of two saves.
        MissingDataFileError: a rank file is missing.
    """
    from fsdp_convert.formats import dcp, full_file, hf_storage, rank_files
    from fsdp_convert.remote import as_location

    root = as_location(checkpoint_id)
    if full_files and full_file.is_full_checkpoint(root):
        return "full_file"
    if not isinstance(root, Path) or not root.is_dir() or (root / METADATA_FILENAME).is_file():
        return "dcp"
    if dcp.metadata_subfolders(root):
        return "dcp"
    if rank_files.find_rank_files(root):
        return "rank_files"
    if hf_storage.has_sharding_info(root):
        return "hf_storage"
    return "dcp"


def read_index(
    checkpoint_id: str | os.PathLike[str], *, full_files: bool = False, follow_symlinks: bool | None = None
) -> CheckpointIndex:
    """The ``CheckpointIndex`` of a checkpoint of any source format; no tensor data is read.

    Args:
        checkpoint_id: a DCP folder (local or fsspec URL), accelerate's checkpoint folder, a
            folder of per-rank torch.save files, or of ``HuggingFaceStorageWriter`` shards.
        full_files: also take a full checkpoint (``formats.full_file.file_index``: one chunk
            per tensor, no data files); otherwise such a path is refused as not a DCP checkpoint.
        follow_symlinks: read files that symbolic links in the folder lead to outside it (a
            checkpoint whose files link into a shared store); None: the process's setting
            (``location.following_symlinks``, default off).

    Raises:
        CheckpointNotFoundError: the path does not exist.
        NotADcpCheckpointError: none of the above, or a malformed index (the message says which).
        UnsafeContentError: ``.metadata`` or a rank file would run code when unpickled, or a file
            it reads is a symbolic link out of the folder (and links are not followed).
        MissingDataFileError, CorruptChunkError: a rank file or safetensors header is missing or broken.
    """
    with following_symlinks(follow_symlinks):
        return _read_index(checkpoint_id, full_files=full_files)


def _read_index(checkpoint_id: str | os.PathLike[str], *, full_files: bool) -> CheckpointIndex:
    from fsdp_convert.formats import dcp, full_file, hf_storage, rank_files
    from fsdp_convert.remote import as_location

    fmt = detect_format(checkpoint_id, full_files=full_files)
    root = as_location(checkpoint_id)
    if fmt == "full_file":
        return full_file.file_index(root)
    if fmt == "rank_files" and isinstance(root, Path):
        return rank_files.rank_files_index(root)
    if fmt == "hf_storage" and isinstance(root, Path):
        return hf_storage.describe_safetensors_dcp(root)
    return dcp.read_dcp_index(checkpoint_id)


def open_reader(
    checkpoint_id: str | os.PathLike[str] | Location,
    *,
    check_crc: bool = True,
    full_files: bool = True,
    follow_symlinks: bool | None = None,
) -> Reader:
    """A reader for the checkpoint at ``checkpoint_id``, of the format ``detect_format`` finds.

    Opens nothing until the first read (a full file: its header or pickle); workers call this
    with the path the index was read from, so whatever ``read_index`` accepted is read.

    Args:
        checkpoint_id: as for ``read_index``.
        check_crc: check the CRC-32s the format stores (DCP payloads' zip records) on every read.
        full_files: as for ``read_index``; by default a full file is read as one (``read_index``
            has already decided whether it is accepted).
        follow_symlinks: as for ``read_index``; the reader keeps the setting it was made with.

    Raises:
        As ``detect_format``; for a full file, as ``formats.full_file.open_full_file``.
    """
    with following_symlinks(follow_symlinks):
        return _open_reader(checkpoint_id, check_crc=check_crc, full_files=full_files)


def _open_reader(checkpoint_id: str | os.PathLike[str] | Location, *, check_crc: bool, full_files: bool) -> Reader:
    from fsdp_convert.formats import dcp, full_file, hf_storage, rank_files

    fmt = detect_format(checkpoint_id, full_files=full_files)
    if fmt == "full_file":
        return full_file.FileBoxReader(checkpoint_id, check_crc=check_crc)
    if fmt == "rank_files":
        return rank_files.RankFilesReader(checkpoint_id, check_crc=check_crc)
    if fmt == "hf_storage":
        return hf_storage.HfStorageReader(checkpoint_id, check_crc=check_crc)
    return dcp.DcpReader(checkpoint_id, check_crc=check_crc)


def open_checkpoint(
    checkpoint_id: str | os.PathLike[str],
    *,
    check_crc: bool = True,
    full_files: bool = False,
    follow_symlinks: bool | None = None,
) -> tuple[CheckpointIndex, Reader]:
    """The index of a checkpoint and a reader of its bytes (close the reader, or use it in ``with``).

    Args:
        checkpoint_id: as for ``read_index``.
        check_crc: as for ``open_reader``.
        full_files: as for ``read_index``.
        follow_symlinks: as for ``read_index``.

    Raises:
        As ``read_index`` and ``open_reader``.
    """
    index = read_index(checkpoint_id, full_files=full_files, follow_symlinks=follow_symlinks)
    return index, open_reader(index.checkpoint_id, check_crc=check_crc, full_files=full_files, follow_symlinks=follow_symlinks)


def check_data_files(index: CheckpointIndex, *, follow_symlinks: bool | None = None) -> None:
    """Check that every data file the index names exists, is readable, and lies inside the checkpoint.

    Args:
        index: the checkpoint's index.
        follow_symlinks: as for ``read_index``.

    Raises:
        MissingDataFileError: naming the first missing or unreadable file.
        UnsafeContentError: a data file is a symbolic link out of the checkpoint (``location.inside``).
    """
    from fsdp_convert.formats.index import Url
    from fsdp_convert.remote import size_of

    for name in index.data_files:
        path = index.checkpoint_id / name
        if isinstance(path, Url):
            if size_of(path) is None:
                raise MissingDataFileError(f"{path} is missing; .metadata names it as a data file")
            continue
        inside(Path(index.checkpoint_id), path, follow_symlinks=follow_symlinks)
        if not path.is_file():
            raise MissingDataFileError(f"{path} is missing; .metadata names it as a data file")
        if not os.access(path, os.R_OK):
            raise MissingDataFileError(f"{path} is not readable (permission denied)")
