"""Index stage, DCP: unpickle a ``.metadata`` safely and check it into a ``CheckpointIndex``; no tensor I/O.

The file is a pickled ``torch.distributed.checkpoint.metadata.Metadata`` (written by
``FileSystemWriter.finish``, or by another writer: ``_dcp_records``). torch reads it with plain
``pickle.load``, which runs whatever the file says; here ``_safe_pickle``'s interpreter admits only
fresh DCP metadata records (``_dcp_records``), ``torch.Size``, torch dtypes and layouts (as inert
names: ``_dcp_classes``; no torch import), pure paths and plain values, never changes an object
it did not create, and every field is type-checked.
"""

from __future__ import annotations

import math
import mmap
import operator
import os
import pickle
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fsdp_convert.errors import NotADcpCheckpointError, UnsafeContentError
from fsdp_convert.formats import _dcp_classes as records
from fsdp_convert.formats._dcp_classes import MEM_FORMAT_ENCODING, torch_dtype
from fsdp_convert.formats._dcp_payloads import BOTH_OPTIONS_HINT, ReadAt, place_raw_chunks, raw_chunks_in
from fsdp_convert.formats._dcp_records import CALL_BY_ID, RECORD_BY_ID, record_state, unknown_global
from fsdp_convert.formats._dcp_records import CALLS as _CALLS
from fsdp_convert.formats._dcp_records import RECORDS as _RECORDS
from fsdp_convert.formats._safe_pickle import MalformedError, RefusedError, SafeUnpickler, described, paused_gc, shown
from fsdp_convert.formats._stream_transforms import SizeOf, transformed
from fsdp_convert.formats.index import (
    DTYPE_ITEMSIZES,
    BytesEntry,
    CheckpointIndex,
    ChunkEntry,
    Entry,
    Location,
    ObjPath,
    TensorEntry,
    chunk_entry,
    readable_name,
    readable_path,
)
from fsdp_convert.output_table import METADATA_FILENAME

__all__ = [
    "METADATA_MAX_BYTES",
    "MEM_FORMAT_ENCODING",  # the enum the unpickler admits: tests check no load changes it
    "check_metadata_size",
    "load_records",
    "records_from_bytes",
    "load_metadata",
    "metadata_from_bytes",
    "build_index",
]


# --- restricted unpickling ----------------------------------------------------------------------

# A 1T-parameter MoE (61 layers, 384 stacked experts; model, exp_avg, exp_avg_sq) sharded 2048 ways
# pickles to about 0.85 GB (150 bytes a chunk); a file over this is no DCP .metadata.
METADATA_MAX_BYTES = 8 << 30


class _MetadataUnpickler(SafeUnpickler):
    """Admits ``_dcp_records``' records (created fresh, state set only by ``build``), torch dtypes and its calls."""

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        found = _RECORDS.get(key) or _CALLS.get(key) or (torch_dtype(name) if module == "torch" else None)
        if found is None:
            raise RefusedError(unknown_global(module, name))
        return found

    def call(self, func: Any, args: tuple[Any, ...]) -> Any:
        vetted = CALL_BY_ID.get(id(func))
        if vetted is None or vetted is not func:
            raise RefusedError(f"refusing to call {described(func)}")
        return vetted(*args)

    def new(self, cls: Any, args: tuple[Any, ...]) -> Any:
        record = RECORD_BY_ID.get(id(cls))
        if record is None or record is not cls:
            raise RefusedError(f"refusing to create an instance of {described(cls)}")
        if args:
            raise MalformedError(f"{record.__name__} created with arguments")
        return object.__new__(record)  # as pickle's NEWOBJ does: no __init__ runs

    def build(self, obj: Any, state: Any) -> None:
        # only a record instance: NEWOBJ above made it in this load (no global or call returns one)
        cls = type(obj)
        if RECORD_BY_ID.get(id(cls)) is not cls:
            raise RefusedError(f"refusing to set the state of {described(obj)}")
        object.__setattr__(obj, "__dict__", record_state(cls, state))

    def key_ok(self, key: Any) -> bool:
        # storage_data's keys: hashing a MetadataIndex hashes (fqn, offset); offset is a Size of ints
        if type(key) is not records.MetadataIndex:
            return False
        offset = getattr(key, "offset", None)
        return type(getattr(key, "fqn", None)) is str and (offset is None or type(offset) is records.Size)


def check_metadata_size(size_bytes: int, path: Location | str | os.PathLike[str]) -> None:
    """Refuse a ``.metadata`` over ``METADATA_MAX_BYTES`` before it is read.

    Raises:
        NotADcpCheckpointError: it is larger.
    """
    if size_bytes > METADATA_MAX_BYTES:
        raise NotADcpCheckpointError(
            f"{path} is over {METADATA_MAX_BYTES >> 30} GiB, far more than a DCP .metadata holds; not reading it"
        )


def load_metadata(path: str | os.PathLike[str]) -> Any:
    """``load_records`` as torch's own ``Metadata``, as torch's ``pickle.load`` makes it (``_dcp_classes.as_torch``).

    Imports ``torch.distributed.checkpoint``; reading a checkpoint uses ``load_records``.

    Raises:
        As ``load_records``.
    """
    return _as_torch(load_records(path), path)


def metadata_from_bytes(data: bytes | mmap.mmap, path: str | os.PathLike[str]) -> Any:
    """``records_from_bytes`` as torch's own ``Metadata`` (``load_metadata``).

    Raises:
        As ``load_records``.
    """
    return _as_torch(records_from_bytes(data, path), path)


def _as_torch(metadata: records.Metadata, path: str | os.PathLike[str]) -> Any:
    try:
        return records.as_torch(metadata)
    except RecursionError as e:
        raise NotADcpCheckpointError(f"{path} nests containers too deeply for a DCP metadata file") from e


def load_records(path: str | os.PathLike[str]) -> records.Metadata:
    """Unpickle a ``.metadata`` file with the restricted unpickler (``_safe_pickle``), into inert records.

    The file (a regular file of at most ``METADATA_MAX_BYTES``) is memory-mapped, not read: a
    file that is not a pickle costs the pages parsed before it fails, not its size in memory. (One
    cut short while mapped would end the process with SIGBUS; DCP replaces ``.metadata`` by rename.)

    Args:
        path: the ``.metadata`` file.

    Returns:
        The ``Metadata`` record (``_dcp_classes``: torch's fields, no torch class), type-checked at the top.

    Raises:
        UnsafeContentError: the pickle asks for a global, call or opcode outside the allow-list.
        NotADcpCheckpointError: the file is too large, not a regular file, or not one readable
            pickle of ``Metadata``.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open, a device never end
            raise NotADcpCheckpointError(f"{path} is not a regular file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            check_metadata_size(size, path)
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as e:
        raise NotADcpCheckpointError(f"cannot read {path}: {e.strerror}") from e
    try:
        return records_from_bytes(data, path)
    finally:
        if isinstance(data, mmap.mmap):
            data.close()  # nothing loaded refers to it: strings and ints are copies


def records_from_bytes(data: bytes | mmap.mmap, path: str | os.PathLike[str]) -> records.Metadata:
    """``load_records`` of bytes already read (a remote ``.metadata``); ``path`` names it in errors.

    Raises:
        As ``load_records``.
    """
    check_metadata_size(len(data), path)
    unpickler = _MetadataUnpickler(data)
    try:
        obj = unpickler.load()
    except RefusedError as e:
        raise UnsafeContentError(f"{path}: {e}; not loading it (it would run code)") from e
    except pickle.UnpicklingError as e:
        raise NotADcpCheckpointError(f"{path} is not a readable DCP metadata file ({e})") from e
    if unpickler.end != len(data):
        raise NotADcpCheckpointError(
            f"{path} has data after the end of its pickle (at byte {unpickler.end}); a DCP .metadata is one pickle"
        )
    if not isinstance(obj, records.Metadata):
        raise NotADcpCheckpointError(f"{path} holds a {type(obj).__name__}, not DCP Metadata")
    return obj


# --- conversion to the index --------------------------------------------------------------------


def _bad(path: Location, what: str) -> NotADcpCheckpointError:
    return NotADcpCheckpointError(f"{path}: {what}")


def _int_tuple(value: Any, meta_path: Location, what: str, fqn: str) -> tuple[int, ...]:
    """``value`` as a tuple of 64-bit naturals (a shape, offsets, sizes), checked at C speed (millions per file).

    The message names ``what`` and ``fqn``, joined only when it is raised.
    """
    if type(value) is records.Size:  # torch_size made it of 64-bit ints: only their sign is left to check
        if not value or min(value) >= 0:
            return tuple(value)
    elif isinstance(value, (tuple, list)):
        ints = value if type(value) is tuple else tuple(value)
        for d in ints:  # a plain loop: three times faster than issuperset, min and max for a few dims
            if type(d) is not int or not 0 <= d < 2**63:
                break
        else:
            return ints
    raise _bad(meta_path, f"{what} {fqn} is not a sequence of non-negative 64-bit ints")


def _name(value: Any, meta_path: Location, what: str) -> str:
    """A key or data file name from the file: a string that prints on one line."""
    if not readable_name(value):
        raise _bad(meta_path, f"{what} {shown(value)} is not a printable string")
    return value


def _storage_fields(info: Any, meta_path: Location, fqn: str, files: set[str]) -> tuple[str, int, int, tuple[str, ...]]:
    """A storage record's (data file, offset, length, transforms), checked; ``files``: the names checked so far, added to."""
    if not isinstance(info, records.StorageInfo):
        raise _bad(meta_path, f"storage record of {fqn} is a {type(info).__name__}")
    rel = getattr(info, "relative_path", None)
    offset = getattr(info, "offset", None)
    length = getattr(info, "length", None)
    transforms = getattr(info, "transform_descriptors", None) or ()
    if type(rel) is not str or rel not in files:  # a few data files, millions of records: each name checked once
        if not isinstance(rel, str) or not rel:
            raise _bad(meta_path, f"storage record of {fqn} has no data file name")
        rel = _name(rel, meta_path, f"the data file of {fqn}")
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or len(parts) != 1:
            raise _bad(meta_path, f"storage record of {fqn} names a file outside the checkpoint: {shown(rel)}")
        files.add(rel)
    if type(offset) is not int or type(length) is not int or not 0 <= offset <= offset + length < 2**63:
        raise _bad(meta_path, f"storage record of {fqn} has a byte range that is not two 64-bit ints")
    if not isinstance(transforms, (list, tuple)) or (transforms and not all(isinstance(t, str) for t in transforms)):
        raise _bad(meta_path, f"storage record of {fqn} has bad transform descriptors")
    return rel, offset, length, tuple(transforms)


def _obj_path(planner_data: Any, fqn: str, meta_path: Location) -> ObjPath:
    if not isinstance(planner_data, Mapping) or fqn not in planner_data:
        return (fqn,)  # saved without flattening: the key is its own path
    path = planner_data[fqn]
    if not readable_path(path):
        raise _bad(meta_path, f"planner data for {fqn} is not a key path (printable strings and ints)")
    return tuple(path)


def build_index(
    metadata: records.Metadata,
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
        metadata: as returned by ``load_records``.
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
    with paused_gc():  # a chunk is a few objects, millions of them, and no cycles
        try:
            index = _build_index(metadata, checkpoint_id)
        except (AttributeError, TypeError, ValueError, KeyError) as e:
            # objects the restricted unpickler built but whose fields are missing or of odd types
            raise _bad(checkpoint_id / METADATA_FILENAME, f"malformed metadata ({type(e).__name__}: {shown(str(e))})") from e
        if read_at is not None and size_of is not None:
            index = place_raw_chunks(index, read_at, size_of)
        elif any(map(raw_chunks_in, index.tensors())):
            raise _bad(checkpoint_id / METADATA_FILENAME, "chunks stored as safetensors need their data files to be indexed")
        _check_disjoint_payloads(index)
    return index


_BYTE_RANGE = operator.attrgetter("relative_path", "offset_bytes", "length_bytes")


def _check_disjoint_payloads(index: CheckpointIndex) -> None:
    """Two entries whose payloads share bytes can only come from a corrupt ``.metadata``."""
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    both_options: set[tuple[str, int]] = set()  # transformed tensor payloads as long as their elements
    for e in index.entries:
        if isinstance(e, BytesEntry):
            ranges.setdefault(e.relative_path, []).append((e.offset_bytes, e.length_bytes, e.fqn))
            continue
        for rel, offset, length in map(_BYTE_RANGE, e.chunks):  # (millions of chunks)
            if rel is not None:
                spans = ranges.get(rel)
                if spans is None:
                    spans = ranges[rel] = []
                spans.append((offset, length, e.fqn))
        if transformed(e):
            for c in e.chunks:
                if c.relative_path is not None and c.transform_descriptors and c.length_bytes == c.numel * e.itemsize:
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


def _build_index(metadata: records.Metadata, checkpoint_id: Location) -> CheckpointIndex:
    meta_path = checkpoint_id / METADATA_FILENAME
    sd_meta = metadata.state_dict_metadata
    if not isinstance(sd_meta, Mapping):
        raise _bad(meta_path, "state_dict_metadata is not a mapping")
    storage: dict[str, dict[tuple[int, ...] | None, Any]] = {}  # by FQN, then offsets: small dicts, looked up per chunk
    storage_data = metadata.storage_data if metadata.storage_data is not None else {}
    if not isinstance(storage_data, Mapping):
        raise _bad(meta_path, "storage_data is not a mapping")
    for key, info in storage_data.items():
        if not isinstance(key, records.MetadataIndex) or not isinstance(fqn := key.fqn, str):
            raise _bad(meta_path, f"a storage_data key is a {type(key).__name__}, not a MetadataIndex with an FQN")
        offset = None if key.offset is None else _int_tuple(key.offset, meta_path, "offset of", fqn)
        by_offset = storage.get(fqn)
        if by_offset is None:
            by_offset = storage[fqn] = {}
        by_offset[offset] = info

    planner_data = metadata.planner_data
    order = [k for k in planner_data if k in sd_meta] if isinstance(planner_data, Mapping) else []
    seen = set(order)
    order += [k for k in sd_meta if k not in seen]
    entries: list[Entry] = []
    files: set[str] = set()
    for fqn in order:
        md = sd_meta[fqn]
        fqn = _name(fqn, meta_path, "the key")
        path = _obj_path(planner_data, fqn, meta_path)
        if isinstance(md, records.BytesStorageMetadata):
            if None not in storage.get(fqn, ()):
                raise _bad(meta_path, f"bytes entry {fqn} has no storage record")
            rel, off, length, tr = _storage_fields(storage[fqn][None], meta_path, fqn, files)
            entries.append(
                BytesEntry(fqn=fqn, path=path, relative_path=rel, offset_bytes=off, length_bytes=length, transform_descriptors=tr)
            )
            continue
        if not isinstance(md, records.TensorStorageMetadata):
            raise _bad(meta_path, f"entry {fqn} has unknown metadata type {type(md).__name__}")
        shape = _int_tuple(md.size, meta_path, "shape of", fqn)
        dtype = getattr(md.properties, "dtype", None)
        if type(dtype) is not records.TorchDtype:
            raise _bad(meta_path, f"entry {fqn} has no torch dtype")
        itemsize = DTYPE_ITEMSIZES.get(dtype)
        if itemsize is None:
            raise _bad(meta_path, f"entry {fqn} has dtype torch.{dtype}, which this tool does not handle")
        if not isinstance(md.chunks, (list, tuple)):
            raise _bad(meta_path, f"chunks of {fqn} are not a list")
        chunks: list[ChunkEntry] = []
        ndim, stored = len(shape), storage.get(fqn, {})
        for chunk in md.chunks:  # (millions: what is looked up per chunk is bound once per entry)
            if not isinstance(chunk, records.ChunkStorageMetadata):
                raise _bad(meta_path, f"a chunk of {fqn} is a {type(chunk).__name__}")
            offsets = _int_tuple(chunk.offsets, meta_path, "chunk offsets of", fqn)
            sizes = _int_tuple(chunk.sizes, meta_path, "chunk sizes of", fqn)
            if len(offsets) != ndim or len(sizes) != ndim:
                raise _bad(meta_path, f"a chunk of {fqn} has {len(sizes)} dims, the tensor {ndim}")
            info = stored.get(offsets)
            if info is None:
                if 0 not in sizes:
                    raise _bad(meta_path, f"chunk of {fqn} at offsets {shown(list(offsets))} has no storage record")
                chunks.append(chunk_entry(offsets, sizes, None, 0, 0))
                continue
            rel, off, length, tr = _storage_fields(info, meta_path, fqn, files)
            if math.prod(sizes) * itemsize > length and not tr:  # a payload holds the raw elements; a huge claim is refused
                raise _bad(
                    meta_path,
                    f"chunk of {fqn} at offsets {shown(list(offsets))} claims {shown(list(sizes))} elements of torch.{dtype}, "
                    "more than its payload holds",
                )
            chunks.append(chunk_entry(offsets, sizes, rel, off, length, tr))
        entries.append(TensorEntry(fqn=fqn, path=path, shape=shape, dtype_name=str(dtype), chunks=tuple(chunks)))

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
