"""Index stage, DCP: unpickle a ``.metadata`` safely and check it into a ``CheckpointIndex``; no tensor I/O.

The file is a pickled ``torch.distributed.checkpoint.metadata.Metadata`` (written by
``FileSystemWriter.finish``). torch reads it with plain ``pickle.load``, which runs whatever the
file says; here a restricted unpickler admits only the DCP metadata classes, ``torch.Size``, torch
dtypes and layouts, paths and plain values, and every field is type-checked after loading.
"""

from __future__ import annotations

import io
import math
import os
import pathlib
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata

from fsdp_convert._torch import MEM_FORMAT_ENCODING, StorageInfo, torch_layout
from fsdp_convert.constants import METADATA_FILENAME, SUPPORTED_DTYPES
from fsdp_convert.errors import (
    NotADcpCheckpointError,
    UnsafeContentError,
)
from fsdp_convert.formats._dcp_payloads import BOTH_OPTIONS_HINT, ReadAt, SizeOf, is_raw_chunk, place_raw_chunks
from fsdp_convert.formats.index import (
    BytesEntry,
    CheckpointIndex,
    ChunkEntry,
    Entry,
    Location,
    ObjPath,
    TensorEntry,
)

__all__ = ["load_metadata", "metadata_from_bytes", "build_index"]


# --- restricted unpickling ----------------------------------------------------------------------

_ALLOWED_CLASSES: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", cls.__name__): cls
    for cls in (
        dcp_metadata.Metadata,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
        MEM_FORMAT_ENCODING,
    )
}
_ALLOWED_CLASSES[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = StorageInfo
_ALLOWED_CLASSES[("torch", "Size")] = torch.Size
_ALLOWED_CLASSES[("collections", "OrderedDict")] = __import__("collections").OrderedDict
for _cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath, pathlib.Path):
    _ALLOWED_CLASSES[("pathlib", _cls.__name__)] = _cls


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only allow-listed globals; anything else is UnsafeContentError."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_CLASSES:
            return _ALLOWED_CLASSES[(module, name)]
        if module == "torch.serialization" and name == "_get_layout":
            return torch_layout  # torch pickles a layout as torch.serialization._get_layout("torch.strided")
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeContentError(f"refusing global {module}.{name}")


def _restricted_loads(data: bytes) -> Any:
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def load_metadata(path: str | os.PathLike[str]) -> dcp_metadata.Metadata:
    """Unpickle a ``.metadata`` file with the restricted unpickler.

    Args:
        path: the ``.metadata`` file.

    Returns:
        The ``torch.distributed.checkpoint.metadata.Metadata`` object, type-checked at the top.

    Raises:
        UnsafeContentError: the pickle names a global outside the allow-list.
        NotADcpCheckpointError: the file is not a readable pickle of ``Metadata``.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise NotADcpCheckpointError(f"cannot read {path}: {e.strerror}") from e
    return metadata_from_bytes(data, path)


def metadata_from_bytes(data: bytes, path: str | os.PathLike[str]) -> dcp_metadata.Metadata:
    """``load_metadata`` of bytes already read (a remote ``.metadata``); ``path`` names it in errors.

    Raises:
        As ``load_metadata``.
    """
    try:
        obj = _restricted_loads(data)
    except UnsafeContentError as e:
        raise UnsafeContentError(f"{path}: {e}; not loading it (it would run code)") from e
    except Exception as e:  # any malformed pickle: EOF, bad opcode, wrong constructor args
        raise NotADcpCheckpointError(f"{path} is not a readable DCP metadata file ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dcp_metadata.Metadata):
        raise NotADcpCheckpointError(f"{path} holds a {type(obj).__name__}, not DCP Metadata")
    return obj


# --- conversion to the index --------------------------------------------------------------------


def _bad(path: Location, what: str) -> NotADcpCheckpointError:
    return NotADcpCheckpointError(f"{path}: {what}")


def _int_tuple(value: Any, meta_path: Location, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise _bad(meta_path, f"{what} is not a sequence of non-negative ints: {value!r}")
    return tuple(value)


def _storage_fields(info: Any, meta_path: Location, fqn: str) -> tuple[str, int, int, tuple[str, ...]]:
    if not isinstance(info, StorageInfo):
        raise _bad(meta_path, f"storage record of {fqn} is a {type(info).__name__}")
    rel = getattr(info, "relative_path", None)
    offset = getattr(info, "offset", None)
    length = getattr(info, "length", None)
    transforms = getattr(info, "transform_descriptors", None) or ()
    if not isinstance(rel, str) or not rel:
        raise _bad(meta_path, f"storage record of {fqn} has no data file name")
    parts = Path(rel).parts
    if Path(rel).is_absolute() or ".." in parts or len(parts) != 1:
        raise _bad(meta_path, f"storage record of {fqn} names a file outside the checkpoint: {rel!r}")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise _bad(meta_path, f"storage record of {fqn} has a bad byte range ({offset!r}, {length!r})")
    if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
        raise _bad(meta_path, f"storage record of {fqn} has bad transform descriptors")
    return rel, offset, length, tuple(transforms)


def _obj_path(planner_data: Any, fqn: str, meta_path: Location) -> ObjPath:
    if not isinstance(planner_data, Mapping) or fqn not in planner_data:
        return (fqn,)  # saved without flattening: the key is its own path
    path = planner_data[fqn]
    if (
        not isinstance(path, (tuple, list))
        or not path
        or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path)
    ):
        raise _bad(meta_path, f"planner data for {fqn} is not a key path: {path!r}")
    return tuple(path)


def build_index(
    metadata: dcp_metadata.Metadata,
    checkpoint_id: Location,
    *,
    read_at: ReadAt | None = None,
    size_of: SizeOf | None = None,
) -> CheckpointIndex:
    """Turn DCP ``Metadata`` into a ``CheckpointIndex``, checking every field's type.

    Chunks ``FileSystemWriter(serialization_format=SAFETENSORS)`` stored as bare elements in a
    safetensors file (``_dcp_payloads.is_raw_chunk``) get their true byte ranges from those
    headers, read through ``read_at`` (the only data-file reads; none for other checkpoints).

    Args:
        metadata: as returned by ``load_metadata``.
        checkpoint_id: the checkpoint folder (used for messages and as ``checkpoint_id``).
        read_at: reads a byte range of a data file (by its name relative to the folder).
        size_of: a data file's size in bytes.

    Raises:
        NotADcpCheckpointError: a field is missing or has the wrong type, a dtype this tool does
            not handle, a non-empty chunk has no storage record or a payload too small for it,
            two payloads share bytes, a data file name points outside the folder, or a
            safetensors header disagrees with ``.metadata``.
        MissingDataFileError, CorruptChunkError: a data file holding safetensors-stored chunks
            is missing, or its safetensors header is unreadable.
    """
    try:
        index = _build_index(metadata, checkpoint_id)
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        # objects the restricted unpickler built but whose fields are missing or of odd types
        raise _bad(checkpoint_id / METADATA_FILENAME, f"malformed metadata ({type(e).__name__}: {e})") from e
    if read_at is not None and size_of is not None:
        index = place_raw_chunks(index, read_at, size_of)
    elif any(is_raw_chunk(e, c) for e in index.tensors() for c in e.chunks):
        raise _bad(checkpoint_id / METADATA_FILENAME, "chunks stored as safetensors need their data files to be indexed")
    _check_disjoint_payloads(index)
    return index


def _check_disjoint_payloads(index: CheckpointIndex) -> None:
    """Two entries whose payloads share bytes can only come from a corrupt ``.metadata``."""
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    both_options: set[tuple[str, int]] = set()  # transformed tensor payloads as long as their elements
    for e in index.entries:
        if isinstance(e, BytesEntry):
            ranges.setdefault(e.relative_path, []).append((e.offset_bytes, e.length_bytes, e.fqn))
        else:
            for c in e.chunks:
                if c.relative_path is not None:
                    ranges.setdefault(c.relative_path, []).append((c.offset_bytes, c.length_bytes, e.fqn))
                    if c.transform_descriptors and c.length_bytes == c.numel * e.dtype.itemsize:
                        both_options.add((c.relative_path, c.offset_bytes))
    for rel, spans in ranges.items():
        spans.sort()
        for (a_off, a_len, a_fqn), (b_off, _, b_fqn) in zip(spans, spans[1:]):
            if b_off < a_off + a_len:
                hint = BOTH_OPTIONS_HINT if (rel, a_off) in both_options and (rel, b_off) in both_options else ""
                raise _bad(
                    index.checkpoint_id / METADATA_FILENAME,
                    f"payloads of {a_fqn} and {b_fqn} overlap in {rel} at byte {b_off}{hint}",
                )


def _build_index(metadata: dcp_metadata.Metadata, checkpoint_id: Location) -> CheckpointIndex:
    meta_path = checkpoint_id / METADATA_FILENAME
    sd_meta = metadata.state_dict_metadata
    if not isinstance(sd_meta, Mapping):
        raise _bad(meta_path, "state_dict_metadata is not a mapping")
    storage: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    storage_data = metadata.storage_data if metadata.storage_data is not None else {}
    if not isinstance(storage_data, Mapping):
        raise _bad(meta_path, "storage_data is not a mapping")
    for key, info in storage_data.items():
        if not isinstance(key, dcp_metadata.MetadataIndex) or not isinstance(key.fqn, str):
            raise _bad(meta_path, f"storage_data key {key!r} is not a MetadataIndex")
        offset = None if key.offset is None else _int_tuple(key.offset, meta_path, f"offset of {key.fqn}")
        storage[(key.fqn, offset)] = info

    planner_data = metadata.planner_data
    order = [k for k in planner_data if k in sd_meta] if isinstance(planner_data, Mapping) else []
    seen = set(order)
    order += [k for k in sd_meta if k not in seen]
    entries: list[Entry] = []
    files: set[str] = set()
    for fqn in order:
        md = sd_meta[fqn]
        if not isinstance(fqn, str):
            raise _bad(meta_path, f"key {fqn!r} is not a string")
        path = _obj_path(planner_data, fqn, meta_path)
        if isinstance(md, dcp_metadata.BytesStorageMetadata):
            if (fqn, None) not in storage:
                raise _bad(meta_path, f"bytes entry {fqn} has no storage record")
            rel, off, length, tr = _storage_fields(storage[(fqn, None)], meta_path, fqn)
            files.add(rel)
            entries.append(
                BytesEntry(fqn=fqn, path=path, relative_path=rel, offset_bytes=off, length_bytes=length, transform_descriptors=tr)
            )
            continue
        if not isinstance(md, dcp_metadata.TensorStorageMetadata):
            raise _bad(meta_path, f"entry {fqn} has unknown metadata type {type(md).__name__}")
        shape = _int_tuple(md.size, meta_path, f"shape of {fqn}")
        dtype = getattr(md.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise _bad(meta_path, f"entry {fqn} has no torch dtype")
        if dtype not in SUPPORTED_DTYPES:
            raise _bad(meta_path, f"entry {fqn} has dtype {dtype}, which this tool does not handle")
        if not isinstance(md.chunks, (list, tuple)):
            raise _bad(meta_path, f"chunks of {fqn} are not a list")
        chunks = []
        for chunk in md.chunks:
            if not isinstance(chunk, dcp_metadata.ChunkStorageMetadata):
                raise _bad(meta_path, f"a chunk of {fqn} is a {type(chunk).__name__}")
            offsets = _int_tuple(chunk.offsets, meta_path, f"chunk offsets of {fqn}")
            sizes = _int_tuple(chunk.sizes, meta_path, f"chunk sizes of {fqn}")
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                raise _bad(meta_path, f"a chunk of {fqn} has {len(sizes)} dims, the tensor {len(shape)}")
            info = storage.get((fqn, offsets))
            if info is None:
                if 0 not in sizes:
                    raise _bad(meta_path, f"chunk of {fqn} at offsets {list(offsets)} has no storage record")
                chunks.append(ChunkEntry(offsets=offsets, sizes=sizes, relative_path=None, offset_bytes=0, length_bytes=0))
                continue
            rel, off, length, tr = _storage_fields(info, meta_path, fqn)
            if math.prod(sizes) * dtype.itemsize > length and not tr:
                # a torch.save payload holds the raw elements; this one cannot (and a huge claimed
                # shape must not make us allocate it)
                raise _bad(
                    meta_path,
                    f"chunk of {fqn} at offsets {list(offsets)} claims {list(sizes)} elements of {dtype}, "
                    f"more than its {length}-byte payload holds",
                )
            files.add(rel)
            chunks.append(
                ChunkEntry(
                    offsets=offsets,
                    sizes=sizes,
                    relative_path=rel,
                    offset_bytes=off,
                    length_bytes=length,
                    transform_descriptors=tr,
                )
            )
        entries.append(TensorEntry(fqn=fqn, path=path, shape=shape, dtype=dtype, chunks=tuple(chunks)))

    storage_meta = metadata.storage_meta
    save_id = getattr(storage_meta, "save_id", None)
    version = metadata.version
    return CheckpointIndex(
        checkpoint_id=checkpoint_id,
        entries=tuple(entries),
        data_files=tuple(sorted(files)),
        version=version if isinstance(version, str) else None,
        save_id=save_id if isinstance(save_id, str) else None,
    )
