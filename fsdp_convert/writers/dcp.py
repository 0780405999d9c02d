"""DCP writer: the ``.metadata`` of a checkpoint folder laid out for a target world size, in DCP's own format.

Mirrors what ``torch.distributed.checkpoint.FileSystemWriter`` writes
(``torch/distributed/checkpoint/filesystem.py``): each rank's chunks are torch.save payloads in
``__<rank>_0.distcp`` (laid out by ``plan.reshard``, each a ``writers.torch_save`` one-tensor
payload), and ``.metadata`` is a pickled ``torch.distributed.checkpoint.metadata.Metadata``
naming every chunk's box and byte range. ``.metadata`` is written last, so a folder without it
is visibly incomplete.

``compress_data_files`` is a post-pass over rank files already written: it rewrites each payload
as a zstd stream of itself, as ``FileSystemWriter(_extensions=[ZStandard()])`` writes it (one
frame per payload, ``transform_descriptors=["stream.zstd/1"]``), since compressed sizes cannot be
laid out ahead.

``reshard``'s output kind, which finishes each DCP folder with ``write_metadata`` (after
``compress_data_files`` if asked), is ``outputs.DcpFolder``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fsdp_convert.dtypes import DType, as_dtype
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.formats.index import ObjPath, plain_path
from fsdp_convert.output_table import METADATA_FILENAME
from fsdp_convert.writers._dcp_pickle import (
    MetadataIndex,
    bytes_storage_metadata,
    chunk_storage_metadata,
    metadata_pickle,
    storage_info,
    tensor_storage_metadata,
)

__all__ = [
    "StoredChunk",
    "MetadataEntry",
    "Box",
    "write_metadata",
    "rank_filename",
    "ZSTD_DESCRIPTOR",
    "require_zstd",
    "compress_data_files",
]

ZSTD_DESCRIPTOR = "stream.zstd/1"  # torch's ZStandard().get_descriptor(), what FileSystemReader decodes
_COMPRESS_PIECE_BYTES = 4 << 20  # read from a rank file and fed to the compressor in pieces of this size


def rank_filename(rank: int) -> str:
    """``__<rank>_0.distcp``, the data file FileSystemWriter gives rank ``rank``."""
    return f"__{rank}_0.distcp"


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """Where one payload went: the entry, its box (``None`` for a bytes entry) and byte range.

    Attributes:
        fqn: the entry's flattened key.
        offsets: per-dimension start of the chunk in the global tensor, in elements; ``None``
            for a bytes entry.
        relative_path: the data file, relative to the checkpoint folder (``__0_0.distcp``).
        offset_bytes: where the payload starts in that file, in bytes.
        length_bytes: the payload's length, in bytes.
        transform_descriptors: stream transforms the payload went through, in DCP's order
            (``("stream.zstd/1",)`` after ``compress_data_files``); ``()`` for a bare torch.save zip.
    """

    fqn: str
    offsets: tuple[int, ...] | None
    relative_path: str
    offset_bytes: int
    length_bytes: int
    transform_descriptors: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready row (offsets as a list), as a worker records its rank file's payloads."""
        row: dict[str, Any] = {
            "fqn": self.fqn,
            "offsets": None if self.offsets is None else list(self.offsets),
            "relative_path": self.relative_path,
            "offset_bytes": self.offset_bytes,
            "length_bytes": self.length_bytes,
        }
        if self.transform_descriptors:
            row["transform_descriptors"] = list(self.transform_descriptors)
        return row

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> StoredChunk:
        """The record ``to_json`` wrote.

        Raises:
            KeyError, TypeError: a row ``to_json`` did not write.
        """
        offsets = row["offsets"]
        return cls(
            fqn=str(row["fqn"]),
            offsets=None if offsets is None else tuple(int(o) for o in offsets),
            relative_path=str(row["relative_path"]),
            offset_bytes=int(row["offset_bytes"]),
            length_bytes=int(row["length_bytes"]),
            transform_descriptors=tuple(str(d) for d in row.get("transform_descriptors", ())),
        )


class Box(Protocol):
    """A chunk's place in its global tensor, in elements (``plan.reshard.TargetChunk`` is one)."""

    @property
    def offsets(self) -> tuple[int, ...]:
        """Per-dimension start, in elements."""
        ...

    @property
    def sizes(self) -> tuple[int, ...]:
        """Per-dimension extent, in elements."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class MetadataEntry:
    """One entry of the ``.metadata`` to write.

    Attributes:
        fqn: the flattened key.
        path: its place in the nested state dict (``planner_data``).
        dtype: the tensor's element type (a ``torch.dtype`` is taken too); ``None`` for a bytes entry.
        shape: the global shape, in elements; ``None`` for a bytes entry.
        chunks: the tensor's stored chunks (ignored for a bytes entry).
    """

    fqn: str
    path: ObjPath
    dtype: DType | None
    shape: tuple[int, ...] | None
    chunks: Sequence[Box]


def write_metadata(folder: Path, entries: Sequence[MetadataEntry], stored: Sequence[StoredChunk], version: str | None) -> None:
    """Write ``.metadata`` for the stored chunks, last, and fsync it. Rank 0 only.

    The bytes are ``pickle.dump`` of torch's ``Metadata`` of these entries, written without
    importing torch (``writers._dcp_pickle``); its ``storage_meta.save_id`` is a new uuid4.

    Args:
        folder: the output folder.
        entries: every entry, in order.
        stored: every payload written, from all rank files.
        version: DCP metadata version to record (the source's).

    Raises:
        FileExistsError: ``.metadata`` is already there.
    """
    state_dict_metadata: dict[str, Any] = {}
    for e in entries:
        if e.dtype is None or e.shape is None:
            state_dict_metadata[e.fqn] = bytes_storage_metadata()
        else:
            chunks = [chunk_storage_metadata(c.offsets, c.sizes) for c in e.chunks]
            state_dict_metadata[e.fqn] = tensor_storage_metadata(as_dtype(e.dtype).name, e.shape, chunks)
    storage_data = {
        # transform_descriptors None when there are none, as FileSystemWriter leaves it
        MetadataIndex(c.fqn, c.offsets): storage_info(
            c.relative_path, c.offset_bytes, c.length_bytes, list(c.transform_descriptors) or None
        )
        for c in stored
    }
    raw = metadata_pickle(
        state_dict_metadata=state_dict_metadata,
        planner_data={e.fqn: plain_path(e.path) for e in entries},
        storage_data=storage_data,
        save_id=str(uuid.uuid4()),
        version=version or "1.0.0",
    )
    with open(folder / METADATA_FILENAME, "xb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def require_zstd() -> None:
    """Check that ``compress_data_files`` can run (call before any data is read).

    Raises:
        InvalidOptionError: the ``zstandard`` package is not installed; names the extra to install.
    """
    _zstandard()


def _zstandard() -> Any:
    try:
        return importlib.import_module("zstandard")
    except ImportError as e:
        raise InvalidOptionError(
            "zstd compression needs the zstandard package, which is not installed: pip install 'fsdp-convert[zstd]'"
        ) from e


def compress_data_files(folder: Path, stored: Sequence[StoredChunk], *, level: int = 3, threads: int = 1) -> list[StoredChunk]:
    """Rewrite each data file's payloads as zstd streams, as ``FileSystemWriter(_extensions=[ZStandard()])`` would.

    Each data file named in ``stored`` is read payload by payload, in file order, and each
    payload (the torch.save zip at ``[offset_bytes, offset_bytes + length_bytes)``) becomes one
    zstd frame (``zstandard.ZstdCompressor(level).stream_writer``, as torch's ``ZStandard.transform_to``)
    in a new sibling file, which then replaces the data file (fsynced, ``os.replace``). Bytes
    no payload covers (padding) are dropped. Rank 0 only, once every rank file is complete and
    before ``.metadata`` is written; call ``write_metadata`` with the rows returned, so torch's
    ``FileSystemReader`` (``dcp.load``) decodes every payload.

    Memory: per file being compressed, one piece of 4 MiB and the compressor's window (a few MiB
    at level 3), whatever the payload sizes. Disk: each data file and its compressed copy, one
    file at a time per thread.

    Args:
        folder: the folder holding the data files (``relative_path`` is relative to it).
        stored: every payload written, as for ``write_metadata``; none may be transformed already.
        level: zstd compression level (torch's ``ZStandard`` uses zstandard's default, 3).
        threads: data files compressed at once (zstandard releases the GIL while compressing).

    Returns:
        The rows of ``stored``, in the same order, with their new ``offset_bytes`` and
        ``length_bytes`` and ``transform_descriptors=("stream.zstd/1",)``.

    Raises:
        InvalidOptionError: the ``zstandard`` package is not installed.
        ValueError: a row is stream-transformed already.
        OSError: a data file cannot be read or its compressed copy written.
    """
    zstandard = _zstandard()
    if any(c.transform_descriptors for c in stored):
        raise ValueError("compress_data_files takes payloads not yet stream-transformed")
    by_file: dict[str, list[int]] = {}
    for i, chunk in enumerate(stored):
        by_file.setdefault(chunk.relative_path, []).append(i)
    out: list[StoredChunk | None] = [None] * len(stored)

    def compress_file(relative_path: str) -> None:
        rows = sorted(by_file[relative_path], key=lambda i: stored[i].offset_bytes)
        placed = _compress_file(zstandard, level, folder / relative_path, [stored[i] for i in rows])
        for i, chunk in zip(rows, placed, strict=True):
            out[i] = chunk

    if threads <= 1:
        for name in by_file:
            compress_file(name)
    else:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fsdp-convert-zstd") as pool:
            list(pool.map(compress_file, by_file))
    return [c for c in out if c is not None]


def _compress_file(zstandard: Any, level: int, path: Path, rows: list[StoredChunk]) -> list[StoredChunk]:
    """Compress ``rows`` (sorted by offset) of ``path`` into a sibling file that then replaces it."""
    tmp = path.with_name(f".{path.name}.zstd-tmp")
    compressor = zstandard.ZstdCompressor(level=level)
    placed = []
    src = os.open(path, os.O_RDONLY)
    try:
        with open(tmp, "xb") as dst:
            buffer = bytearray(_COMPRESS_PIECE_BYTES)
            for row in rows:
                start = dst.tell()
                writer = compressor.stream_writer(dst, closefd=False)
                done = 0
                while done < row.length_bytes:
                    view = memoryview(buffer)[: min(len(buffer), row.length_bytes - done)]
                    got = os.preadv(src, [view], row.offset_bytes + done)
                    if got != len(view):
                        raise OSError(
                            f"{path}: short read at byte {row.offset_bytes + done}; the file changed while it was compressed"
                        )
                    writer.write(view)
                    done += got
                writer.close()  # ends the frame; closefd=False leaves dst open
                placed.append(
                    dataclasses.replace(
                        row, offset_bytes=start, length_bytes=dst.tell() - start, transform_descriptors=(ZSTD_DESCRIPTOR,)
                    )
                )
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(src)
    return placed
