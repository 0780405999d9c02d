"""Read stage, DCP payloads other than a bare torch.save zip: safetensors-stored tensors and stream transforms.

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
- ``_extensions=[ZStandard()]``: each payload is a zstd stream of the torch.save zip, and
  ``transform_descriptors`` says so (``["stream.zstd/1"]``). ``decode_stream`` undoes it through
  torch's own ``ExtensionRegistry`` where importable (``torch_compat.stream_transform_from``), else
  through the ``zstandard`` package.

128 KB of zstd can decode to 4 GiB, so a stream-transformed chunk's claim is bounded before any
decode (``check_stream_claims``: ``MAX_ZSTD_EXPANSION`` per stored byte), and its decoding by its
claim (``chunk_limit_bytes``: its elements exactly, plus a torch.save zip's records), into memory
(``decode_payload``: a ``memfd``, never a file) whose pages then are the tensor's storage
(``DecodedPayload.load``): reading the chunk costs no more memory than its elements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fsdp_convert.constants import METADATA_FILENAME
from fsdp_convert.errors import CheckpointError, CorruptChunkError, NotADcpCheckpointError, UnsupportedTransformError
from fsdp_convert.formats.crc import crc32
from fsdp_convert.formats.index import BytesEntry, CheckpointIndex, ChunkEntry, Entry, TensorEntry
from fsdp_convert.signals import torch_call
from fsdp_convert.torch_compat import stream_transform_from
from fsdp_convert.zip_records import ZipFormatError, read_records

__all__ = [
    "ZSTD_DESCRIPTOR",
    "ZSTD_INSTALL_HINT",
    "BOTH_OPTIONS_HINT",
    "ReadAt",
    "SizeOf",
    "is_raw_chunk",
    "payload_formats",
    "place_raw_chunks",
    "decode_stream",
    "check_stream_claims",
    "chunk_limit_bytes",
    "bytes_limit_bytes",
    "DecodedPayload",
    "decode_payload",
]

ZSTD_DESCRIPTOR = "stream.zstd/1"  # torch's ZStandard.get_descriptor()
ZSTD_INSTALL_HINT = "pip install 'fsdp-convert[zstd]'"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # torch/distributed/checkpoint/_hf_utils.py CUSTOM_METADATA_KEY
MAX_HEADER_BYTES = 100 * 2**20  # safetensors refuses larger headers
# Given both options, FileSystemWriter records each tensor with the descriptors and its elements'
# length at an empty zstd frame of its own, then writes the safetensors file untransformed after
# them (torch's own FileSystemReader cannot load that either): said where such a payload fails
BOTH_OPTIONS_HINT = (
    "; FileSystemWriter writes this with serialization_format=SAFETENSORS and _extensions together, "
    "which torch's own reader cannot load either: save with one of the two"
)
# bytes one stored zstd byte decodes to, at most: a block is at least 4 bytes (3 of header, an RLE
# block's 1) and decodes to at most 128 KiB (RFC 8878 3.1.1.2.3); torch's writer reaches ~13,000
MAX_ZSTD_EXPANSION = (128 << 10) // 4
# a one-tensor torch.save zip beyond its elements: ~1.6 KB, and its pickle's size and stride per dim
TORCH_SAVE_RECORDS_BYTES, TORCH_SAVE_BYTES_PER_DIM = 64 << 10, 64
BYTES_ENTRY_MAX_DECODED_BYTES = 256 << 20  # a bytes entry is a plain value (param group field, train state)
_DECODE_PIECE_BYTES = 4 << 20  # a payload is decoded in pieces of this size

# (data file relative to the checkpoint folder, offset in bytes, length in bytes) -> the bytes there
# (fewer at the end of the file); and the data file's size in bytes
ReadAt = Callable[[str, int, int], bytes]
SizeOf = Callable[[str], int]


def is_raw_chunk(entry: TensorEntry, chunk: ChunkEntry) -> bool:
    """True for a chunk stored as its bare elements (``serialization_format=SAFETENSORS``), not a torch.save zip.

    A torch.save payload of ``n`` bytes of elements is always longer than ``n`` (its pickle and zip
    headers), so a stored length of exactly ``numel * itemsize`` bytes without a stream transform
    can only be bare elements.
    """
    return (
        chunk.relative_path is not None and not chunk.transform_descriptors and chunk.length_bytes == chunk.numel * entry.itemsize
    )


def payload_formats(index: CheckpointIndex) -> tuple[str, ...]:
    """How the index's payloads are stored, sorted (for ``inspect``).

    ``torch_save`` (a torch.save zip), ``safetensors`` (bare elements in a safetensors file,
    ``serialization_format=SAFETENSORS``, which torch 2.13's ``dcp.load`` cannot read) and each
    stream transform descriptor (``stream.zstd/1``).
    """
    found: set[str] = set()
    for entry in index.entries:
        if isinstance(entry, TensorEntry):
            for chunk in entry.chunks:
                if chunk.relative_path is not None:
                    found.add("safetensors" if is_raw_chunk(entry, chunk) else "torch_save")
                    found.update(chunk.transform_descriptors)
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
    chunk's claim is checked (``check_stream_claims``).

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
        if not isinstance(entry, TensorEntry) or not any(is_raw_chunk(entry, c) for c in entry.chunks):
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


def max_decoded_bytes(descriptors: tuple[str, ...], stored_bytes: int) -> int | None:
    """The most bytes ``stored_bytes`` through ``descriptors`` can decode to; None past a transform but zstd (refused later)."""
    bound = stored_bytes
    for descriptor in descriptors:
        if descriptor.partition("/")[0] != "stream.zstd":
            return None
        bound *= MAX_ZSTD_EXPANSION
    return bound


def check_stream_claims(index: CheckpointIndex, size_of: SizeOf) -> None:
    """Refuse a stream-transformed chunk that claims more elements than its payload can decode to; decodes nothing.

    A plain payload is at least as long as its elements (``_dcp_metadata.build_index``); a
    compressed one's claim (``numel * itemsize`` of the tensor's dtype) must fit in
    ``max_decoded_bytes`` of the bytes its file holds in its range (a crafted length need not be
    there). So ``[2**40, 2**40]`` from 128 KB is refused before the plan or any decode sees it.

    Args:
        index: as ``_dcp_metadata`` built it from ``.metadata``.
        size_of: a data file's size in bytes.

    Raises:
        NotADcpCheckpointError: the first such chunk (its FQN, offsets, claim and payload size).
        MissingDataFileError: a data file holding such a chunk is missing (from ``size_of``).
    """
    for entry in index.tensors():
        for chunk in entry.chunks:
            if chunk.relative_path is None or not chunk.transform_descriptors or chunk.numel == 0:
                continue
            stored = max(0, min(chunk.length_bytes, size_of(chunk.relative_path) - chunk.offset_bytes))
            bound = max_decoded_bytes(chunk.transform_descriptors, stored)
            claim = chunk.numel * entry.itemsize
            if bound is not None and claim > bound:
                raise NotADcpCheckpointError(
                    f"{index.checkpoint_id / METADATA_FILENAME}: chunk of {entry.fqn} at offsets {list(chunk.offsets)} "
                    f"claims {list(chunk.sizes)} elements of {entry.dtype} ({claim} bytes), more than the {stored} bytes "
                    f"it has in {chunk.relative_path} decode to through {list(chunk.transform_descriptors)} (at most {bound})"
                )


def chunk_limit_bytes(entry: TensorEntry, chunk: ChunkEntry) -> int:
    """The most bytes a chunk's stream-transformed payload may decode to: its elements (DCP clones views), and zip records."""
    return chunk.numel * entry.itemsize + TORCH_SAVE_RECORDS_BYTES + TORCH_SAVE_BYTES_PER_DIM * len(chunk.sizes)


def bytes_limit_bytes(entry: BytesEntry) -> int:
    """The most bytes a bytes entry's stream-transformed payload may decode to (a plain value)."""
    bound = max_decoded_bytes(entry.transform_descriptors, entry.length_bytes)
    return BYTES_ENTRY_MAX_DECODED_BYTES if bound is None else min(bound, BYTES_ENTRY_MAX_DECODED_BYTES)


def _zstandard() -> Any:
    """The ``zstandard`` module, or None where it is not installed."""
    try:
        return importlib.import_module("zstandard")
    except ImportError:
        return None


def _zstd_decoder_missing() -> bool:
    """True when neither package torch decodes zstd with (``zstandard``, ``pyzstd``) is importable."""
    for name in ("zstandard", "pyzstd"):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        return False
    return True


def decode_stream(descriptors: tuple[str, ...], stream: IO[bytes], where: str) -> IO[bytes]:
    """A readable (not seekable) stream of ``stream`` decoded through DCP's stream transforms, in order.

    Through torch's own ``ExtensionRegistry`` (``torch_compat.stream_transform_from``) where this torch
    has one, else through the ``zstandard`` package, which knows ``stream.zstd/1`` alone.

    Args:
        descriptors: the payload's ``transform_descriptors`` from ``.metadata``.
        stream: the stored (encoded) payload.
        where: the data file, byte range and FQN, for error messages.

    Raises:
        UnsupportedTransformError: a transform neither torch nor this tool knows, or zstd without
            a decoder package installed (the message names ``pip install 'fsdp-convert[zstd]'``).
    """
    zstd = [d for d in descriptors if d.partition("/")[0] == "stream.zstd"]
    if zstd and _zstd_decoder_missing():
        raise UnsupportedTransformError(
            f"{where}: compressed with zstd ({zstd[0]}), and no zstd decoder is installed: {ZSTD_INSTALL_HINT}"
        )
    try:
        decoded = stream_transform_from(descriptors, stream)
    except ValueError as e:
        raise UnsupportedTransformError(
            f"{where}: written through stream transform(s) {list(descriptors)}, which this tool does not decode ({e})"
        ) from e
    if decoded is not None:
        return decoded
    zstandard = _zstandard()
    for descriptor in descriptors:
        name, _, version = descriptor.partition("/")
        if name != "stream.zstd" or version.partition(".")[0] != "1":
            raise UnsupportedTransformError(
                f"{where}: written through stream transform(s) {list(descriptors)}, which this tool does not decode"
            )
        if zstandard is None:  # pyzstd alone, and a torch without the registry that would use it
            raise UnsupportedTransformError(f"{where}: compressed with zstd ({descriptor}): {ZSTD_INSTALL_HINT}")
        stream = zstandard.ZstdDecompressor().stream_reader(stream)
    return stream


def _available_memory_bytes() -> int | None:
    """``MemAvailable``, within a cgroup v2 limit, in bytes; None if unknown."""
    found = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        found.append(int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) << 10)  # in kB
    with contextlib.suppress(OSError, ValueError):
        if (limit := Path("/sys/fs/cgroup/memory.max").read_text().strip()) != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    return min(found, default=None)


class DecodedPayload(contextlib.closing["DecodedPayload"]):
    """A stream-transformed payload decoded into ``fd``, an anonymous ``memfd`` of ``nbytes`` bytes; a context manager."""

    def __init__(self, fd: int, nbytes: int) -> None:
        super().__init__(self)
        self.fd, self.nbytes = fd, nbytes

    def close(self) -> None:
        """Release the memfd (a tensor ``load`` mapped from it keeps its own pages)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def check_crcs(self, where: str) -> None:
        """Check every zip record's CRC-32 against its bytes (torch.load does not).

        Raises:
            CorruptChunkError: not a torch.save zip, or a record whose CRC-32 does not match.
        """
        try:
            records = read_records(lambda length, offset: os.pread(self.fd, length, offset), self.nbytes)
        except ZipFormatError as e:
            raise CorruptChunkError(f"{where}: payload is not a torch.save zip ({e})") from e
        for record in records:
            crc, at, end = 0, record.data_offset, record.data_offset + record.size
            while at < end:
                piece = os.pread(self.fd, min(_DECODE_PIECE_BYTES, end - at), at)
                crc, at = crc32(piece, crc), at + len(piece)
            if crc != record.crc32:
                raise CorruptChunkError(f"{where}: CRC-32 mismatch in a record of its torch.save zip; the data file is corrupt")

    def load(self) -> Any:
        """``torch.load(weights_only=True)`` of the payload, its tensors' storages mapped from the memfd (no copy).

        Raises:
            Exception: whatever ``torch.load`` raises (a refused global, a broken zip), for the caller to word.
        """
        with torch_call():
            import torch  # a stream-transformed payload is loaded only to move its bytes: inspect needs no torch

            return torch.load(f"/proc/self/fd/{self.fd}", map_location="cpu", weights_only=True, mmap=True)


def decode_payload(
    source: IO[bytes], transforms: tuple[str, ...], where: str, limit_bytes: int, hint: str = ""
) -> DecodedPayload:
    """Decode ``source`` through ``transforms`` into memory (a ``memfd``; never to disk), at most ``limit_bytes``.

    Starts only if ``limit_bytes`` fit in the memory available; decodes at most ``limit_bytes + 1``
    bytes. A read error ``source`` records in its ``error`` (``_range.ByteRangeFile``) is raised as is.
    ``where`` (data file, range, FQN) starts messages; ``hint`` ends the one for a stream that
    decodes to nothing (``BOTH_OPTIONS_HINT``).

    Raises:
        UnsupportedTransformError: as ``decode_stream``.
        CorruptChunkError: the stream does not decode, decodes to nothing or to more than ``limit_bytes``.
        CheckpointError: ``limit_bytes`` exceed the memory available.
    """
    available = _available_memory_bytes()
    if available is not None and limit_bytes > available:
        raise CheckpointError(f"{where}: decoding it may take {limit_bytes} bytes of memory, {available} are available")
    stream = decode_stream(transforms, source, where)
    decoded = DecodedPayload(os.memfd_create("fsdp-convert-decoded", os.MFD_CLOEXEC), 0)
    with contextlib.ExitStack() as on_error:
        on_error.callback(decoded.close)
        try:
            while piece := stream.read(min(_DECODE_PIECE_BYTES, limit_bytes + 1 - decoded.nbytes)):
                decoded.nbytes += len(piece)
                if decoded.nbytes > limit_bytes:
                    raise CorruptChunkError(f"{where}: decodes to more than {limit_bytes} bytes; the payload is corrupt")
                view = memoryview(piece)
                while view:
                    view = view[os.write(decoded.fd, view) :]
        except Exception as e:  # ours; else the read's (it is the cause), or the decoder's (a truncated or corrupt frame)
            error = e if isinstance(e, CorruptChunkError) else getattr(source, "error", None)
            if error is not None:
                raise error from None
            detail = type(e).__name__  # not its text, which may quote the stream's bytes or header fields
            raise CorruptChunkError(f"{where}: stream transform(s) {list(transforms)} do not decode ({detail}){hint}") from e
        if (error := getattr(source, "error", None)) is not None:
            raise error
        if decoded.nbytes == 0:
            raise CorruptChunkError(f"{where}: stream transform(s) {list(transforms)} decode to nothing{hint}")
        on_error.pop_all()
    return decoded
