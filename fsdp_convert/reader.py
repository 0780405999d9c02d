"""Read stage: byte ranges of DCP data files to tensors and values.

Each payload (a torch.save zip, ``torch/distributed/checkpoint/filesystem.py`` ``_write_item``)
is decoded with ``torch.load(weights_only=True)`` from a file object that exposes only its byte
range of the data file and reads with ``os.preadv``: never the whole data file, and the tensor's
storage is read straight into the memory torch allocates for it (no intermediate ``bytes``). The
zip's CRC-32s, which torch never checks, are checked on the way (``check_crc``). A
tensor's chunks are copied into one preallocated full tensor, each chunk freed once copied.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zlib
from pathlib import Path
from types import TracebackType
from typing import IO, Any, NoReturn, cast

import torch

from fsdp_convert._crc import combine
from fsdp_convert._signals import torch_call
from fsdp_convert._zip import ZipFormatError, ZipRecord, read_records
from fsdp_convert.errors import (
    CorruptChunkError,
    InvalidOptionError,
    MissingDataFileError,
    ShapeMismatchError,
    UnsafeContentError,
    UnsupportedTransformError,
)
from fsdp_convert.metadata import BytesEntry, CheckpointIndex, ChunkEntry, TensorEntry
from fsdp_convert.rank_files import load_rank_file, local_value
from fsdp_convert.remote import Url, as_location, read_range, size_of

__all__ = ["check_data_files", "ChunkReader", "ByteRangeFile", "READ_LOG_ENV"]

READ_LOG_ENV = "FSDP_CONVERT_READ_LOG"


def check_data_files(index: CheckpointIndex) -> None:
    """Check that every data file ``.metadata`` names exists and is readable.

    Raises:
        MissingDataFileError: naming the first missing or unreadable file.
    """
    for name in index.data_files:
        path = index.checkpoint_id / name
        if isinstance(path, Url):
            if size_of(path) is None:
                raise MissingDataFileError(f"{path} is missing; .metadata names it as a data file")
            continue
        if not path.is_file():
            raise MissingDataFileError(f"{path} is missing; .metadata names it as a data file")
        if not os.access(path, os.R_OK):
            raise MissingDataFileError(f"{path} is not readable (permission denied)")


class _RecordHash:
    """Running CRC-32 of one zip record's data, fed by the reads torch.load makes anyway."""

    __slots__ = ("record", "crc", "done_to", "in_order")

    def __init__(self, record: ZipRecord) -> None:
        self.record = record
        self.crc = 0
        self.done_to = record.data_offset  # bytes hashed so far end here (offsets within the payload)
        self.in_order = True


class ByteRangeFile(io.RawIOBase):
    """A read-only, seekable file object over ``[offset, offset + length)`` of an open descriptor.

    Reads use ``os.preadv`` into the caller's buffer, so several readers can share one
    descriptor and nothing outside the range is ever read. Given the zip records of the payload,
    it also hashes each record's data as it passes (``zlib.crc32``, several GB/s), so checking
    CRC-32s costs no extra read.

    Args:
        fd: an open descriptor of the data file.
        offset_bytes: start of the range in the file, in bytes.
        length_bytes: length of the range, in bytes.
        records: zip records to hash, with offsets relative to the range's start.
    """

    def __init__(self, fd: int, offset_bytes: int, length_bytes: int, records: list[ZipRecord] | None = None) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, offset_bytes, length_bytes, 0
        self.hashes = [_RecordHash(r) for r in records or ()]
        self.error: BaseException | None = None

    def readable(self) -> bool:
        """Always true."""
        return True

    def seekable(self) -> bool:
        """Always true."""
        return True

    def tell(self) -> int:
        """Position within the range, in bytes."""
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move within the range (clamped at 0); return the new position in bytes."""
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def pread(self, length: int, offset: int) -> bytes:
        """Read up to ``length`` bytes at ``offset`` within the range (fewer at its end)."""
        length = max(0, min(length, self._length - offset))
        return os.pread(self._fd, length, self._start + offset)

    def readinto(self, buffer: Any) -> int:
        """Read up to ``len(buffer)`` bytes of the range into ``buffer``; 0 at the end.

        torch.load calls this from C++; an exception (a read error, or Ctrl-C landing here) must
        not cross that code, so it is kept in ``error``, the read reports the end of the range,
        and the caller re-raises it once torch.load returns.
        """
        if self.error is not None:
            return 0
        try:
            return self._readinto(buffer)
        except BaseException as e:
            self.error = e
            return 0

    def _readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        got = os.preadv(self._fd, [view[:n]], self._start + self._pos)
        begin, end = self._pos, self._pos + got
        for h in self.hashes:
            lo, hi = max(begin, h.record.data_offset), min(end, h.record.data_offset + h.record.size)
            if lo >= hi:
                continue
            if lo == h.done_to and h.in_order:
                h.crc = zlib.crc32(view[lo - begin : hi - begin], h.crc)
                h.done_to = hi
            elif hi > h.done_to:
                h.in_order = False  # re-read once at the end
        self._pos = end
        return got

    def finish_crcs(self) -> list[tuple[ZipRecord, int]]:
        """Complete every record's CRC-32 (reading what torch did not) and return the mismatches.

        Returns:
            ``(record, computed_crc)`` for each record whose data does not match its stored CRC.
        """
        bad = []
        for h in self.hashes:
            end = h.record.data_offset + h.record.size
            if not h.in_order:
                h.crc, h.done_to = 0, h.record.data_offset
            while h.done_to < end:
                data = self.pread(min(end - h.done_to, 16 << 20), h.done_to)
                if not data:
                    break
                h.crc = zlib.crc32(data, h.crc)
                h.done_to += len(data)
            if h.crc != h.record.crc32:
                bad.append((h.record, h.crc))
        return bad


class ChunkReader:
    """Reads payloads from one checkpoint's data files, keeping one open descriptor per file.

    Use as a context manager; ``close`` releases the descriptors. One reader per thread.

    Args:
        checkpoint_id: the checkpoint folder.
        check_crc: check every zip record's CRC-32 of every payload read (torch.load does not).
    """

    def __init__(self, checkpoint_id: str | os.PathLike[str], *, check_crc: bool = True) -> None:
        self.root = as_location(checkpoint_id)
        self._temp_fd: int | None = None  # a remote byte range, fetched into memory
        self.check_crc = check_crc
        self._files: dict[str, tuple[int, int]] = {}  # relative path -> (fd, size in bytes)
        self._rank_files: dict[str, Any] = {}  # relative path -> loaded per-rank torch.save file
        # FSDP_CONVERT_READ_LOG=<folder>: one JSON line per chunk read, [rank, fqn, offsets, file,
        # offset, length], in reads-<pid>.jsonl (to see which worker read what)
        log_dir = os.environ.get(READ_LOG_ENV)
        self._read_log: IO[str] | None = open(Path(log_dir) / f"reads-{os.getpid()}.jsonl", "a") if log_dir else None  # noqa: SIM115
        self._last_storage_crc: int | None = None

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close every open data file."""
        for fd, _ in self._files.values():
            if fd >= 0:  # remote files have no descriptor
                os.close(fd)
        self._files.clear()
        self._drop_temp()
        self._rank_files.clear()
        if self._read_log is not None:
            self._read_log.close()
            self._read_log = None

    def _drop_temp(self) -> None:
        if self._temp_fd is not None:
            os.close(self._temp_fd)
            self._temp_fd = None

    def _range(self, relative_path: str, offset: int, length: int, where: str) -> tuple[int, int]:
        """A descriptor and the offset in it of a byte range of a data file, its end checked.

        Local: the data file itself. Remote: one ranged read of exactly the range into an
        anonymous in-memory file (kept until the next range), so decoding reads it the same way.

        Raises:
            MissingDataFileError: the data file is gone. CorruptChunkError: the range lies past its end.
        """
        fd, size = self._open(relative_path)
        if offset + length > size:
            raise CorruptChunkError(f"{where}: the range lies past the end of the file ({size} bytes); the file is truncated")
        if isinstance(self.root, Path):
            return fd, offset
        data = read_range(self.root / relative_path, offset, length)
        self._drop_temp()
        self._temp_fd = os.memfd_create("fsdp-convert-range")
        view = memoryview(data)
        while view:
            view = view[os.write(self._temp_fd, view) :]
        return self._temp_fd, 0

    def _open(self, relative_path: str) -> tuple[int, int]:
        """The data file's descriptor and size in bytes (remote: no descriptor, -1)."""
        opened = self._files.get(relative_path)
        if opened is None and isinstance(self.root, Url):
            size = size_of(self.root / relative_path)
            if size is None:
                raise MissingDataFileError(f"cannot open {self.root / relative_path}: No such object")
            opened = self._files[relative_path] = (-1, size)
        if opened is None:
            assert isinstance(self.root, Path)
            path = self.root / relative_path
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise MissingDataFileError(f"cannot open {path}: {e.strerror}") from e
            opened = (fd, os.fstat(fd).st_size)
            self._files[relative_path] = opened
        return opened

    def _where(self, relative_path: str, offset: int, length: int, fqn: str) -> str:
        return f"{self.root / relative_path} bytes [{offset}, {offset + length}) ({fqn})"

    def _load(self, relative_path: str, offset: int, length: int, transforms: tuple[str, ...], fqn: str) -> Any:
        """Decode the torch.save payload at a byte range with ``weights_only=True``."""
        where = self._where(relative_path, offset, length, fqn)
        if transforms:
            raise UnsupportedTransformError(
                f"{where}: written through stream transform(s) {list(transforms)}, which this tool does not decode"
            )
        fd, at = self._range(relative_path, offset, length, where)
        payload = ByteRangeFile(fd, at, length)
        if self.check_crc:
            try:
                payload.hashes = [_RecordHash(r) for r in read_records(payload.pread, length)]
            except ZipFormatError as e:
                raise CorruptChunkError(f"{where}: payload is not a torch.save zip ({e})") from e
        try:
            with torch_call():
                value = torch.load(cast(IO[bytes], payload), map_location="cpu", weights_only=True)
        except Exception as e:
            if payload.error is not None:
                raise payload.error from None  # the read failed or was interrupted: that is the cause
            self._check_crcs(payload, where)  # a corrupt record explains a decode failure best
            self._raise_decode_error(e, where)
        if payload.error is not None:
            raise payload.error
        self._check_crcs(payload, where)
        self._last_storage_crc = self._storage_crc(payload, value)
        return value

    @staticmethod
    def _storage_crc(payload: ByteRangeFile, value: Any) -> int | None:
        """The checked CRC-32 of a tensor payload's one storage record, if it is exactly the tensor's bytes."""
        if not isinstance(value, torch.Tensor) or not value.is_contiguous() or value.storage_offset() != 0:
            return None
        storages = [h for h in payload.hashes if h.record.short_name.startswith("data/")]
        if len(storages) != 1 or storages[0].record.size != value.nbytes:
            return None
        return storages[0].crc

    def _check_crcs(self, payload: ByteRangeFile, where: str) -> None:
        for record, computed in payload.finish_crcs():
            raise CorruptChunkError(
                f"{where}: CRC-32 mismatch in record {record.short_name} (stored {record.crc32:#010x}, "
                f"computed {computed:#010x}); the data file is corrupt"
            )

    @staticmethod
    def _raise_decode_error(e: Exception, where: str) -> NoReturn:
        if isinstance(e, pickle.UnpicklingError):
            # torch wraps every weights-only refusal in one message; the line naming the global
            # tells a hostile payload from a broken one.
            detail = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln), None)
            if detail is not None:
                raise UnsafeContentError(f"{where}: payload would run code, refused ({detail})") from e
            raise CorruptChunkError(f"{where}: payload does not decode as a torch.save object") from e
        # zip structure broken, truncated record
        raise CorruptChunkError(f"{where}: payload does not decode ({type(e).__name__}: {_first_line(e)})") from e

    def read_chunk(self, entry: TensorEntry, chunk: ChunkEntry) -> torch.Tensor:
        """Read and decode one chunk of ``entry``; shape ``chunk.sizes``, dtype ``entry.dtype``.

        Raises:
            MissingDataFileError, CorruptChunkError, UnsupportedTransformError, UnsafeContentError:
                as their names say.
            ShapeMismatchError: the payload's shape or dtype disagrees with ``.metadata``.
        """
        if chunk.relative_path is None:
            return torch.empty(chunk.sizes, dtype=entry.dtype)
        args = (chunk.relative_path, chunk.offset_bytes, chunk.length_bytes)
        if self._read_log is not None:
            self._read_log.write(json.dumps([os.environ.get("RANK", "0"), entry.fqn, list(chunk.offsets), *args]) + "\n")
            self._read_log.flush()
        if chunk.encoding == "raw":
            return self._read_raw_box(entry, chunk)
        if chunk.encoding == "rank_file":
            self._last_storage_crc = None
            tensor = local_value(self._rank_file(chunk.relative_path), chunk.record)
        else:
            tensor = self._load(*args, chunk.transform_descriptors, entry.fqn)
        if not isinstance(tensor, torch.Tensor):
            raise ShapeMismatchError(f"{self._where(*args, entry.fqn)}: payload is a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != chunk.sizes or tensor.dtype != entry.dtype:
            raise ShapeMismatchError(
                f"{self._where(*args, entry.fqn)}: payload is {tensor.dtype} {list(tensor.shape)}, "
                f".metadata says {entry.dtype} {list(chunk.sizes)}"
            )
        return tensor

    def read_tensor(self, entry: TensorEntry) -> torch.Tensor:
        """Assemble the full tensor of ``entry`` from its chunks, on CPU.

        Returns:
            A contiguous tensor of shape ``entry.shape`` and dtype ``entry.dtype``.

        Warning:
            Holds the full tensor (``entry.nbytes`` bytes) plus one decoded chunk at a time.

        Raises:
            As ``read_chunk``. Coverage is checked by the planner (``plan.check_coverage``).
        """
        return self.read_tensor_with_crc(entry)[0]

    def read_tensor_with_crc(self, entry: TensorEntry) -> tuple[torch.Tensor, int | None]:
        """``read_tensor``, plus the CRC-32 of the full tensor's bytes when it comes for free.

        With CRC checking on and chunks that split only dim 0 (so the full tensor is the chunks'
        bytes back to back), the checked chunk CRCs are combined; otherwise the CRC is None.

        Raises:
            As ``read_chunk``.
        """
        chunks = sorted((c for c in entry.chunks if c.numel > 0), key=lambda c: c.offsets)
        dim0_only = all(c.offsets[1:] == (0,) * (len(c.offsets) - 1) and c.sizes[1:] == entry.shape[1:] for c in chunks)
        parts: list[tuple[int, int]] | None = [] if self.check_crc and dim0_only else None
        if len(chunks) == 1 and chunks[0].sizes == entry.shape:
            tensor = self.read_chunk(entry, chunks[0])
            crc = self._last_storage_crc if parts is not None else None
            return tensor.contiguous(), crc
        full = torch.empty(entry.shape, dtype=entry.dtype)
        for chunk in chunks:
            box = full
            for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                box = box.narrow(dim, offset, size)
            box.copy_(self.read_chunk(entry, chunk))
            if parts is not None:
                if self._last_storage_crc is None:
                    parts = None
                else:
                    parts.append((self._last_storage_crc, chunk.numel * entry.dtype.itemsize))
        return full, (combine(parts) if parts else None)

    def read_box(self, entry: TensorEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """Read the box ``[offsets, offsets + sizes)`` (in elements) of ``entry`` from the chunks it meets.

        Only chunks that intersect the box are read; each is freed once its part is copied.

        Returns:
            A contiguous tensor of shape ``sizes`` and dtype ``entry.dtype``.

        Raises:
            As ``read_chunk``.
        """
        box = torch.empty(sizes, dtype=entry.dtype)
        for chunk in entry.chunks:
            lo = [max(o, co) for o, co in zip(offsets, chunk.offsets, strict=True)]
            hi = [min(o + s, co + cs) for o, s, co, cs in zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=True)]
            if chunk.numel == 0 or any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            data = self.read_chunk(entry, chunk)
            dst, src = box, data
            for dim, (a, b) in enumerate(zip(lo, hi, strict=True)):
                dst = dst.narrow(dim, a - offsets[dim], b - a)
                src = src.narrow(dim, a - chunk.offsets[dim], b - a)
            dst.copy_(src)
        return box

    def _rank_file(self, relative_path: str) -> Any:
        """A per-rank torch.save file, loaded once (memory-mapped) and kept while the reader is open."""
        loaded = self._rank_files.get(relative_path)
        if loaded is None:
            path = self.root / relative_path
            if isinstance(path, Url):
                raise InvalidOptionError(f"{path}: per-rank torch.save files are read from local paths only")
            if not path.is_file():
                raise MissingDataFileError(f"cannot open {path}: No such file")
            loaded = self._rank_files[relative_path] = load_rank_file(path)
        return loaded

    def _read_raw_box(self, entry: TensorEntry, chunk: ChunkEntry) -> torch.Tensor:
        """A box stored as its bare elements (a safetensors tensor's data), read with one pread."""
        assert chunk.relative_path is not None
        where = self._where(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, entry.fqn)
        if chunk.length_bytes != chunk.numel * entry.dtype.itemsize:
            raise ShapeMismatchError(f"{where}: {chunk.length_bytes} bytes cannot hold {entry.dtype} {list(chunk.sizes)}")
        fd, at = self._range(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, where)
        self._last_storage_crc = None
        buffer = bytearray(chunk.length_bytes)
        if chunk.length_bytes and os.preadv(fd, [buffer], at) != chunk.length_bytes:
            raise CorruptChunkError(f"{where}: short read; the file changed while it was read")
        return (
            torch.frombuffer(buffer, dtype=entry.dtype).reshape(chunk.sizes)
            if chunk.length_bytes
            else torch.empty(chunk.sizes, dtype=entry.dtype)
        )

    def read_raw(self, entry: BytesEntry) -> bytes:
        """A bytes entry's payload exactly as stored (to carry it over unchanged).

        Raises:
            MissingDataFileError, CorruptChunkError (truncated file).
        """
        if entry.encoding == "rank_file":
            buf = io.BytesIO()
            torch.save(self.read_value(entry), buf)
            return buf.getvalue()
        self.read_value(entry)  # decode once: refuses a hostile or corrupt payload before it is copied
        where = self._where(entry.relative_path, entry.offset_bytes, entry.length_bytes, entry.fqn)
        fd, at = self._range(entry.relative_path, entry.offset_bytes, entry.length_bytes, where)
        return os.pread(fd, entry.length_bytes, at)

    def read_value(self, entry: BytesEntry) -> Any:
        """Decode a bytes entry: the plain Python value (float, tuple, list of FQNs, ...).

        Raises:
            MissingDataFileError, CorruptChunkError, UnsupportedTransformError, UnsafeContentError.
        """
        if entry.encoding == "rank_file":
            return local_value(self._rank_file(entry.relative_path), entry.record)
        return self._load(entry.relative_path, entry.offset_bytes, entry.length_bytes, entry.transform_descriptors, entry.fqn)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
