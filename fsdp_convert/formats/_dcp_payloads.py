"""Read stage, DCP payloads other than a bare torch.save zip: what each ``FileSystemWriter`` option makes of one.

``FileSystemWriter`` options change what a payload is (``torch/distributed/checkpoint/filesystem.py``
``_write_item`` and ``_write_files_from_queue``, torch 2.13):

- ``serialization_format=SerializationFormat.SAFETENSORS``: bytes entries stay torch.save
  payloads, written first; the tensors of a data file are one safetensors file appended after
  them. Every tensor's ``_StorageInfo`` then has the same ``offset`` (where that safetensors file
  starts: the stream position after the bytes entries, as nothing else is written per tensor)
  and ``length = numel * itemsize``; the true place of each tensor is in the safetensors header
  (``data_offsets``, relative to the end of the header), keyed by the DCP FQN, with
  ``__metadata__["DCP_SHARDING_INFO"]`` naming each chunk's ``saved_offsets``. A torch.save zip
  is always longer than its tensor's elements, so ``length == numel * itemsize`` (no transform)
  tells such a chunk from ``.metadata`` alone (``is_raw_chunk``); ``place_raw_chunks`` reads
  each such safetensors header once and gives the chunk its true byte range, so from then on the
  chunk's bytes are its bare elements (C order, little-endian), read by byte range. torch 2.13's
  own ``FileSystemReader`` cannot load these (it ``torch.load``s the shared range).
- ``_extensions=[ZStandard()]``: each payload is a zstd stream of the torch.save zip, bounded and
  decoded by ``_stream_transforms``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import operator
import struct
from collections.abc import Callable
from typing import Any

from fsdp_convert.errors import CorruptChunkError, NotADcpCheckpointError
from fsdp_convert.formats._stream_transforms import SizeOf, check_stream_claims, transformed
from fsdp_convert.formats.index import CheckpointIndex, ChunkEntry, Entry, TensorEntry

__all__ = [
    "BOTH_OPTIONS_HINT",
    "ReadAt",
    "is_raw_chunk",
    "raw_chunks_in",
    "payload_formats",
    "place_raw_chunks",
]

SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # torch/distributed/checkpoint/_hf_utils.py CUSTOM_METADATA_KEY
MAX_HEADER_BYTES = 100 * 2**20  # safetensors refuses larger headers
# Given both options, FileSystemWriter records each tensor with the descriptors and its elements'
# length at an empty zstd frame of its own, then writes the safetensors file untransformed after
# them (torch's own FileSystemReader cannot load that either): said where such a payload fails
BOTH_OPTIONS_HINT = (
    "; FileSystemWriter writes this with serialization_format=SAFETENSORS and _extensions together, "
    "which torch's own reader cannot load either: save with one of the two"
)

# (data file relative to the checkpoint folder, offset in bytes, length in bytes) -> the bytes there
# (fewer at the end of the file)
ReadAt = Callable[[str, int, int], bytes]


def is_raw_chunk(entry: TensorEntry, chunk: ChunkEntry) -> bool:
    """True for a chunk stored as its bare elements (``serialization_format=SAFETENSORS``), not a torch.save zip.

    A torch.save payload of ``n`` bytes of elements is always longer than ``n`` (its pickle and zip
    headers), so a stored length of exactly ``numel * itemsize`` bytes without a stream transform
    can only be bare elements.
    """
    return (
        chunk.relative_path is not None and not chunk.transform_descriptors and chunk.length_bytes == chunk.numel * entry.itemsize
    )


_LENGTH, _SIZES = operator.attrgetter("length_bytes"), operator.attrgetter("sizes")


def raw_chunks_in(entry: TensorEntry) -> list[ChunkEntry]:
    """The chunks of ``entry`` for which ``is_raw_chunk`` holds; their lengths checked at C speed first (millions of chunks)."""
    chunks = entry.chunks
    elements = map(operator.mul, map(math.prod, map(_SIZES, chunks)), itertools.repeat(entry.itemsize))
    if not any(map(operator.eq, map(_LENGTH, chunks), elements)):
        return []
    return [c for c in chunks if is_raw_chunk(entry, c)]


def payload_formats(index: CheckpointIndex) -> tuple[str, ...]:
    """How the index's payloads are stored, sorted (for ``inspect``).

    ``torch_save`` (a torch.save zip), ``safetensors`` (bare elements in a safetensors file,
    ``serialization_format=SAFETENSORS``, which torch 2.13's ``dcp.load`` cannot read) and each
    stream transform descriptor (``stream.zstd/1``).
    """
    found: set[str] = set()
    for entry in index.entries:
        if isinstance(entry, TensorEntry):
            raw = len(raw_chunks_in(entry))
            stored = sum(c.relative_path is not None for c in entry.chunks)
            found.update(("safetensors",) * bool(raw) + ("torch_save",) * (stored > raw))
            if transformed(entry):
                found.update(t for c in entry.chunks if c.relative_path is not None for t in c.transform_descriptors)
        else:
            found.add("torch_save")
            found.update(entry.transform_descriptors)
    return tuple(sorted(found))


@dataclasses.dataclass(frozen=True, slots=True)
class _Header:
    """One safetensors file inside a data file: its tensors' ``(dtype, shape, begin, end)`` by FQN, and offsets."""

    tensors: dict[str, tuple[str, list[int], int, int]]
    saved_offsets: dict[str, list[int]]
    data_start: int  # where its data begins in the data file, in bytes


def _read_header(relative_path: str, offset: int, read_at: ReadAt, file_size: int, where: str) -> _Header:
    raw = read_at(relative_path, offset, 8)
    if len(raw) != 8:
        raise CorruptChunkError(f"{where}: no safetensors header at byte {offset} (the file ends there)")
    (n,) = struct.unpack("<Q", raw)  # any 8 bytes of the file, where .metadata says: never printed
    if n > MAX_HEADER_BYTES or offset + 8 + n > file_size:
        raise CorruptChunkError(
            f"{where}: the safetensors header at byte {offset} has a length that does not fit the file ({file_size} bytes)"
        )
    try:
        header = json.loads(read_at(relative_path, offset + 8, n))
        if not isinstance(header, dict):
            raise ValueError
        meta = header.pop("__metadata__", None) or {}
        info = json.loads(meta[SHARDING_INFO_KEY]) if isinstance(meta, dict) and SHARDING_INFO_KEY in meta else {}
        saved = {str(fqn): _naturals(v["saved_offsets"]) for fqn, v in info.items()}
        tensors = {}
        for fqn, desc in header.items():
            begin, end = _naturals(desc["data_offsets"])
            tensors[str(fqn)] = (str(desc["dtype"]), _naturals(desc["shape"]), begin, end)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # their texts quote the header: left out
        raise CorruptChunkError(f"{where}: no readable safetensors header at byte {offset} (malformed JSON or entries)") from e
    return _Header(tensors=tensors, saved_offsets=saved, data_start=offset + 8 + n)


def _naturals(values: Any) -> list[int]:
    if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
        raise ValueError("not a list of non-negative integers")
    return values


def place_raw_chunks(index: CheckpointIndex, read_at: ReadAt, size_of: SizeOf) -> CheckpointIndex:
    """Give each bare-elements chunk (``is_raw_chunk``) its true byte range, from its safetensors header.

    Each distinct ``(data file, offset)`` the chunks name is a safetensors file inside the data
    file; its header is read once (8 bytes + the JSON header; no tensor data) and each chunk
    becomes ``[data_start + begin, data_start + end)`` of its data file: its elements, in C order.

    Args:
        index: as ``_dcp_metadata`` built it from ``.metadata``.
        read_at: reads a byte range of a data file.
        size_of: a data file's size in bytes.

    Returns:
        The index with those chunks' ``offset_bytes`` and ``length_bytes`` replaced (others unchanged).

    First, as this is where ``.metadata`` meets the data files' sizes, every stream-transformed
    chunk's claim is checked (``_stream_transforms.check_stream_claims``).

    Raises:
        MissingDataFileError: a data file is missing (from ``read_at`` / ``size_of``).
        CorruptChunkError: no readable safetensors header where ``.metadata`` says, or a tensor's
            range lies outside its file.
        NotADcpCheckpointError: the header lacks a chunk, or disagrees with ``.metadata`` on its
            dtype, shape or offsets in the global tensor; or a stream-transformed chunk claims
            more than its payload can decode to.
    """
    sizes: dict[str, int] = {}

    def size_in_bytes(relative_path: str) -> int:
        if relative_path not in sizes:
            sizes[relative_path] = size_of(relative_path)
        return sizes[relative_path]

    check_stream_claims(index, size_in_bytes)
    headers: dict[tuple[str, int], _Header] = {}
    entries: list[Entry] = []
    for entry in index.entries:
        if not isinstance(entry, TensorEntry) or not raw_chunks_in(entry):
            entries.append(entry)
            continue
        chunks = []
        for chunk in entry.chunks:
            if not is_raw_chunk(entry, chunk):
                chunks.append(chunk)
                continue
            assert chunk.relative_path is not None
            rel = chunk.relative_path
            where = f"{index.checkpoint_id / rel} ({entry.fqn})"
            key = (rel, chunk.offset_bytes)
            if key not in headers:
                headers[key] = _read_header(rel, chunk.offset_bytes, read_at, size_in_bytes(rel), where)
            chunks.append(_place(entry, chunk, headers[key], size_in_bytes(rel), where))
        entries.append(dataclasses.replace(entry, chunks=tuple(chunks)))
    return dataclasses.replace(index, entries=tuple(entries))


def _place(entry: TensorEntry, chunk: ChunkEntry, header: _Header, file_size: int, where: str) -> ChunkEntry:
    from fsdp_convert.constants import SAFETENSORS_TO_TORCH  # torch's dtypes: built (importing torch) on first use

    found = header.tensors.get(entry.fqn)
    if found is None:
        raise NotADcpCheckpointError(f"{where}: not in the safetensors header at byte {chunk.offset_bytes}")
    dtype_name, shape, begin, end = found
    dtype = SAFETENSORS_TO_TORCH.get(dtype_name)
    saved = header.saved_offsets.get(entry.fqn, list(chunk.offsets))
    # the header's values are the data file's bytes: said to differ, never quoted (.metadata's are the index)
    same = {"dtype": dtype == entry.dtype, "shape": tuple(shape) == chunk.sizes, "offsets": tuple(saved) == chunk.offsets}
    if differ := [what for what, ok in same.items() if not ok]:
        raise NotADcpCheckpointError(
            f"{where}: the safetensors header disagrees with .metadata on the chunk's {' and '.join(differ)} "
            f"(.metadata says {entry.dtype} {list(chunk.sizes)} at offsets {list(chunk.offsets)})"
        )
    if not begin <= end or end - begin != chunk.length_bytes or header.data_start + end > file_size:
        raise CorruptChunkError(
            f"{where}: the safetensors header's data range does not hold {entry.dtype} {list(chunk.sizes)} in the file"
        )
    return dataclasses.replace(chunk, offset_bytes=header.data_start + begin, length_bytes=end - begin)
