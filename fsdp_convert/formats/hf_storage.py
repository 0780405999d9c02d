"""DCP checkpoints written as safetensors (torch's ``HuggingFaceStorageWriter``): index from headers, raw reads.

``torch/distributed/checkpoint/hf_storage.py`` writes each rank's chunks as tensors of a
safetensors file (``shard-00001-model-00001-of-00001.safetensors``) with no ``.metadata``; the
header's ``__metadata__["DCP_SHARDING_INFO"]`` is a JSON string mapping each FQN to
``{"saved_offsets": [...]}``, the chunk's offsets in the global tensor. The global shape is not
stored: like torch's ``HuggingFaceStorageReader``, it is the largest offset + size per dim. A
safetensors file without sharding info (a consolidated or plain Hugging Face file) holds whole
tensors. The index comes from the headers alone; a chunk is read as its raw elements, with one pread.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from fsdp_convert.constants import SAFETENSORS_TO_TORCH, torch_shape
from fsdp_convert.errors import CorruptChunkError, NotADcpCheckpointError, ShapeMismatchError
from fsdp_convert.formats._dcp_payloads import SHARDING_INFO_KEY
from fsdp_convert.formats.file_reads import read_safetensors_header as read_header
from fsdp_convert.formats.index import BytesEntry, CheckpointIndex, ChunkEntry, Entry, TensorEntry
from fsdp_convert.formats.reader import ChunkedReader, StoredBytes
from fsdp_convert.output_table import SAFETENSORS_SUFFIXES

__all__ = [
    "SHARDING_INFO_KEY",
    "read_header",
    "safetensors_files",
    "has_sharding_info",
    "describe_safetensors_dcp",
    "HfStorageReader",
]

_SHARD_FILE_RE = re.compile(r"^shard-(\d+)-")  # shard-<rank + 1>-model-<i>-of-<n>.safetensors


def safetensors_files(root: Path) -> list[Path]:
    """The ``*.safetensors`` files directly in ``root``, sorted."""
    return sorted(p for p in root.iterdir() if p.suffix in SAFETENSORS_SUFFIXES and p.is_file())


def has_sharding_info(root: Path) -> bool:
    """True when a safetensors file in ``root`` carries DCP sharding info (``HuggingFaceStorageWriter``).

    Raises:
        UnsafeContentError: a safetensors file is a symbolic link out of ``root`` (``location.open_inside``).
    """
    for path in safetensors_files(root):
        try:
            meta = read_header(path, root=root)[0].get("__metadata__") or {}
        except CorruptChunkError:
            continue  # an unrelated or broken file does not make the folder a checkpoint
        if isinstance(meta, dict) and SHARDING_INFO_KEY in meta:
            return True
    return False


def _sharding_info(path: Path, header: dict[str, Any]) -> dict[str, list[int]]:
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or SHARDING_INFO_KEY not in meta:
        return {}
    try:
        info = json.loads(meta[SHARDING_INFO_KEY])
        return {str(fqn): _naturals(v["saved_offsets"]) for fqn, v in info.items()}
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        # _naturals' own words; anything else by its kind only (a KeyError or JSON error would quote the file)
        said = str(e) if str(e) == _NOT_NATURALS else type(e).__name__
        raise NotADcpCheckpointError(f"{path}: malformed {SHARDING_INFO_KEY} ({said})") from e


_NOT_NATURALS = "not a list of non-negative integers"


def _naturals(values: Any) -> list[int]:
    """A JSON list of non-negative integers, or ValueError."""
    if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
        raise ValueError(_NOT_NATURALS)  # the file's text is not quoted
    return values


def describe_safetensors_dcp(root: Path) -> CheckpointIndex:
    """Index the safetensors files of ``root`` as DCP chunks (see the module docstring).

    Keys stand at the top level, as the state dict given to ``dcp.save`` had them (a model's
    FQNs), so they are model weights. Dtypes come from ``constants.SAFETENSORS_TO_TORCH`` and
    shapes through ``constants.torch_shape`` (an ``F4`` header counts 4-bit values, two per
    ``float4_e2m1fn_x2`` element).

    Raises:
        NotADcpCheckpointError: no safetensors file, malformed sharding info or header entries, a
            dtype name not in the table, or two files that disagree on a tensor's dtype or number of dims.
        CorruptChunkError: an unreadable header, or a tensor's byte range that lies outside its
            file, does not fit its shape, or overlaps another tensor's.
        UnsafeContentError: a safetensors file is a symbolic link out of ``root`` (``location.open_inside``).
    """
    files = safetensors_files(root)
    if not files:
        raise NotADcpCheckpointError(f"{root} has no .metadata and no safetensors files; not a checkpoint")
    chunks: dict[str, list[ChunkEntry]] = {}
    dtypes: dict[str, Any] = {}
    sharded = False
    for path in files:
        header, data_start = read_header(path, root=root)
        offsets_of = _sharding_info(path, header)
        ranges: list[tuple[int, int, str]] = []  # (begin, end, FQN) of each tensor's data in this file
        sharded |= bool(offsets_of)
        size = path.stat().st_size
        for fqn, desc in header.items():
            try:
                dtype = SAFETENSORS_TO_TORCH.get(desc["dtype"]) if isinstance(desc["dtype"], str) else None
                if dtype is None:
                    raise ValueError("a dtype this tool does not read")  # the name is the file's text: not quoted
                shape = torch_shape(dtype, _naturals(desc["shape"]))
                begin, end = _naturals(desc["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                said = str(e) if isinstance(e, ValueError) else type(e).__name__  # our own words, or the kind alone
                raise NotADcpCheckpointError(f"{path}: malformed header entry for {fqn} ({said})") from e
            where = f"{path} ({fqn})"
            if dtypes.setdefault(fqn, dtype) != dtype:
                raise NotADcpCheckpointError(f"{where}: dtype {dtype} differs from another file's {dtypes[fqn]}")
            if not 0 <= begin <= end or data_start + end > size or end - begin != math.prod(shape) * dtype.itemsize:
                # begin and end are the file's bytes: not quoted
                raise CorruptChunkError(f"{where}: its data range does not hold {dtype} {list(shape)} in the file")
            ranges.append((begin, end, fqn))
            offsets = tuple(offsets_of.get(fqn, (0,) * len(shape)))
            if len(offsets) != len(shape):
                raise NotADcpCheckpointError(f"{where}: saved_offsets {list(offsets)} do not match shape {list(shape)}")
            chunks.setdefault(fqn, []).append(
                ChunkEntry(
                    offsets=offsets, sizes=shape, relative_path=path.name, offset_bytes=data_start + begin,
                    length_bytes=end - begin,
                )
            )  # fmt: skip
        _check_disjoint(path, ranges)
    entries: list[Entry] = []
    for fqn, parts in chunks.items():
        ndim = len(parts[0].sizes)
        if any(len(c.sizes) != ndim for c in parts):
            raise NotADcpCheckpointError(f"{root}: the shards of {fqn} disagree on its number of dims")
        shape = tuple(max(c.offsets[d] + c.sizes[d] for c in parts) for d in range(ndim))
        nonempty = tuple(c for c in parts if c.numel > 0) or tuple(parts[:1])
        entries.append(TensorEntry(fqn=fqn, path=(fqn,), shape=shape, dtype=dtypes[fqn], chunks=nonempty))
    writers = {m.group(1) for p in files if (m := _SHARD_FILE_RE.match(p.name))}
    return CheckpointIndex(
        checkpoint_id=root,
        entries=tuple(entries),
        data_files=tuple(p.name for p in files),
        marks=frozenset({"safetensors", "dcp_sharding_info"} if sharded else {"safetensors"}),
        ranks=len(writers) if writers else 1,
    )


def _check_disjoint(path: Path, ranges: list[tuple[int, int, str]]) -> None:
    """Refuse two tensors of one file whose data ranges (``(begin, end, FQN)``, in bytes) overlap.

    Raises:
        CorruptChunkError: naming both FQNs and the file.
    """
    last: tuple[int, int, str] | None = None
    for begin, end, fqn in sorted(r for r in ranges if r[0] < r[1]):  # an empty tensor holds no bytes
        if last is not None and begin < last[1]:
            raise CorruptChunkError(f"{path}: the data of {last[2]} and {fqn} overlap; each tensor must have bytes of its own")
        last = (begin, end, fqn)


class HfStorageReader(ChunkedReader):
    """Reads chunks stored as their bare elements (a safetensors tensor's data), one pread each.

    Args:
        checkpoint_id: the folder of safetensors files.
        check_crc: unused (safetensors stores no checksums); kept for the shared signature.
    """

    def locate(self, entry: TensorEntry, chunk: ChunkEntry) -> StoredBytes | None:
        """A chunk's elements as the safetensors file stores them (bare, C order); None for a remote folder.

        Raises:
            MissingDataFileError, CorruptChunkError: the file is gone or too short.
            ShapeMismatchError: the byte range cannot hold the chunk.
        """
        if chunk.relative_path is None or not isinstance(self.root, Path):
            return None
        where = self._where(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, entry.fqn)
        if chunk.length_bytes != chunk.numel * entry.dtype.itemsize:
            raise ShapeMismatchError(f"{where}: {chunk.length_bytes} bytes cannot hold {entry.dtype} {list(chunk.sizes)}")
        fd, at = self._range(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, where)
        self._log_read(entry, chunk)
        return StoredBytes(fd=fd, offset=at, nbytes=chunk.length_bytes, crc32=None, where=where)

    def _load_chunk(self, entry: TensorEntry, chunk: ChunkEntry) -> Any:
        assert chunk.relative_path is not None
        where = self._where(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, entry.fqn)
        if chunk.length_bytes != chunk.numel * entry.dtype.itemsize:
            raise ShapeMismatchError(f"{where}: {chunk.length_bytes} bytes cannot hold {entry.dtype} {list(chunk.sizes)}")
        fd, at = self._range(chunk.relative_path, chunk.offset_bytes, chunk.length_bytes, where)
        buffer = bytearray(chunk.length_bytes)
        if chunk.length_bytes and os.preadv(fd, [buffer], at) != chunk.length_bytes:
            raise CorruptChunkError(f"{where}: short read; the file changed while it was read")
        return (
            torch.frombuffer(buffer, dtype=entry.dtype.torch).reshape(chunk.sizes)
            if chunk.length_bytes
            else torch.empty(chunk.sizes, dtype=entry.dtype.torch)
        )

    def read_value(self, entry: BytesEntry) -> Any:
        """Never called: safetensors files hold tensors only, so the index has no bytes entries.

        Raises:
            NotADcpCheckpointError: always.
        """
        raise NotADcpCheckpointError(f"{self.root}: {entry.fqn} is not a tensor; safetensors files hold tensors only")

    def read_raw(self, entry: BytesEntry) -> bytes:
        """Never called, as ``read_value``.

        Raises:
            NotADcpCheckpointError: always.
        """
        return self.read_value(entry)  # type: ignore[no-any-return]
