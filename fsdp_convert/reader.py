"""Read stage: byte ranges of DCP data files to tensors and values.

Each payload is read with ``os.pread`` of its byte range (never the whole data file) and
decoded with ``torch.load(weights_only=True)``, so a payload cannot run code. A tensor's chunks
are copied into one preallocated full tensor; the chunk buffers are released as soon as copied.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from fsdp_convert.errors import (
    CorruptChunkError,
    MissingDataFileError,
    ShapeMismatchError,
    UnsafeContentError,
    UnsupportedTransformError,
)
from fsdp_convert.metadata import BytesEntry, CheckpointIndex, ChunkEntry, TensorEntry

__all__ = ["check_data_files", "ChunkReader"]


def check_data_files(index: CheckpointIndex) -> None:
    """Check that every data file ``.metadata`` names exists and is readable.

    Raises:
        MissingDataFileError: naming the first missing or unreadable file.
    """
    for name in index.data_files:
        path = index.checkpoint_id / name
        if not path.is_file():
            raise MissingDataFileError(f"{path} is missing; .metadata names it as a data file")
        if not os.access(path, os.R_OK):
            raise MissingDataFileError(f"{path} is not readable (permission denied)")


class ChunkReader:
    """Reads payloads from one checkpoint's data files, keeping one open descriptor per file.

    Use as a context manager; ``close`` releases the descriptors. Not thread-safe.
    """

    def __init__(self, checkpoint_id: str | os.PathLike[str]) -> None:
        self.root = Path(checkpoint_id)
        self._fds: dict[str, int] = {}

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close every open data file."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _fd(self, relative_path: str) -> int:
        fd = self._fds.get(relative_path)
        if fd is None:
            path = self.root / relative_path
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise MissingDataFileError(f"cannot open {path}: {e.strerror}") from e
            self._fds[relative_path] = fd
        return fd

    def read_range(self, relative_path: str, offset_bytes: int, length_bytes: int, fqn: str) -> bytes:
        """Read ``length_bytes`` bytes at ``offset_bytes`` of a data file.

        Raises:
            MissingDataFileError: the file cannot be opened.
            CorruptChunkError: the file ends before the range does (truncated file).
        """
        fd = self._fd(relative_path)
        data = os.pread(fd, length_bytes, offset_bytes)
        if len(data) != length_bytes:
            end = offset_bytes + length_bytes
            raise CorruptChunkError(
                f"{self.root / relative_path}: bytes [{offset_bytes}, {end}) of {fqn} lie past the end of the file "
                f"({offset_bytes + len(data)} bytes); the file is truncated"
            )
        return data

    def _payload(self, relative_path: str, offset: int, length: int, transforms: tuple[str, ...], fqn: str) -> bytes:
        if transforms:
            raise UnsupportedTransformError(
                f"{fqn}: payload in {self.root / relative_path} was written through stream transform(s) "
                f"{list(transforms)}, which this tool does not decode"
            )
        return self.read_range(relative_path, offset, length, fqn)

    def _where(self, relative_path: str, offset: int, length: int, fqn: str) -> str:
        return f"{self.root / relative_path} bytes [{offset}, {offset + length}) ({fqn})"

    def _load(self, data: bytes, where: str) -> Any:
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            # torch wraps every weights-only refusal in one message; the line naming the global
            # tells a hostile payload from a broken one.
            detail = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln), None)
            if detail is not None:
                raise UnsafeContentError(f"{where}: payload would run code, refused ({detail})") from e
            raise CorruptChunkError(f"{where}: payload does not decode as a torch.save object") from e
        except Exception as e:  # zip structure broken, truncated record, bad CRC
            raise CorruptChunkError(f"{where}: payload does not decode ({type(e).__name__}: {_first_line(e)})") from e

    def read_chunk(self, entry: TensorEntry, chunk: ChunkEntry) -> torch.Tensor:
        """Read and decode one chunk of ``entry``; shape ``chunk.sizes``, dtype ``entry.dtype``.

        Raises:
            MissingDataFileError, CorruptChunkError, UnsupportedTransformError: as their names say.
            ShapeMismatchError: the payload's shape or dtype disagrees with ``.metadata``.
        """
        if chunk.relative_path is None:
            return torch.empty(chunk.sizes, dtype=entry.dtype)
        where = self._where(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, entry.fqn)
        data = self._payload(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, chunk.transform_descriptors, entry.fqn)
        tensor = self._load(data, where)
        if not isinstance(tensor, torch.Tensor):
            raise ShapeMismatchError(f"{where}: payload is a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != chunk.sizes or tensor.dtype != entry.dtype:
            raise ShapeMismatchError(
                f"{where}: payload is {tensor.dtype} {list(tensor.shape)}, .metadata says {entry.dtype} {list(chunk.sizes)}"
            )
        return tensor

    def read_tensor(self, entry: TensorEntry) -> torch.Tensor:
        """Assemble the full tensor of ``entry`` from its chunks, on CPU.

        Returns:
            A contiguous tensor of shape ``entry.shape`` and dtype ``entry.dtype``.

        Warning:
            Holds the full tensor in memory (``entry.nbytes`` bytes) plus one chunk at a time.

        Raises:
            As ``read_chunk``. Coverage is checked by the planner (``plan.check_coverage``).
        """
        if len(entry.chunks) == 1 and entry.chunks[0].sizes == entry.shape:
            return self.read_chunk(entry, entry.chunks[0]).contiguous()
        full = torch.empty(entry.shape, dtype=entry.dtype)
        for chunk in entry.chunks:
            if chunk.numel == 0:
                continue
            box = full
            for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                box = box.narrow(dim, offset, size)
            box.copy_(self.read_chunk(entry, chunk))
        return full

    def read_value(self, entry: BytesEntry) -> Any:
        """Decode a bytes entry: the plain Python value (float, tuple, list of FQNs, ...).

        Raises:
            MissingDataFileError, CorruptChunkError, UnsupportedTransformError, UnsafeContentError.
        """
        where = self._where(entry.relative_path, entry.offset_bytes, entry.length_bytes, entry.fqn)
        data = self._payload(entry.relative_path, entry.offset_bytes, entry.length_bytes, entry.transform_descriptors, entry.fqn)
        return self._load(data, where)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
