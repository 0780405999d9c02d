"""Index stage's data model: what a checkpoint holds and where its bytes lie, as frozen dataclasses.

A leaf with no I/O: every source format (``formats/dcp.py``, ``rank_files.py``, ``hf_storage.py``,
``full_file.py``) builds a ``CheckpointIndex`` of these records, and every later stage (layout,
transform, plan, the readers) consumes it. It follows DCP's data model
(``torch/distributed/checkpoint/metadata.py``): a tensor's global shape and dtype with its stored
chunks (N-d boxes, in elements), and non-tensor values stored as torch.save payloads. Entries
are addressed by ``ObjPath``; ``unflatten`` nests (path, value) pairs back into a state dict, for
the planner and the writers alike.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

from fsdp_convert.dtypes import ITEMSIZES, DType
from fsdp_convert.formats._coverage import MAX_CHUNKS_PER_TENSOR, check_coverage
from fsdp_convert.formats._paths import (
    DictKey,
    ObjPath,
    dcp_key,
    flatten_with_paths,
    plain_path,
    readable_name,
    readable_path,
    unflatten,
)
from fsdp_convert.formats._plain import MAX_VALUE_DEPTH, ValueShapeError, check_value, holds, values_equal
from fsdp_convert.location import Location, Url

__all__ = [
    "ObjPath",
    "Url",  # from location, as every format and operation names them
    "Location",
    "ChunkEntry",
    "chunk_entry",
    "TensorEntry",
    "BytesEntry",
    "Entry",
    "CheckpointIndex",
    "Mark",
    "dtype_name",
    "DTYPE_ITEMSIZES",
    "dcp_key",
    "DictKey",
    "plain_path",
    "flatten_with_paths",
    "unflatten",
    "readable_name",
    "readable_path",
    "MAX_VALUE_DEPTH",  # from _plain, as the readers and verify walk plain values
    "ValueShapeError",
    "check_value",
    "holds",
    "values_equal",
    "check_coverage",
    "MAX_ENTRIES",
    "MAX_CHUNKS_PER_TENSOR",
]

_DATA_FILE_RE = re.compile(r"^__(\d{1,9})_(\d+)\.distcp$")  # a rank past 10^9 is not one

# What a source format saw in the files that tells their writers apart (``CheckpointIndex.marks``):
# ``rank_files``: per-rank torch.save files, not DCP (``formats/rank_files.py``); ``sharded_tensor``:
# one of them holds torch's ``ShardedTensor`` values; ``safetensors``: safetensors files read as DCP
# chunks (``formats/hf_storage.py``); ``dcp_sharding_info``: a header of theirs carries
# ``DCP_SHARDING_INFO`` (torch's ``HuggingFaceStorageWriter``); ``deepspeed``: a DeepSpeed ZeRO save
# (``formats/deepspeed.py``).
Mark = Literal["rank_files", "sharded_tensor", "safetensors", "dcp_sharding_info", "weights_alone", "deepspeed"]

# Caps far above real checkpoints. A 1T-parameter MoE with its experts unstacked and Adam holds
# about 200k entries; on 2048 ranks FSDP stores 2048 chunks of each tensor, split on dim 0 (tensor
# parallelism splits one more dim: 4 corners each in check_coverage).
MAX_ENTRIES = 1 << 22


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkEntry:
    """One stored box of a tensor and where its bytes lie.

    Attributes:
        offsets: per-dimension start of the box in the global tensor, in elements.
        sizes: per-dimension extent of the box, in elements.
        relative_path: data file holding the payload, relative to the checkpoint folder; ``None``
            for an empty box (some size 0) that DCP recorded without a payload.
        offset_bytes: start of the payload in the data file, in bytes.
        length_bytes: length of the payload, in bytes (a torch.save zip of the box).
        transform_descriptors: stream transforms applied on write (e.g. compression), in order.
        record: where the box lies inside a data file that holds many values (a per-rank
            torch.save file: the tensor's path in the loaded file; see ``formats/rank_files.py``);
            ``()`` where the byte range alone says it. How the bytes hold the box is the source
            format's to know: its reader reads its own chunks.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    relative_path: str | None
    offset_bytes: int
    length_bytes: int
    transform_descriptors: tuple[str, ...] = ()
    record: ObjPath = ()

    @property
    def numel(self) -> int:
        """Number of elements in the box."""
        return math.prod(self.sizes)

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        """Pickled as ``chunk_entry``'s call (a worker's job holds millions): not dataclasses' setstate, field by field."""
        return chunk_entry, _CHUNK_FIELDS(self)


_SETTERS = tuple(getattr(ChunkEntry, name).__set__ for name in ChunkEntry.__slots__)  # the fields' slots, in order
_CHUNK_FIELDS = operator.attrgetter(*ChunkEntry.__slots__)  # the fields, in that order: chunk_entry's arguments
_NEW = object.__new__


def chunk_entry(
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    relative_path: str | None,
    offset_bytes: int,
    length_bytes: int,
    transform_descriptors: tuple[str, ...] = (),
    record: ObjPath = (),
) -> ChunkEntry:
    """``ChunkEntry(...)`` of these fields, in order, made in a third of the time (millions per index).

    The fields' types are the caller's to have checked, as for ``ChunkEntry`` itself.
    """
    chunk = _NEW(ChunkEntry)
    a, b, c, d, e, f, g = _SETTERS
    a(chunk, offsets), b(chunk, sizes), c(chunk, relative_path), d(chunk, offset_bytes), e(chunk, length_bytes)
    f(chunk, transform_descriptors), g(chunk, record)
    return chunk


@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class TensorEntry:
    """A tensor of the checkpoint: global shape and dtype, and its chunks.

    The dtype is kept by name, so an index (``inspect``) needs no torch; ``dtype`` is the torch
    dtype, resolved (and torch imported) at first use.

    Attributes:
        fqn: the flattened key as DCP stores it (e.g. ``model.layers.0.attn.wq.weight``).
        path: the key's path in the nested state dict the producer saved (from ``planner_data``).
        shape: global shape, in elements.
        dtype_name: element type, as torch names it without ``torch.`` (``"bfloat16"``).
        chunks: the stored boxes, in ``.metadata`` order.
    """

    fqn: str
    path: ObjPath
    shape: tuple[int, ...]
    dtype_name: str
    chunks: tuple[ChunkEntry, ...]

    def __init__(
        self,
        *,
        fqn: str,
        path: ObjPath,
        shape: tuple[int, ...],
        chunks: tuple[ChunkEntry, ...],
        dtype: torch.dtype | DType | None = None,
        dtype_name: str | None = None,
    ) -> None:
        """Give ``dtype`` (a torch dtype) or ``dtype_name``; ``dtype`` wins (``dataclasses.replace(e, dtype=...)``)."""
        if dtype is not None:
            dtype_name = str(dtype).removeprefix("torch.")
        if dtype_name is None:
            raise TypeError("TensorEntry needs a dtype or a dtype_name")
        for name, value in (("fqn", fqn), ("path", path), ("shape", shape), ("dtype_name", dtype_name), ("chunks", chunks)):
            object.__setattr__(self, name, value)

    @property
    def dtype(self) -> DType:
        """Element type (``dtypes.DType``: no torch; ``.torch`` is the torch dtype)."""
        return DType(self.dtype_name)

    @property
    def itemsize(self) -> int:
        """Bytes per element, without torch for the dtypes this tool handles."""
        size = DTYPE_ITEMSIZES.get(self.dtype_name)
        return size if size is not None else self.dtype.itemsize

    @property
    def numel(self) -> int:
        """Number of elements of the global tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the full tensor in memory, in bytes."""
        return self.numel * self.itemsize

    @property
    def stored_bytes(self) -> int:
        """Sum of the chunk payload lengths in the data files, in bytes."""
        return sum(c.length_bytes for c in self.chunks)

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        """Pickled with its chunks as tuples of their fields, taken at C speed (a worker's job holds millions)."""
        return _tensor_entry, (self.fqn, self.path, self.shape, self.dtype_name, tuple(map(_CHUNK_FIELDS, self.chunks)))


def _tensor_entry(
    fqn: str, path: ObjPath, shape: tuple[int, ...], dtype_name: str, rows: tuple[tuple[object, ...], ...]
) -> TensorEntry:
    """``TensorEntry.__reduce__`` read back: its chunks made by ``chunk_entry`` from their fields."""
    chunks = tuple(itertools.starmap(chunk_entry, rows))
    return TensorEntry(fqn=fqn, path=path, shape=shape, dtype_name=dtype_name, chunks=chunks)


@dataclass(frozen=True, slots=True, kw_only=True)
class BytesEntry:
    """A non-tensor value (param group field, train state), stored as a torch.save payload.

    Attributes:
        fqn: the flattened key as DCP stores it.
        path: the key's path in the nested state dict.
        relative_path: data file holding the payload.
        offset_bytes: start of the payload in the data file, in bytes.
        length_bytes: length of the payload, in bytes.
        transform_descriptors: stream transforms applied on write, in order.
        record: the value's path inside a per-rank torch.save file; ``()`` for a DCP payload.
    """

    fqn: str
    path: ObjPath
    relative_path: str
    offset_bytes: int
    length_bytes: int
    transform_descriptors: tuple[str, ...] = ()
    record: ObjPath = ()

    @property
    def nbytes(self) -> int:
        """Payload size, in bytes."""
        return self.length_bytes

    @property
    def stored_bytes(self) -> int:
        """Payload size, in bytes."""
        return self.length_bytes


Entry = TensorEntry | BytesEntry


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointIndex:
    """Everything ``.metadata`` says about a DCP checkpoint.

    Attributes:
        checkpoint_id: the checkpoint folder.
        entries: tensors and bytes values in the order the producer flattened them.
        data_files: the data files that hold at least one payload, sorted.
        version: DCP's metadata version string, if recorded.
        save_id: DCP's save id, if recorded.
        ranks: the producer's world size when the data file names do not follow DCP's
            ``__<rank>_<n>.distcp`` (per-rank torch.save files, safetensors shards).
        folders: the DCP folders inside ``checkpoint_id`` that this one index joins, by name,
            sorted (a folder holding no ``.metadata`` of its own); data file paths start with
            their folder. Empty when ``checkpoint_id`` holds the data itself.
        beside: the names of the other entries of a local DCP checkpoint's folder, as listed when
            it was indexed: neither ``.metadata``, a data file nor one of ``folders``. Empty for
            the other formats, a remote folder (not listed) and one that cannot be listed.
        links_out: those of ``beside`` that are symbolic links leading out of the folder, where
            the process's setting (``location.following_symlinks``) refused such links when it was
            indexed; a later stage that reads one of them refuses it (``location.inside``).
        marks: what the format saw in the files that tells their writers apart (``Mark``).
        details: what the format read about how the checkpoint was written, as ``inspect`` shows
            it: (label, value) pairs (a DeepSpeed save's ZeRO stage and dtypes).

    The format reports these facts and nothing more: which producer wrote the checkpoint is
    decided from them, and from the keys, by ``producers.detect_producer``.
    """

    checkpoint_id: Location
    entries: tuple[Entry, ...]
    data_files: tuple[str, ...]
    version: str | None = None
    save_id: str | None = None
    ranks: int | None = None
    folders: tuple[str, ...] = ()
    beside: frozenset[str] = frozenset()
    links_out: frozenset[str] = frozenset()
    marks: frozenset[Mark] = frozenset()
    details: tuple[tuple[str, str], ...] = ()
    _writer_ranks: tuple[int, ...] = field(init=False, repr=False, compare=False)  # parsed once: asked per entry

    def __post_init__(self) -> None:
        ranks = {int(m.group(1)) for f in self.data_files if (m := _DATA_FILE_RE.match(Path(f).name))}
        object.__setattr__(self, "_writer_ranks", tuple(sorted(ranks)))

    @property
    def writer_ranks(self) -> tuple[int, ...]:
        """Ranks that wrote data files, parsed from ``__<rank>_<n>.distcp`` names."""
        return self._writer_ranks

    @property
    def world_size(self) -> int:
        """The producer's world size, inferred as the number of distinct writer ranks.

        A rank that wrote nothing (possible only in tiny checkpoints) is not counted.
        """
        return self.ranks if self.ranks is not None else len(self.writer_ranks)

    @property
    def total_bytes(self) -> int:
        """Tensor data (elements x item size) plus bytes payloads, in bytes."""
        return sum(e.nbytes for e in self.entries)

    def tensors(self) -> Iterator[TensorEntry]:
        """The tensor entries, in order."""
        return (e for e in self.entries if isinstance(e, TensorEntry))


DTYPE_ITEMSIZES = ITEMSIZES  # dtypes.ITEMSIZES: element sizes by dtype name, so an index is sized without torch


def dtype_name(dtype: torch.dtype | DType) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as JSON output and tables write dtypes (``TensorEntry.dtype_name``)."""
    return str(dtype).removeprefix("torch.")
