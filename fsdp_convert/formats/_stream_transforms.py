"""Read stage, DCP payloads through stream transforms (``FileSystemWriter(_extensions=[ZStandard()])``): bounded, decoded.

With ``_extensions=[ZStandard()]`` (``torch/distributed/checkpoint/filesystem.py``, torch 2.13)
each payload is a zstd stream of the torch.save zip, and ``transform_descriptors`` says so
(``["stream.zstd/1"]``). ``decode_stream`` undoes it through torch's own ``ExtensionRegistry``
where importable (``torch_compat.stream_transform_from``), else through the ``zstandard`` package.

128 KB of zstd can decode to 4 GiB, so a stream-transformed chunk's claim is bounded before any
decode (``check_stream_claims``: ``MAX_ZSTD_EXPANSION`` per stored byte), and its decoding by its
claim (``chunk_limit_bytes``: its elements exactly, plus a torch.save zip's records), into memory
(``decode_payload``: a ``memfd``, never a file) whose pages then are the tensor's storage
(``DecodedPayload.load``): reading the chunk costs no more memory than its elements.
"""

from __future__ import annotations

import contextlib
import importlib
import operator
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fsdp_convert.errors import CheckpointError, CorruptChunkError, NotADcpCheckpointError, UnsupportedTransformError
from fsdp_convert.formats.crc import crc32
from fsdp_convert.formats.index import BytesEntry, CheckpointIndex, ChunkEntry, TensorEntry
from fsdp_convert.output_table import METADATA_FILENAME
from fsdp_convert.signals import torch_call
from fsdp_convert.torch_compat import stream_transform_from
from fsdp_convert.zip_records import ZipFormatError, read_records

__all__ = [
    "ZSTD_DESCRIPTOR",
    "ZSTD_INSTALL_HINT",
    "SizeOf",
    "max_decoded_bytes",
    "check_stream_claims",
    "transformed",
    "chunk_limit_bytes",
    "bytes_limit_bytes",
    "decode_stream",
    "DecodedPayload",
    "decode_payload",
]

ZSTD_DESCRIPTOR = "stream.zstd/1"  # torch's ZStandard.get_descriptor()
ZSTD_INSTALL_HINT = "pip install 'fsdp-convert[zstd]'"
# bytes one stored zstd byte decodes to, at most: a block is at least 4 bytes (3 of header, an RLE
# block's 1) and decodes to at most 128 KiB (RFC 8878 3.1.1.2.3); torch's writer reaches ~13,000
MAX_ZSTD_EXPANSION = (128 << 10) // 4
# a one-tensor torch.save zip beyond its elements: ~1.6 KB, and its pickle's size and stride per dim
TORCH_SAVE_RECORDS_BYTES, TORCH_SAVE_BYTES_PER_DIM = 64 << 10, 64
BYTES_ENTRY_MAX_DECODED_BYTES = 256 << 20  # a bytes entry is a plain value (param group field, train state)
_DECODE_PIECE_BYTES = 4 << 20  # a payload is decoded in pieces of this size

SizeOf = Callable[[str], int]  # a data file (relative to the checkpoint folder) -> its size in bytes


def max_decoded_bytes(descriptors: tuple[str, ...], stored_bytes: int) -> int | None:
    """The most bytes ``stored_bytes`` through ``descriptors`` can decode to; None past a transform but zstd (refused later)."""
    bound = stored_bytes
    for descriptor in descriptors:
        if descriptor.partition("/")[0] != "stream.zstd":
            return None
        bound *= MAX_ZSTD_EXPANSION
    return bound


_TRANSFORMS = operator.attrgetter("transform_descriptors")


def transformed(entry: TensorEntry) -> bool:
    """Whether some chunk of ``entry`` is stream-transformed, checked at C speed (millions of chunks, few transformed)."""
    return any(map(_TRANSFORMS, entry.chunks))


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
        if not transformed(entry):
            continue
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
