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

``FORMATS`` is the one ordered table of source formats (each row a ``source.SourceFormat``:
``detect``, ``read_index``, its ``Reader`` class); ``open_checkpoint`` is the one place that decides
what a path is: it returns a ``source.Source`` (format row + index) that operations, movers and
workers take, so nothing detects a format twice. Submodules are imported where used, so that importing ``formats.index`` loads
nothing else.

Every local file a format opens is checked to lie inside the checkpoint (``location.open_inside``):
a symbolic link out of it is refused unless ``follow_symlinks=True`` (the CLI's
``--follow-symlinks``) or the process's ``location.following_symlinks`` setting allows it.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_convert.errors import InvalidOptionError, NotADcpCheckpointError
from fsdp_convert.formats.source import Reader, Source, SourceFormat, SourceFormatName, check_data_files
from fsdp_convert.held_roots import following_symlinks
from fsdp_convert.output_table import DCP_ROW, METADATA_FILENAME
from fsdp_convert.remote import as_location

if TYPE_CHECKING:
    from fsdp_convert.formats.index import CheckpointIndex, Location

__all__ = [
    "FORMATS",
    "Reader",
    "Source",
    "SourceFormat",
    "SourceFormatName",
    "check_data_files",
    "check_not_one_dcp_file",
    "detect_format",
    "open_checkpoint",
    "open_reader",
    "read_index",
    "source_format",
    "source_format_named",
]


_DCP_FILE = re.compile("|".join(f"(?:{p})" for p in DCP_ROW.files))  # .metadata, __<rank>_<n>.distcp


def check_not_one_dcp_file(root: Location) -> None:
    """Refuse a local file that is one file of a DCP folder (``.metadata``, ``__<rank>_<n>.distcp``) or a DeepSpeed save.

    Reads no file (its name and that it is a file); a URL is left alone. The command line's
    precheck (``cli._precheck.check_checkpoint``) calls it before torch is imported.

    Raises:
        NotADcpCheckpointError: ``root`` (``remote.as_location``'s) is such a file, naming the folder to pass (exit 3).
    """
    if isinstance(root, Path) and _DCP_FILE.fullmatch(root.name) and root.is_file():
        folder = root.parent
        raise NotADcpCheckpointError(f"{root} is one file of the DCP checkpoint {folder}: pass the folder {folder}")
    from fsdp_convert.formats.deepspeed_files import is_deepspeed_file  # a name test; imports no torch

    if isinstance(root, Path) and is_deepspeed_file(root.name) and root.is_file():
        folder = root.parent
        raise NotADcpCheckpointError(f"{root} is one file of the DeepSpeed save {folder}: pass the folder {folder}")


def _lazy(module: str, attr: str) -> Callable[..., Any]:
    """``module.attr`` called, the module imported on the first call (importing ``formats`` loads no format)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    return call


def _is_local_dir(root: Location) -> bool:
    return isinstance(root, Path) and root.is_dir()


def _is_dcp(root: Location) -> bool:
    """A remote URL, a path that is no folder, a folder with ``.metadata`` or with DCP folders inside (accelerate's)."""
    from fsdp_convert.formats.dcp import metadata_subfolders

    if not isinstance(root, Path) or not root.is_dir() or (root / METADATA_FILENAME).is_file():
        return True
    return bool(metadata_subfolders(root))


def _has_rank_files(root: Location) -> bool:
    from fsdp_convert.formats.rank_files import find_rank_files

    return isinstance(root, Path) and root.is_dir() and bool(find_rank_files(root))


def _has_sharding_info(root: Location) -> bool:
    from fsdp_convert.formats.hf_storage import has_sharding_info

    return isinstance(root, Path) and root.is_dir() and has_sharding_info(root)


def _is_deepspeed(root: Location) -> bool:
    from fsdp_convert.formats.deepspeed_files import is_deepspeed

    return is_deepspeed(root)


def _is_full_checkpoint(root: Location) -> bool:
    from fsdp_convert.formats.full_file import is_full_checkpoint

    return is_full_checkpoint(root)


_DCP, _RANK, _HF, _FULL, _DS = (
    f"fsdp_convert.formats.{m}" for m in ("dcp", "rank_files", "hf_storage", "full_file", "deepspeed")
)

# The source formats, in the order a path is tried; a path none claims is read as DCP, whose
# reader names what is wrong with it.
FORMATS: tuple[SourceFormat, ...] = (
    SourceFormat("full_file", _is_full_checkpoint, _lazy(_FULL, "file_index"), _lazy(_FULL, "FileBoxReader"), full=True),
    SourceFormat("deepspeed", _is_deepspeed, _lazy(_DS, "deepspeed_index"), _lazy(f"{_DS}_reader", "DeepSpeedReader")),
    SourceFormat("dcp", _is_dcp, _lazy(_DCP, "read_dcp_index"), _lazy(_DCP, "DcpReader")),
    SourceFormat("rank_files", _has_rank_files, _lazy(_RANK, "rank_files_index"), _lazy(_RANK, "RankFilesReader")),
    SourceFormat("hf_storage", _has_sharding_info, _lazy(_HF, "describe_safetensors_dcp"), _lazy(_HF, "HfStorageReader")),
)
_FALLBACK = next(f for f in FORMATS if f.name == "dcp")


def source_format_named(name: str) -> SourceFormat:
    """The row of ``FORMATS`` called ``name``.

    Raises:
        KeyError: no such format.
    """
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise KeyError(name)


def source_format(checkpoint_id: str | os.PathLike[str] | Location, *, full_files: bool = False) -> SourceFormat:
    """The first row of ``FORMATS`` whose ``detect`` claims the path, else DCP's (whose reader names what is wrong).

    Args:
        checkpoint_id: a local path or fsspec URL.
        full_files: also try the full-file format (a local file, a Hugging Face or PEFT folder).

    Raises:
        NotADcpCheckpointError: the folder cannot be listed, or holds rank files of two saves.
        MissingDataFileError: a rank file is missing.
    """
    return _format_of(as_location(checkpoint_id), full_files)


def _format_of(root: Location, full_files: bool) -> SourceFormat:
    """``source_format`` of a path already made a ``Location``."""
    return next((f for f in FORMATS if (full_files or not f.full) and f.detect(root)), _FALLBACK)


def detect_format(checkpoint_id: str | os.PathLike[str], *, full_files: bool = False) -> SourceFormatName:
    """The name of the source format a path holds (``source_format(...).name``).

    With ``full_files``, a local file or a Hugging Face or PEFT folder (no ``.metadata``; see
    ``full_file.is_hf_folder``) is ``full_file``. Otherwise a remote URL, a folder
    with ``.metadata`` or with DCP folders inside is ``dcp`` (whose reader also names what is
    wrong with any other path); a folder of ``*rank*.pt`` files is ``rank_files``; one of
    safetensors files carrying DCP sharding info is ``hf_storage``.

    Raises:
        As ``source_format``.
    """
    return source_format(checkpoint_id, full_files=full_files).name


def open_checkpoint(
    checkpoint_id: Location,
    *,
    full_files: bool = False,
    check_crc: bool = True,
    follow_symlinks: bool | None = None,
    weights: str = "master",
) -> Source:
    """The one place a path's format is decided: its row of ``FORMATS``, and its index read as that format.

    Args:
        checkpoint_id: a DCP folder (local or fsspec URL, as ``remote.as_location`` makes it from
            what the user gave), accelerate's checkpoint folder, a folder of per-rank torch.save
            files, or of ``HuggingFaceStorageWriter`` shards.
        full_files: also take a full checkpoint (``formats.full_file.file_index``: one chunk
            per tensor, no data files); otherwise such a path is refused as not a DCP checkpoint.
        check_crc: the readers check the CRC-32s the format stores (``Source.check_crc``).
        follow_symlinks: read files that symbolic links in the folder lead to outside it (a
            checkpoint whose files link into a shared store); None: the process's setting
            (``location.following_symlinks``, default off). The ``Source`` keeps it for its readers.
        weights: ``module``: a DeepSpeed save's model as its module's own weights (``formats.deepspeed``);
            ``master`` (default): every format's own model.

    Returns:
        The checkpoint's ``Source``: format, index; ``open_reader()`` reads its bytes.

    Raises:
        CheckpointNotFoundError: the path does not exist.
        NotADcpCheckpointError: one file of a DCP folder (``check_not_one_dcp_file``); none of the
            above, or a malformed index (the message says which).
        UnsafeContentError: ``.metadata`` or a rank file would run code when unpickled, or a file
            it reads is a symbolic link out of the folder (and links are not followed).
        MissingDataFileError, CorruptChunkError: a rank file or safetensors header is missing or broken.
    """
    check_not_one_dcp_file(checkpoint_id)
    with following_symlinks(follow_symlinks):
        fmt = _format_of(checkpoint_id, full_files)
        if weights != "master" and fmt.name != "deepspeed":
            raise InvalidOptionError(f"--weights {weights}: {checkpoint_id} is not a DeepSpeed save; only one keeps two copies")
        index = fmt.read_index(checkpoint_id, weights=weights) if weights != "master" else fmt.read_index(checkpoint_id)
    return Source(format=fmt, index=index, check_crc=check_crc, follow_symlinks=follow_symlinks)


def read_index(
    checkpoint_id: str | os.PathLike[str], *, full_files: bool = False, follow_symlinks: bool | None = None
) -> CheckpointIndex:
    """The ``CheckpointIndex`` of a checkpoint of any source format (``open_checkpoint(...).index``).

    Args:
        checkpoint_id: as for ``open_checkpoint``.
        full_files: as for ``open_checkpoint``.
        follow_symlinks: as for ``open_checkpoint``.

    Raises:
        As ``open_checkpoint``.
    """
    return open_checkpoint(as_location(checkpoint_id), full_files=full_files, follow_symlinks=follow_symlinks).index


def open_reader(
    checkpoint_id: str | os.PathLike[str] | Location,
    *,
    check_crc: bool = True,
    full_files: bool = True,
    follow_symlinks: bool | None = None,
) -> Reader:
    """A reader for the checkpoint at ``checkpoint_id``, of the format ``source_format`` finds; reads no index.

    For a path whose ``Source`` is at hand, ``Source.open_reader`` reads without detecting again.

    Args:
        checkpoint_id: as for ``open_checkpoint``.
        check_crc: check the CRC-32s the format stores (DCP payloads' zip records) on every read.
        full_files: as for ``open_checkpoint``; by default a full file is read as one.
        follow_symlinks: as for ``open_checkpoint``; the reader keeps the setting it was made with.

    Raises:
        As ``source_format``; for a full file, as ``formats.full_file.open_full_file``.
    """
    with following_symlinks(follow_symlinks):
        return source_format(checkpoint_id, full_files=full_files).reader(checkpoint_id, check_crc=check_crc)
