"""torch.save files whose tensors are byte ranges copied from other files: a DeepSpeed save for another world size.

A ZeRO partition for ``M`` ranks (``plan/deepspeed.py``) is made of parameters' flat ranges that
lie, as they are, in the source's partitions: moving it is copying byte ranges, with zeros where
DeepSpeed pads. Each output storage is a ``CopiedTensor``: its ``TensorSlot`` and the copies that
fill it (gaps stay zero); ``write_copied_file`` places the file as ``writers.torch_save`` does
(storage records first, at known offsets), fills each storage in order while computing its CRC-32,
then writes the headers and ``data.pkl`` (``write_torch_save_headers``). Memory: one copy buffer
per storage being filled; nothing else is held.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fsdp_convert.dtypes import is_tensor
from fsdp_convert.errors import CorruptChunkError
from fsdp_convert.formats.crc import crc32
from fsdp_convert.formats.index import ObjPath
from fsdp_convert.writers.torch_save import TensorSlot, torch_save_offsets, write_torch_save_headers

__all__ = ["ByteCopy", "CopiedTensor", "write_copied_files"]

_BUFFER = 8 << 20  # bytes read and written per step of a copy
_ZEROS = bytes(1 << 20)


@dataclass(frozen=True, slots=True)
class ByteCopy:
    """``nbytes`` bytes at ``src_offset`` of source file ``src`` go to ``dst_offset`` of a storage (bytes)."""

    src: str
    src_offset: int
    nbytes: int
    dst_offset: int


@dataclass(frozen=True, slots=True)
class CopiedTensor:
    """An output tensor (contiguous, its own storage) filled by ``copies``, sorted and not overlapping; gaps are zeros."""

    slot: TensorSlot
    copies: tuple[ByteCopy, ...]


FileItems = Sequence[tuple[ObjPath, Any]]  # (path, CopiedTensor, a small torch.Tensor, or a plain value)


def _fill(fd: int, at: int, tensor: CopiedTensor, source_fd: Callable[[str], int]) -> int:
    """Write ``tensor``'s copies into ``fd`` at byte ``at``, in order; the CRC-32 of its storage's bytes.

    Raises:
        CorruptChunkError: a source file is shorter than a copy needs.
    """
    largest = max((c.nbytes for c in tensor.copies), default=1)
    crc, pos, buffer = 0, 0, bytearray(min(_BUFFER, max(largest, 1)))  # no larger than the largest copy
    view = memoryview(buffer)
    for copy in (*tensor.copies, ByteCopy("", 0, 0, tensor.slot.nbytes)):
        while pos < copy.dst_offset:  # a gap: zeros (the file is sparse there)
            step = min(len(_ZEROS), copy.dst_offset - pos)
            crc, pos = crc32(_ZEROS[:step], crc), pos + step
        done = 0
        while done < copy.nbytes:
            step = min(len(buffer), copy.nbytes - done)
            got = os.preadv(source_fd(copy.src), [view[:step]], copy.src_offset + done)
            if got != step:
                raise CorruptChunkError(f"{copy.src}: short read at byte {copy.src_offset + done}; the file is truncated")
            written = 0
            while written < step:  # a write may be short
                written += os.pwrite(fd, view[written:step], at + pos + written)
            crc, pos, done = crc32(view[:step], crc), pos + step, done + step
    return crc


def write_copied_files(files: Sequence[tuple[int, FileItems]], source_fd: Callable[[str], int], workers: int) -> int:
    """Write torch.save files of ``CopiedTensor`` s and values; their total size, in bytes.

    Args:
        files: per file, an open descriptor (empty, writable) and its items in order: a
            ``CopiedTensor``, a small ``torch.Tensor`` (written with the headers), or a plain value
            (``writers._torch_pickle``'s stand-ins included).
        source_fd: an open descriptor of a source file, by its name in the copies (thread-safe: ``pread`` only).
        workers: threads filling storages side by side.

    Raises:
        CorruptChunkError: a source file is shorter than a copy needs. OSError: a write failed.
    """
    jobs = []
    placed = []
    for fd, items in files:
        slots = [
            v.slot if isinstance(v, CopiedTensor) else TensorSlot(v.dtype, tuple(v.shape)) if is_tensor(v) else None
            for _, v in items
        ]
        offsets = torch_save_offsets(slots)
        placed.append(offsets)
        jobs += [(fd, j, offsets[j], v) for j, (_, v) in enumerate(items) if isinstance(v, CopiedTensor)]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        crcs = list(pool.map(lambda job: _fill(job[0], job[2], job[3], source_fd), jobs))
    by_file: dict[int, dict[int, int]] = {}
    for (fd, j, _, _), crc in zip(jobs, crcs, strict=True):
        by_file.setdefault(fd, {})[j] = crc
    total = 0
    for (fd, items), offsets in zip(files, placed, strict=True):
        rows = [(path, v.slot if isinstance(v, CopiedTensor) else v) for path, v in items]
        total += write_torch_save_headers(fd, rows, by_file.get(fd, {}), offsets)
    return total
