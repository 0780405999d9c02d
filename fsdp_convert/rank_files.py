"""Index stage for checkpoints that are not DCP: one torch.save file of a sharded state dict per rank.

verl saves ``model_world_size_{N}_rank_{r}.pt`` (and ``optim_...``, ``extra_state_...``) holding
FSDP2 DTensors; FSDP1 users save ``SHARDED_STATE_DICT`` rank by rank with ``torch.save``
(``ShardedTensor`` values). There is no ``.metadata``: the index is built from the files' own
shard offsets and placements.

Files are read as torch.save zips whose ``data.pkl`` goes through a restricted unpickler: tensor
storages are memory-mapped from the file (no data is read until a chunk is), and DTensor
(``torch/distributed/tensor``), DeviceMesh, ShardedTensor (``torch/distributed/_shard``) and
their placements and metadata become inert records of their pickled state. torch's own
``weights_only`` loader would call the real classes: ``DeviceMesh(...)`` can start a process
group, and ``ShardedTensor`` needs one. Nothing else resolves; no process group is needed.
"""

from __future__ import annotations

import collections
import io
import math
import mmap
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp_convert._signals import torch_call
from fsdp_convert._zip import ZipFormatError, read_records
from fsdp_convert.errors import CorruptChunkError, MissingDataFileError, NotADcpCheckpointError, UnsafeContentError
from fsdp_convert.layout import dcp_key
from fsdp_convert.metadata import BytesEntry, CheckpointIndex, ChunkEntry, Entry, ObjPath, TensorEntry

__all__ = ["RANK_FILE_RE", "find_rank_files", "load_rank_file", "rank_files_index", "local_value"]

# <prefix>[_world_size_<N>]_rank_<r>.pt, <prefix>_rank<r>.pt, <prefix>-rank-<r>.bin, ...
RANK_FILE_RE = re.compile(r"^(?P<prefix>.*?)(?:_world_size_(?P<ws>\d+))?[_-]?rank[_-]?(?P<rank>\d+)\.(?:pt|pth|bin)$")


class _Record:
    """What a pickled DTensor, DeviceMesh, ShardedTensor or placement becomes.

    It keeps the pickled arguments and state and never runs anything: no process group and no
    mesh is made, whatever the file says.
    """

    qualname = "?"
    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def fields(self) -> dict[str, Any]:
        """The BUILD state as one dict (a dict, or ``(dict | None, slots)``); another tuple as ``__tuple_state__``."""
        state = self.state
        if state is None:
            return {}
        if isinstance(state, dict):
            return state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) and state[0] in (None, {}):
            return {**(state[0] or {}), **state[1]}
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict) and state[1] is None:
            return state[0]
        return {"__tuple_state__": state}

    def __repr__(self) -> str:
        return f"<{self.qualname}>"


class _Wrapper(_Record):
    """``torch._utils._rebuild_wrapper_subclass``'s result: the subclass, its dtype and global shape."""

    qualname = "wrapper subclass"


# Classes a rank file of DTensors or ShardedTensors names, each read as a _Record of its own kind.
_RECORD_NAMES = (
    "torch.distributed.tensor._api.DTensor",
    "torch.distributed.tensor.DTensor",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch.distributed.tensor._dtensor_spec.TensorMeta",
    "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",
    "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed.device_mesh._DeviceMesh",
    "torch.distributed._mesh_layout._MeshLayout",
    "torch.distributed._mesh_layout._FlatLayout",
    "torch.distributed.tensor.placement_types.Shard",
    "torch.distributed.tensor.placement_types.Replicate",
    "torch.distributed.tensor.placement_types.Partial",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed._shard.sharded_tensor.api.ShardedTensor",
    "torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState",
    "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata",
    "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
    "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING",
    "torch.distributed._shard.sharded_tensor.shard.Shard",
    "torch.distributed._shard.metadata.ShardMetadata",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
    "torch.distributed._shard.sharding_spec.api.EnumerableShardingSpec",
    "torch.distributed.remote_device._remote_device",
)
_RECORDS: dict[str, type[_Record]] = {
    name: type(name.rsplit(".", 1)[-1], (_Record,), {"qualname": name}) for name in _RECORD_NAMES
}
_SHARDED_TENSOR = _RECORDS["torch.distributed._shard.sharded_tensor.api.ShardedTensor"]


def _kind(obj: Any) -> str:
    """The class name a _Record stands for (``DTensor``, ``Shard``...), or ``""``."""
    return obj.qualname.rsplit(".", 1)[-1] if isinstance(obj, _Record) else ""


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, *rest: Any) -> _Wrapper:
    if not (isinstance(cls, type) and issubclass(cls, _Record)) or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"wrapper subclass {cls!r} is not allowed")
    return _Wrapper(cls, dtype, tuple(size))


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if func is _rebuild_wrapper_subclass:
        wrapper = func(*args)
        if new_type is not wrapper.args[0]:
            raise pickle.UnpicklingError("wrapper subclass and type disagree")
        obj = new_type()
        obj.wrapper = wrapper
        obj.__setstate__(state)
        return obj
    if func is torch._utils._rebuild_tensor_v2 and new_type in (torch.Tensor, torch.nn.Parameter):
        if state not in (None, {}) and not (isinstance(state, tuple) and not any(state)):
            raise pickle.UnpicklingError("a tensor with Python attributes is not allowed")
        return func(*args)  # type: ignore[no-untyped-call]
    raise pickle.UnpicklingError(f"rebuilding {new_type!r} is not allowed")


def _restricted_getattr(obj: Any, name: str) -> Any:
    # ShardedTensor.__reduce_ex__ names its nested dataclass as getattr(ShardedTensor, "ProcessGroupState")
    if obj is _SHARDED_TENSOR and name == "ProcessGroupState":
        return _RECORDS["torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState"]
    raise pickle.UnpicklingError(f"getattr({obj!r}, {name!r}) is not allowed")


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise pickle.UnpicklingError("a parameter without tensor data is not allowed")
    return data


_FUNCTIONS: dict[str, Any] = {
    "torch._utils._rebuild_tensor_v2": torch._utils._rebuild_tensor_v2,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_wrapper_subclass": _rebuild_wrapper_subclass,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch.serialization._get_layout": torch.serialization._get_layout,
    "torch.Size": torch.Size,
    "torch.device": torch.device,
    "collections.OrderedDict": collections.OrderedDict,
    "builtins.getattr": _restricted_getattr,
    "__builtin__.getattr": _restricted_getattr,
}


class _RankFileUnpickler(pickle.Unpickler):
    """Reads a rank file's ``data.pkl`` with an allow-list.

    Plain tensors (storages memory-mapped from the file), dtypes, and ``_Record`` stand-ins for
    the distributed classes resolve; nothing else does, so nothing in the file runs.
    """

    def __init__(self, data: bytes, storages: dict[str, tuple[int, int]], buffer: mmap.mmap) -> None:
        super().__init__(io.BytesIO(data))
        self._storages = storages  # key -> (data offset, size) in the file, in bytes
        self._buffer = buffer

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in _FUNCTIONS:
            return _FUNCTIONS[full]
        if full in _RECORDS:
            return _RECORDS[full]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name.endswith("Storage"):
            return torch.serialization.StorageType(name)  # type: ignore[no-untyped-call]
        raise pickle.UnpicklingError(f"global {full} is not allowed")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        storage_type, key, _location, numel = pid[1:]
        dtype = storage_type.dtype if isinstance(storage_type, torch.serialization.StorageType) else torch.uint8
        if str(key) not in self._storages or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(f"storage {key!r} is not in the file")
        offset, size = self._storages[str(key)]
        nbytes = numel * dtype.itemsize
        if nbytes > size:
            raise pickle.UnpicklingError(f"storage {key!r} claims {nbytes} bytes; the file holds {size}")
        if nbytes:
            data = torch.frombuffer(self._buffer, dtype=torch.uint8, count=nbytes, offset=offset)
        else:
            data = torch.empty(0, dtype=torch.uint8)
        return torch.storage.TypedStorage(wrap_storage=data.untyped_storage(), dtype=dtype, _internal=True)  # type: ignore[no-untyped-call]


def load_rank_file(path: Path) -> Any:
    """Load a per-rank torch.save file (the zip format of ``torch/serialization.py``) without running it.

    ``data.pkl`` is read by ``_RankFileUnpickler``: tensors are memory-mapped from the file's
    storage records (nothing is read until used); DTensor, DeviceMesh, ShardedTensor and their
    placements and metadata become ``_Record`` stand-ins, so no process group or mesh is made.

    Raises:
        UnsafeContentError: the pickle names anything else (it could run code).
        CorruptChunkError: not a torch.save zip, or a storage it names is missing or short.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ZipFormatError("empty file")
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        records = read_records(lambda length, offset: buffer[offset : offset + length], size)
    except (OSError, ZipFormatError) as e:
        raise CorruptChunkError(f"{path}: not a torch.save file ({e})") from e
    pickles = [r for r in records if r.name.endswith("/data.pkl") and r.name.count("/") == 1]
    if len(pickles) != 1 or any(r.compression != 0 for r in records):
        raise CorruptChunkError(f"{path}: not a torch.save file (no single stored data.pkl)")
    prefix = pickles[0].name[: -len("data.pkl")] + "data/"
    storages = {r.name[len(prefix) :]: (r.data_offset, r.size) for r in records if r.name.startswith(prefix)}
    data = buffer[pickles[0].data_offset : pickles[0].data_offset + pickles[0].size]
    try:
        with torch_call():
            return _RankFileUnpickler(data, storages, buffer).load()
    except pickle.UnpicklingError as e:
        if "is not allowed" in str(e):
            raise UnsafeContentError(f"{path}: would run code when loaded, refused ({e})") from e
        raise CorruptChunkError(f"{path}: does not load ({e})") from e
    except (EOFError, ValueError, TypeError, RuntimeError, IndexError, AttributeError, KeyError) as e:
        raise CorruptChunkError(f"{path}: does not load ({type(e).__name__}: {e})") from e


def find_rank_files(root: Path) -> dict[str, dict[int, Path]]:
    """Per-rank torch.save files in ``root``, by prefix (``model``, ``optim``, ``extra_state``) and rank.

    Raises:
        NotADcpCheckpointError: files of two world sizes for one prefix (two saves in one folder),
            or a rank at or past the world size its name gives.
        MissingDataFileError: a prefix's ranks are not 0..N-1 (names the first missing file).
    """
    groups: dict[str, dict[int, Path]] = {}
    sizes: dict[str, set[int | None]] = {}
    for path in sorted(root.iterdir()):
        m = RANK_FILE_RE.match(path.name)
        if m is None or not path.is_file():
            continue
        prefix = m.group("prefix").rstrip("_-") or "state"
        groups.setdefault(prefix, {})[int(m.group("rank"))] = path
        sizes.setdefault(prefix, set()).add(int(m.group("ws")) if m.group("ws") else None)
    for prefix, files in groups.items():
        if len(sizes[prefix]) > 1:
            raise NotADcpCheckpointError(f"{root} holds {prefix} files of several world sizes; keep one save per folder")
        world_size = next(iter(sizes[prefix])) or max(files) + 1
        example = next(iter(files.values())).name
        if max(files) >= world_size:
            raise NotADcpCheckpointError(f"{files[max(files)]}: rank {max(files)} is past world size {world_size}")
        for rank in range(world_size):
            if rank not in files:
                missing = re.sub(r"rank([_-]?)\d+", rf"rank\g<1>{rank}", example)
                raise MissingDataFileError(f"{root / missing} is missing; {example} says there are {world_size} ranks")
    return groups


def _top_key(prefix: str) -> str:
    """``model`` and ``optim`` files go under those keys (``optimizer`` too); others under their prefix."""
    return {"model": "model", "optim": "optim", "optimizer": "optim"}.get(prefix, prefix)


def _walk(obj: Any, path: ObjPath, out: list[tuple[ObjPath, Any]]) -> None:
    """Leaves of a nested state dict, by DCP's rules: dicts always, lists when they hold tensors or containers."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            _walk(value, (*path, key), out)
    elif isinstance(obj, list) and any(isinstance(v, (dict, list, torch.Tensor, _Record)) for v in obj):
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


def _mesh_size(axis: Any) -> int:
    """Size of one mesh dim from its ``_FlatLayout`` record (its ``shape``: an int or nested ints)."""
    shape = axis.fields.get("shape") if isinstance(axis, _Record) else None
    flat = [shape] if type(shape) is int else list(_flatten_ints(shape))
    return math.prod(_naturals(flat))


def _flatten_ints(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _flatten_ints(v)
    else:
        yield value


def _dtensor_local(value: _Record, where: str) -> _Local:
    """A DTensor record's box: the global shape from its wrapper, the box from its placements."""
    try:
        fields = value.fields
        local, spec = fields["_local_tensor"], fields["_spec"].fields
        dtype, shape = value.wrapper.args[1], value.wrapper.args[2]  # type: ignore[attr-defined]
        mesh = spec["mesh"].fields
        mesh_shape = tuple(_mesh_size(axis) for axis in mesh["_layout"].fields["axes"])
        coordinate = mesh.get("_coordinate_on_dim")
        placements = tuple(spec["placements"])
    except (KeyError, AttributeError, TypeError, IndexError) as e:
        raise NotADcpCheckpointError(f"{where}: malformed DTensor ({type(e).__name__}: {e})") from e
    if coordinate is None:
        raise NotADcpCheckpointError(f"{where}: the DTensor does not record this rank's place in its mesh")
    coordinate = _naturals(coordinate)
    if len(coordinate) != len(mesh_shape) or not all(c < n for c, n in zip(coordinate, mesh_shape, strict=True)):
        raise NotADcpCheckpointError(f"{where}: mesh coordinate {list(coordinate)} lies outside mesh {list(mesh_shape)}")
    if len(placements) != len(mesh_shape):
        raise NotADcpCheckpointError(f"{where}: {len(placements)} placements for a {len(mesh_shape)}-dim mesh")
    dims: list[int | None] = []
    for p in placements:
        if _kind(p) == "Shard":
            dims.append(_naturals([p.fields.get("dim")])[0])
        elif _kind(p) == "Replicate":
            dims.append(None)
        else:  # _StridedShard (FSDP + TP) interleaves; Partial is never saved in a state dict
            raise NotADcpCheckpointError(f"{where}: placement {p!r} is not supported (Shard and Replicate are)")
    if not isinstance(local, torch.Tensor) or not isinstance(dtype, torch.dtype) or local.dtype != dtype:
        raise NotADcpCheckpointError(f"{where}: malformed DTensor (its local tensor and dtype disagree)")
    shape = _naturals(shape)
    if any(d is not None and d >= len(shape) for d in dims):
        raise NotADcpCheckpointError(f"{where}: a placement shards a dim the tensor does not have")
    sizes, offsets = _local_box(shape, mesh_shape, coordinate, dims)
    if tuple(local.shape) != sizes:
        raise CorruptChunkError(f"{where}: local tensor {list(local.shape)} does not match its placement's {list(sizes)}")
    return _Local(shape, local.dtype, [(offsets, sizes, ("_local_tensor",))])


def _local_box(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], dims: list[int | None]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's (sizes, offsets), in elements, by ``torch.chunk`` on each sharded dim.

    Mesh dims apply in order, as DTensor's ``compute_local_shape_and_global_offset`` does for
    ``Shard`` and ``Replicate`` placements.
    """
    sizes, offsets = list(shape), [0] * len(shape)
    for mesh_dim, d in enumerate(dims):
        if d is None:  # Replicate
            continue
        n, c = mesh_shape[mesh_dim], coordinate[mesh_dim]
        step = -(-sizes[d] // n)
        start = min(step * c, sizes[d])
        size = max(0, min(sizes[d], step * (c + 1)) - start)
        offsets[d] += start
        sizes[d] = size
    return tuple(sizes), tuple(offsets)


def _sharded_tensor_local(value: _Record, where: str) -> _Local:
    """A ShardedTensor record's local shards and their boxes, from its ``ShardMetadata``."""
    try:
        local_shards, meta, *_ = value.fields["__tuple_state__"]
        meta_fields = meta.fields
        shape = _naturals(meta_fields["size"])
        properties = meta_fields["tensor_properties"].fields
        dtype = properties["dtype"] if "dtype" in properties else properties["__tuple_state__"][0]
        boxes: list[tuple[tuple[int, ...], tuple[int, ...], ObjPath]] = []
        for i, shard in enumerate(local_shards):
            tensor, shard_meta = shard.fields["tensor"], shard.fields["metadata"].fields
            offsets, sizes = _naturals(shard_meta["shard_offsets"]), _naturals(shard_meta["shard_sizes"])
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != sizes or tensor.dtype != dtype:
                raise CorruptChunkError(f"{where}: local shard {i} does not match its metadata ({list(sizes)}, {dtype})")
            boxes.append((offsets, sizes, ("local_shards", i)))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise NotADcpCheckpointError(f"{where}: malformed ShardedTensor ({type(e).__name__}: {e})") from e
    if not isinstance(dtype, torch.dtype):
        raise NotADcpCheckpointError(f"{where}: malformed ShardedTensor (no dtype)")
    return _Local(shape, dtype, boxes)


def local_value(obj: Any, record: ObjPath) -> Any:
    """The value a chunk's or value's ``record`` names in a loaded rank file.

    ``record`` is the path in the nested dict, then ``_local_tensor`` for a DTensor or
    ``("local_shards", i)`` for a ShardedTensor.

    Raises:
        KeyError, IndexError: the record is not in the file (it changed since it was indexed).
    """
    for i, key in enumerate(record):
        if key == "_local_tensor" and i == len(record) - 1 and _kind(obj) == "DTensor":
            return obj.fields["_local_tensor"]
        if key == "local_shards" and i == len(record) - 2 and obj.__class__ is _SHARDED_TENSOR:
            return obj.fields["__tuple_state__"][0][record[i + 1]].fields["tensor"]
        obj = obj[key]
    return obj


def _local_of(value: Any, where: str, first_rank: bool) -> _Local | None:
    """The tensor piece a leaf holds, or None for a plain value."""
    if value.__class__ is _SHARDED_TENSOR:
        return _sharded_tensor_local(value, where)
    if _kind(value) == "DTensor":
        return _dtensor_local(value, where)
    if isinstance(value, _Record):  # a mesh, a placement... where a value should be
        raise NotADcpCheckpointError(f"{where}: a {value.qualname} is not a state dict value")
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
                saw_sharded_tensor |= value.__class__ is _SHARDED_TENSOR
                if obj_path not in tensors and obj_path not in values:
                    order.append(obj_path)
                    if local is None:
                        values[obj_path] = BytesEntry(
                            fqn=dcp_key((top, *obj_path)), path=(top, *obj_path), relative_path=path.name,
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
            fqn = dcp_key((top, *obj_path))
            stored = tuple(c for c in chunks if c.numel > 0) or tuple(chunks[:1])  # empty shards of small tensors
            entries.append(TensorEntry(fqn=fqn, path=(top, *obj_path), shape=shape, dtype=dtype, chunks=stored))
    producer = "fsdp1" if saw_sharded_tensor else "verl" if any("_world_size_" in f for f in files) else "torch_save"
    ranks = max(len(by_rank) for by_rank in groups.values())
    return CheckpointIndex(
        checkpoint_id=root, entries=tuple(entries), data_files=tuple(sorted(files)), producer=producer, ranks=ranks
    )
