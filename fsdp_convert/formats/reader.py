"""Read stage, shared by the chunked formats: data file handles, the read log, boxes to full tensors.

Each source format's reader (``dcp.DcpReader``, ``rank_files.RankFilesReader``,
``hf_storage.HfStorageReader``) subclasses ``ChunkedReader`` and says how one stored chunk of
its own becomes a tensor (``_load_chunk``); assembling a full tensor or an arbitrary box from the
chunks it meets is the same for all of them. A tensor's chunks are copied into one preallocated
tensor, each chunk freed once copied.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

from fsdp_convert.constants import READ_LOG_ENV
from fsdp_convert.errors import CorruptChunkError, MissingDataFileError, ShapeMismatchError
from fsdp_convert.formats.crc import crc32
from fsdp_convert.formats.index import BytesEntry, ChunkEntry, Location, TensorEntry, Url, ValueShapeError, check_value
from fsdp_convert.held_roots import follows_symlinks, open_inside
from fsdp_convert.remote import as_location, read_range, size_of

if TYPE_CHECKING:  # torch is imported where bytes are turned into tensors: inspect reads no tensor
    import torch

__all__ = ["check_crc", "checked_value", "ChunkedReader", "StoredBytes", "check_payload", "read_bare_chunk"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredBytes:
    """Where one chunk's elements lie as they are, row-major and contiguous, in an open data file.

    Moving them needs no decode: the ``nbytes`` bytes at ``offset`` of ``fd`` are the chunk's
    tensor (shape ``chunk.sizes``, dtype ``entry.dtype``, native byte order) in C order.

    Attributes:
        fd: an open descriptor of the data file (owned by the reader; valid until it closes).
        offset: start of the elements in the file, in bytes.
        nbytes: their length, in bytes (``chunk.numel * itemsize``).
        crc32: the CRC-32 the format stores for exactly these bytes, to check as they pass; None
            when it stores none or checking is off.
        where: the file, byte range and FQN, for error messages.
    """

    fd: int
    offset: int
    nbytes: int
    crc32: int | None
    where: str


def check_crc(stored: StoredBytes, crc: int) -> None:
    """Raise ``CorruptChunkError`` when ``crc`` is not the chunk's stored CRC-32 (none stored: nothing to check)."""
    if stored.crc32 is not None and crc != stored.crc32:
        raise CorruptChunkError(f"{stored.where}: CRC-32 mismatch in the storage record; the data file is corrupt")


def checked_value(value: Any, where: str) -> Any:
    """``value`` (a bytes entry's, as read) when ``index.check_value`` admits it: not too deep, not holding itself.

    Raises:
        CorruptChunkError: it does not (names ``where``): the writers, ``verify`` and torch's own
            loader walk values recursively.
    """
    try:
        check_value(value)
    except ValueShapeError as e:
        raise CorruptChunkError(f"{where}: {e}; this tool does not read it") from None
    return value


def check_payload(entry: TensorEntry, chunk: ChunkEntry, tensor: Any, where: str) -> torch.Tensor:
    """``tensor``, if it is a tensor of the chunk's shape and the entry's dtype.

    Raises:
        ShapeMismatchError: it is not (the payload disagrees with the index), naming ``where``.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ShapeMismatchError(f"{where}: payload is a {type(tensor).__name__}, not a tensor")
    if tuple(tensor.shape) != chunk.sizes or tensor.dtype != entry.dtype:
        raise ShapeMismatchError(
            f"{where}: payload is {tensor.dtype} {list(tensor.shape)}, .metadata says {entry.dtype} {list(chunk.sizes)}"
        )
    return tensor


class ChunkedReader:
    """Reads one checkpoint's chunks, keeping one open descriptor per data file.

    Use as a context manager; ``close`` releases the descriptors. One reader per thread.
    Subclasses implement ``_load_chunk``, ``read_value`` and ``read_raw``.

    Args:
        checkpoint_id: the checkpoint folder (local, or an fsspec URL).
        check_crc: check the CRC-32s the format stores, for every payload read.
        follow_symlinks: read data files that symbolic links lead to outside the folder; None:
            the process's setting (``location.follows_symlinks``), taken now.
    """

    def __init__(
        self, checkpoint_id: str | os.PathLike[str] | Location, *, check_crc: bool = True, follow_symlinks: bool | None = None
    ) -> None:
        self.root = as_location(checkpoint_id)
        self.check_crc = check_crc
        self.follow_symlinks = follows_symlinks(follow_symlinks)
        self._shown: dict[str, str] = {}  # a data file's path as messages show it, joined once (not per chunk)
        self._temp_fd: int | None = None  # a remote byte range, fetched into memory
        self._files: dict[str, tuple[int, int]] = {}  # relative path -> (fd, size in bytes)
        # FSDP_CONVERT_READ_LOG=<folder>: one JSON line per chunk read, [rank, fqn, offsets, file,
        # offset, length], in reads-<pid>.jsonl (to see which worker read what)
        log_dir = os.environ.get(READ_LOG_ENV)
        self._read_log: IO[str] | None = open(Path(log_dir) / f"reads-{os.getpid()}.jsonl", "a") if log_dir else None  # noqa: SIM115

    def __enter__(self) -> ChunkedReader:
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
        """The data file's descriptor and size in bytes (remote: no descriptor, -1).

        Raises:
            MissingDataFileError: it cannot be opened. UnsafeContentError: a link out of the
                folder (``location.open_inside``). CorruptChunkError: not a regular file.
        """
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
                fd = open_inside(self.root, path, follow_symlinks=self.follow_symlinks)
            except OSError as e:
                raise MissingDataFileError(f"cannot open {path}: {e.strerror}") from e
            opened = (fd, os.fstat(fd).st_size)
            self._files[relative_path] = opened
        return opened

    def _where(self, relative_path: str, offset: int, length: int, fqn: str) -> str:
        shown = self._shown.get(relative_path)
        if shown is None:
            shown = self._shown[relative_path] = str(self.root / relative_path)
        return f"{shown} bytes [{offset}, {offset + length}) ({fqn})"

    def _load_chunk(self, entry: TensorEntry, chunk: ChunkEntry) -> Any:
        """The stored value of one chunk (a tensor, checked by ``read_chunk``); the format's own read."""
        raise NotImplementedError

    def read_value(self, entry: BytesEntry) -> Any:
        """Decode a bytes entry: the plain Python value (float, tuple, list of FQNs, ...)."""
        raise NotImplementedError

    def read_raw(self, entry: BytesEntry) -> bytes:
        """A bytes entry as DCP stores it: a torch.save payload."""
        raise NotImplementedError

    def locate(self, entry: TensorEntry, chunk: ChunkEntry) -> StoredBytes | None:
        """Where ``chunk``'s elements lie in its data file, checked against the index; None: use ``read_chunk``.

        Raises:
            MissingDataFileError, CorruptChunkError, UnsafeContentError, ShapeMismatchError: as ``read_chunk``.
        """
        return None

    def _log_read(self, entry: TensorEntry, chunk: ChunkEntry) -> None:
        if self._read_log is not None:
            args = (chunk.relative_path, chunk.offset_bytes, chunk.length_bytes)
            self._read_log.write(json.dumps([os.environ.get("RANK", "0"), entry.fqn, list(chunk.offsets), *args]) + "\n")
            self._read_log.flush()

    def read_chunk(self, entry: TensorEntry, chunk: ChunkEntry) -> torch.Tensor:
        """Read and decode one chunk of ``entry``; shape ``chunk.sizes``, dtype ``entry.dtype``.

        Raises:
            MissingDataFileError, CorruptChunkError, UnsupportedTransformError, UnsafeContentError:
                as their names say.
            ShapeMismatchError: the stored shape or dtype disagrees with the index.
        """
        import torch

        if chunk.relative_path is None:
            return torch.empty(chunk.sizes, dtype=entry.dtype.torch)
        self._log_read(entry, chunk)
        tensor = self._load_chunk(entry, chunk)
        return check_payload(
            entry, chunk, tensor, self._where(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, entry.fqn)
        )

    def read_tensor(self, entry: TensorEntry) -> torch.Tensor:
        """Assemble the full tensor of ``entry`` from its chunks, on CPU.

        Returns:
            A contiguous tensor of shape ``entry.shape`` and dtype ``entry.dtype``.

        Warning:
            Holds the full tensor (``entry.nbytes`` bytes) plus one decoded chunk at a time.

        Raises:
            As ``read_chunk``. Coverage is checked by the planner (``index.check_coverage``).
        """
        whole = [c for c in entry.chunks if c.numel > 0 and c.sizes == entry.shape]
        if whole:  # stored in one piece: no copy into a new tensor
            return self.read_chunk(entry, whole[0]).contiguous()
        return self.read_box(entry, (0,) * len(entry.shape), entry.shape)

    def read_box(self, entry: TensorEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """Read the box ``[offsets, offsets + sizes)`` (in elements) of ``entry`` from the chunks it meets.

        Only chunks that intersect the box are read; each is freed once its part is copied.

        Returns:
            A contiguous tensor of shape ``sizes`` and dtype ``entry.dtype``.

        Raises:
            As ``read_chunk``.
        """
        import torch

        box = torch.empty(sizes, dtype=entry.dtype.torch)
        for chunk in entry.chunks:
            lo = [max(o, co) for o, co in zip(offsets, chunk.offsets, strict=True)]
            hi = [min(o + s, co + cs) for o, s, co, cs in zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=True)]
            if chunk.numel == 0 or any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            if _read_in_place(self, entry, chunk, box, offsets):
                continue
            data = self.read_chunk(entry, chunk)
            dst, src = box, data
            for dim, (a, b) in enumerate(zip(lo, hi, strict=True)):
                dst = dst.narrow(dim, a - offsets[dim], b - a)
                src = src.narrow(dim, a - chunk.offsets[dim], b - a)
            dst.copy_(src)
        return box


def _read_in_place(
    reader: ChunkedReader, entry: TensorEntry, chunk: ChunkEntry, box: torch.Tensor, offsets: tuple[int, ...]
) -> bool:
    """Read a chunk that lies whole in ``box`` as whole rows straight into its bytes, undecoded; False: not so stored.

    A chunk whose elements the format stores as they are (``locate``) and that spans the box's
    every dimension but the first is one contiguous byte range of ``box`` (contiguous, C order).

    Raises:
        As ``locate``; CorruptChunkError: a short read or a CRC-32 mismatch.
    """
    inner = all(co == o and cs == s for co, o, cs, s in zip(chunk.offsets[1:], offsets[1:], chunk.sizes[1:], box.shape[1:]))
    rows = chunk.offsets[0] - offsets[0] if chunk.offsets else 0
    if not inner or rows < 0 or rows + (chunk.sizes[0] if chunk.sizes else 1) > (box.shape[0] if chunk.sizes else 1):
        return False
    stored = reader.locate(entry, chunk)
    if stored is None or stored.nbytes != chunk.numel * box.element_size():
        return False
    row_bytes = box.element_size() * (math.prod(box.shape[1:]) if chunk.sizes else 1)
    _pread_into(stored, box.data_ptr() + rows * row_bytes)
    return True


def _pread_into(stored: StoredBytes, address: int) -> None:
    """Read ``stored``'s bytes into the memory at ``address`` (``stored.nbytes`` writable bytes), checking its CRC-32.

    Raises:
        CorruptChunkError: a short read (the file changed while it was read), or a CRC-32 mismatch.
    """
    view = memoryview((ctypes.c_char * stored.nbytes).from_address(address)).cast("B")
    done = 0
    while done < stored.nbytes:  # one preadv moves at most about 2 GiB
        got = os.preadv(stored.fd, [view[done:]], stored.offset + done)
        if got <= 0:
            raise CorruptChunkError(f"{stored.where}: short read; the file changed while it was read")
        done += got
    if stored.crc32 is not None:
        check_crc(stored, crc32(view))


def read_bare_chunk(fd: int, at: int, entry: TensorEntry, chunk: ChunkEntry, where: str) -> torch.Tensor:
    """A chunk stored as its bare elements at byte ``at`` of ``fd``, read into a new tensor.

    As ``FileSystemWriter(serialization_format=SAFETENSORS)`` stores a chunk (``_dcp_payloads``).

    Raises:
        CorruptChunkError: a short read (the file changed while it was read).
    """
    import torch

    if chunk.length_bytes == 0:
        return torch.empty(chunk.sizes, dtype=entry.dtype.torch)
    buffer = bytearray(chunk.length_bytes)
    if os.preadv(fd, [buffer], at) != chunk.length_bytes:
        raise CorruptChunkError(f"{where}: short read; the file changed while it was read")
    return torch.frombuffer(buffer, dtype=entry.dtype.torch).reshape(chunk.sizes)
