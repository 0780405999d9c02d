"""Index stage for checkpoints that are not DCP: one torch.save file of a sharded state dict per rank.

verl saves ``model_world_size_{N}_rank_{r}.pt`` (and ``optim_...``, ``extra_state_...``) holding
FSDP2 DTensors; FSDP1 users save ``SHARDED_STATE_DICT`` rank by rank with ``torch.save``
(``ShardedTensor`` values). There is no ``.metadata``: the index is built from the files' own
shard offsets and placements.

Files are loaded with ``torch.load(weights_only=True, mmap=True)`` (no tensor data is read until a
chunk is), with an allow-list that admits DTensor's pure-data classes (``DTensorSpec``,
``DeviceMesh``, placements; ``torch/distributed/tensor``) and maps ``ShardedTensor``
(``torch/distributed/_shard/sharded_tensor/api.py``), whose ``__setstate__`` needs a process
group, to an inert stand-in that only keeps its pickled state. No process group is needed.
"""

from __future__ import annotations

import functools
import logging
import math
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp_convert._signals import torch_call
from fsdp_convert.errors import CorruptChunkError, MissingDataFileError, NotADcpCheckpointError, UnsafeContentError
from fsdp_convert.metadata import BytesEntry, CheckpointIndex, ChunkEntry, Entry, ObjPath, TensorEntry

__all__ = ["RANK_FILE_RE", "find_rank_files", "load_rank_file", "rank_files_index", "local_value"]

# <prefix>[_world_size_<N>]_rank_<r>.pt, <prefix>_rank<r>.pt, <prefix>-rank-<r>.bin, ...
RANK_FILE_RE = re.compile(r"^(?P<prefix>.*?)(?:_world_size_(?P<ws>\d+))?[_-]?rank[_-]?(?P<rank>\d+)\.(?:pt|pth|bin)$")
_GROUP_TOPS = (("model", "model"), ("optim", "optim"))  # file prefix -> top-level key
logger = logging.getLogger(__name__)


class _ShardedTensorStandIn(torch.Tensor):
    """What a pickled ``ShardedTensor`` becomes: its state tuple, kept, never run.

    ``(local_shards, ShardedTensorMetadata, ProcessGroupState, sharding_spec, init_rrefs)``.
    """

    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise TypeError("a ShardedTensor read from a rank file is a placeholder; use its local shards")


class _ProcessGroupStateStandIn:
    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state)


def _sharded_tensor_getattr(obj: Any, name: str) -> Any:
    # ShardedTensor.__reduce_ex__ names its nested dataclass as getattr(ShardedTensor, "ProcessGroupState")
    if obj is _ShardedTensorStandIn and name == "ProcessGroupState":
        return _ProcessGroupStateStandIn
    raise pickle.UnpicklingError(f"getattr({obj!r}, {name!r}) is not allowed")


@functools.cache
def _safe_globals() -> list[Any]:
    from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import MEM_FORMAT_ENCODING, ShardedTensorMetadata, TensorProperties
    from torch.distributed._shard.sharded_tensor.shard import Shard as ShardedTensorShard
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed._shard.sharding_spec.api import EnumerableShardingSpec
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.remote_device import _remote_device
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
    from torch.distributed.tensor.placement_types import _StridedShard

    return [
        DTensor, DTensorSpec, TensorMeta, ShardOrderEntry, DeviceMesh, _MeshLayout, _FlatLayout,
        Shard, Replicate, _StridedShard,
        (_ShardedTensorStandIn, "torch.distributed._shard.sharded_tensor.api.ShardedTensor"),
        (_sharded_tensor_getattr, "builtins.getattr"),
        _ProcessGroupStateStandIn,
        ShardedTensorMetadata, ShardMetadata, TensorProperties, MEM_FORMAT_ENCODING, ShardedTensorShard,
        _remote_device, ChunkShardingSpec, EnumerableShardingSpec,
    ]  # fmt: skip


def load_rank_file(path: Path) -> Any:
    """``torch.load(path, weights_only=True, mmap=True)`` with DTensor and ShardedTensor admitted.

    Raises:
        UnsafeContentError: the file would run code.
        CorruptChunkError: it does not load.
    """
    import torch.distributed.tensor  # noqa: F401  (registers DTensor's rebuild functions)

    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)  # "unpickling of the DeviceMesh occurred before the PGs were created"
    try:
        with torch_call(), torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        detail = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "global" in ln), None)
        if detail is not None:
            raise UnsafeContentError(f"{path}: would run code when loaded, refused ({detail})") from e
        raise CorruptChunkError(f"{path}: not a readable torch.save file ({type(e).__name__})") from e
    except Exception as e:
        raise CorruptChunkError(f"{path}: not a readable torch.save file ({type(e).__name__}: {e})") from e
    finally:
        mesh_log.setLevel(level)


def find_rank_files(root: Path) -> dict[str, dict[int, Path]]:
    """Per-rank torch.save files in ``root``, by prefix (``model``, ``optim``, ``extra_state``) and rank.

    Raises:
        MissingDataFileError: a prefix's ranks are not 0..N-1 (names the first missing file).
    """
    groups: dict[str, dict[int, Path]] = {}
    sizes: dict[str, int | None] = {}
    for path in sorted(root.iterdir()):
        m = RANK_FILE_RE.match(path.name)
        if m is None or not path.is_file():
            continue
        prefix = m.group("prefix").rstrip("_-") or "state"
        groups.setdefault(prefix, {})[int(m.group("rank"))] = path
        sizes[prefix] = int(m.group("ws")) if m.group("ws") else None
    for prefix, files in groups.items():
        world_size = sizes[prefix] or max(files) + 1
        for rank in range(world_size):
            if rank not in files:
                example = next(iter(files.values())).name
                missing = re.sub(r"rank([_-]?)\d+", rf"rank\g<1>{rank}", example)
                raise MissingDataFileError(f"{root / missing} is missing; {example} says there are {world_size} ranks")
    return groups


def _top_key(prefix: str) -> str:
    for marker, top in _GROUP_TOPS:
        if prefix.startswith(marker):
            return top
    return prefix


def _walk(obj: Any, path: ObjPath, out: list[tuple[ObjPath, Any]]) -> None:
    """Leaves of a nested state dict, by DCP's rules: dicts always, lists when they hold containers."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            _walk(value, (*path, key), out)
    elif isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        for i, value in enumerate(obj):
            _walk(value, (*path, i), out)
    else:
        out.append((path, obj))


@dataclass(frozen=True, slots=True)
class _Local:
    """One rank's piece of a tensor: global shape and dtype, and its box(es)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], ObjPath]]  # offsets, sizes, record inside the file


def _naturals(values: Any) -> tuple[int, ...]:
    """A sequence of non-negative ints from a file, or NotADcpCheckpointError."""
    try:
        out = tuple(values)
    except TypeError:
        out = (None,)
    if not all(type(v) is int and v >= 0 for v in out):
        raise NotADcpCheckpointError(f"{values!r} is not a sequence of non-negative integers")
    return out


def _dtensor_local(value: Any, where: str) -> _Local:
    from torch.distributed.tensor import Replicate, Shard

    spec = value._spec
    mesh = spec.mesh
    # not mesh.mesh or mesh.get_rank(): for a sub-mesh they ask the (absent) process group
    mesh_shape = _naturals(mesh._layout.top_level_sizes)
    coordinate = mesh._coordinate_on_dim
    if coordinate is None:
        raise NotADcpCheckpointError(f"{where}: the DTensor does not record this rank's place in its mesh")
    coordinate = _naturals(coordinate)
    if len(coordinate) != len(mesh_shape) or not all(c < n for c, n in zip(coordinate, mesh_shape, strict=True)):
        raise NotADcpCheckpointError(f"{where}: mesh coordinate {list(coordinate)} lies outside mesh {list(mesh_shape)}")
    for p in spec.placements:
        if type(p) not in (Shard, Replicate):  # _StridedShard (FSDP + TP) is a Shard subclass on some torch
            raise NotADcpCheckpointError(f"{where}: placement {p} is not supported (Shard and Replicate are)")
    shape = tuple(value.shape)
    sizes, offsets = _local_box(shape, mesh_shape, tuple(coordinate), spec.placements)
    local = value._local_tensor
    if tuple(local.shape) != sizes:
        raise CorruptChunkError(f"{where}: local tensor {list(local.shape)} does not match its placement's {list(sizes)}")
    return _Local(shape, local.dtype, [(offsets, sizes, ("_local_tensor",))])


def _local_box(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's (sizes, offsets), in elements, by ``torch.chunk`` on each sharded dim.

    Mesh dims apply in order, as DTensor's ``compute_local_shape_and_global_offset`` does for
    ``Shard`` and ``Replicate`` placements.
    """
    sizes, offsets = list(shape), [0] * len(shape)
    for mesh_dim, p in enumerate(placements):
        if not hasattr(p, "dim"):
            continue
        d, n, c = p.dim, mesh_shape[mesh_dim], coordinate[mesh_dim]
        step = -(-sizes[d] // n)
        start = min(step * c, sizes[d])
        size = max(0, min(sizes[d], step * (c + 1)) - start)
        offsets[d] += start
        sizes[d] = size
    return tuple(sizes), tuple(offsets)


def _sharded_tensor_local(value: _ShardedTensorStandIn, where: str) -> _Local:
    try:
        local_shards, meta, *_ = value.state
        shape = tuple(meta.size)
        dtype = meta.tensor_properties.dtype
        boxes: list[tuple[tuple[int, ...], tuple[int, ...], ObjPath]] = []
        for i, shard in enumerate(local_shards):
            offsets, sizes = _naturals(shard.metadata.shard_offsets), _naturals(shard.metadata.shard_sizes)
            if tuple(shard.tensor.shape) != sizes:
                raise CorruptChunkError(
                    f"{where}: local shard {i} is {list(shard.tensor.shape)}, its metadata says {list(sizes)}"
                )
            boxes.append((offsets, sizes, ("local_shards", i)))
    except (TypeError, ValueError, AttributeError) as e:
        raise NotADcpCheckpointError(f"{where}: malformed ShardedTensor ({e})") from e
    return _Local(shape, dtype, boxes)


def local_value(obj: Any, record: ObjPath) -> Any:
    """The value a chunk's or value's ``record`` names in a loaded rank file.

    ``record`` is the path in the nested dict, then ``_local_tensor`` for a DTensor or
    ``("local_shards", i)`` for a ShardedTensor.
    """
    for i, key in enumerate(record):
        if key == "_local_tensor" and i == len(record) - 1:
            return obj._local_tensor
        if key == "local_shards" and i == len(record) - 2 and isinstance(obj, _ShardedTensorStandIn):
            return obj.state[0][record[i + 1]].tensor
        obj = obj[key]
    return obj


def _local_of(value: Any, where: str, first_rank: bool) -> _Local | None:
    """The tensor piece a leaf holds, or None for a plain value."""
    if isinstance(value, _ShardedTensorStandIn):
        return _sharded_tensor_local(value, where)
    if type(value).__name__ == "DTensor":
        return _dtensor_local(value, where)
    if isinstance(value, torch.Tensor):  # replicated: every rank saved it whole; rank 0's copy is read
        shape = tuple(value.shape)
        return _Local(shape, value.dtype, [((0,) * len(shape), shape, ())] if first_rank else [])
    return None


def rank_files_index(root: Path) -> CheckpointIndex:
    """Index a folder of per-rank torch.save files (see the module docstring).

    Every file is loaded (memory-mapped, no tensor data read). A DTensor's box comes from its
    placements and mesh coordinate, a ShardedTensor's from its ``ShardMetadata``; a plain tensor
    (present on every rank, as replicated state is) is read from the first rank's file, as are
    plain values. Entries go under ``model``/``optim`` by file prefix, others under their prefix.

    Raises:
        NotADcpCheckpointError: no rank files, or files that disagree on a value's kind, shape or dtype.
        MissingDataFileError: a rank's file is missing.
        UnsafeContentError, CorruptChunkError: a file would run code, or does not load.
    """
    groups = find_rank_files(root)
    if not groups:
        raise NotADcpCheckpointError(f"{root} has no .metadata; not a DCP checkpoint")
    entries: list[Entry] = []
    files: list[str] = []
    saw_sharded_tensor = False
    for prefix, by_rank in groups.items():
        top = _top_key(prefix)
        first = min(by_rank)
        tensors: dict[ObjPath, tuple[tuple[int, ...], torch.dtype, list[ChunkEntry]]] = {}
        values: dict[ObjPath, BytesEntry] = {}
        order: list[ObjPath] = []
        for rank in sorted(by_rank):
            path = by_rank[rank]
            files.append(path.name)
            leaves: list[tuple[ObjPath, Any]] = []
            _walk(load_rank_file(path), (), leaves)
            for obj_path, value in leaves:
                where = f"{path} {'.'.join(map(str, obj_path))}"
                local = _local_of(value, where, rank == first)
                saw_sharded_tensor |= isinstance(value, _ShardedTensorStandIn)
                if obj_path not in tensors and obj_path not in values:
                    order.append(obj_path)
                    if local is None:
                        values[obj_path] = BytesEntry(
                            fqn=".".join(map(str, (top, *obj_path))), path=(top, *obj_path), relative_path=path.name,
                            offset_bytes=0, length_bytes=0, encoding="rank_file", record=obj_path,
                        )  # fmt: skip
                    else:
                        tensors[obj_path] = (local.shape, local.dtype, [])
                elif (obj_path in values) != (local is None) or (local and tensors[obj_path][:2] != (local.shape, local.dtype)):
                    raise NotADcpCheckpointError(f"{where}: rank files disagree on this value's kind, shape or dtype")
                if local is None:
                    continue
                chunks = tensors[obj_path][2]
                for offsets, sizes, record in local.boxes:
                    if any(c.offsets == offsets and c.sizes == sizes for c in chunks):
                        continue  # a replica (Replicate placement, or a sub-mesh of size 1)
                    chunks.append(
                        ChunkEntry(
                            offsets=offsets, sizes=sizes, relative_path=path.name, offset_bytes=0,
                            length_bytes=math.prod(sizes) * local.dtype.itemsize, encoding="rank_file",
                            record=(*obj_path, *record),
                        )
                    )  # fmt: skip
        for obj_path in order:
            if obj_path in values:
                entries.append(values[obj_path])
                continue
            shape, dtype, chunks = tensors[obj_path]
            fqn = ".".join(map(str, (top, *obj_path)))
            stored = tuple(c for c in chunks if c.numel > 0) or tuple(chunks[:1])  # empty shards of small tensors
            entries.append(TensorEntry(fqn=fqn, path=(top, *obj_path), shape=shape, dtype=dtype, chunks=stored))
    producer = "fsdp1" if saw_sharded_tensor else "verl" if any("_world_size_" in f for f in files) else "torch_save"
    ranks = max(len(by_rank) for by_rank in groups.values())
    return CheckpointIndex(
        checkpoint_id=root, entries=tuple(entries), data_files=tuple(sorted(files)), producer=producer, ranks=ranks
    )
