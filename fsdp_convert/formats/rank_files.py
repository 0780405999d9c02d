"""Per-rank torch.save files (verl, FSDP1 ``SHARDED_STATE_DICT``): index from placements, reads of their tensors.

verl saves ``model_world_size_{N}_rank_{r}.pt`` (and ``optim_...``, ``extra_state_...``) holding
FSDP2 DTensors; FSDP1 users save ``SHARDED_STATE_DICT`` rank by rank with ``torch.save``
(``ShardedTensor`` values). There is no ``.metadata``: the index is built from the files' own
shard offsets and placements. Files are loaded by ``_rank_unpickler.load_rank_file`` (memory-mapped,
nothing runs, no process group needed); a chunk is the local tensor its ``record`` names.
"""

from __future__ import annotations

import functools
import io
import itertools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from fsdp_convert.errors import (
    CorruptChunkError,
    InvalidOptionError,
    MissingDataFileError,
    NotADcpCheckpointError,
    TorchFeatureError,
)
from fsdp_convert.formats._rank_pieces import Placement, check_elements, drop_replicas, mesh_sizes, strided_box
from fsdp_convert.formats._rank_unpickler import SHARDED_TENSOR, Record, kind, load_rank_file, local_value
from fsdp_convert.formats.index import (
    MAX_ENTRIES,
    BytesEntry,
    CheckpointIndex,
    ChunkEntry,
    Entry,
    ObjPath,
    TensorEntry,
    Url,
    ValueShapeError,
    check_value,
    dcp_key,
)
from fsdp_convert.formats.reader import ChunkedReader
from fsdp_convert.location import FdPath, open_inside

__all__ = ["RANK_FILE_RE", "find_rank_files", "rank_files_index", "RankFilesReader"]

_MAX_DEPTH = 64  # levels of a state dict's nesting (a torchtitan optimizer state: 6)
# <prefix>[_world_size_<N>]_rank_<r>.pt, <prefix>_rank<r>.pt, <prefix>-rank-<r>.bin, ...
RANK_FILE_RE = re.compile(r"^(?P<prefix>.*?)(?:_world_size_(?P<ws>\d+))?[_-]?rank[_-]?(?P<rank>\d+)\.(?:pt|pth|bin)$")


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


_ENTRY = (dict, list, torch.Tensor, Record)  # a list holding one of these is a container of entries (DCP's rule)


def _walk(obj: Any, path: ObjPath, out: list[tuple[ObjPath, Any]], where: Path) -> None:
    """Leaves of a nested state dict, by DCP's rules: dicts always, lists when they hold tensors or containers.

    A loop: ``index.check_value`` first, then the leaves in order, a shared container under each of its
    paths, each path paying for its items: at most 16 per object built (``x = [x, x]`` x 40: 2^40 paths).

    Raises:
        NotADcpCheckpointError: past ``MAX_ENTRIES`` leaves or that bound, ``_MAX_DEPTH`` levels, or a value in itself.
    """
    try:
        budget = 16 * check_value(obj, _MAX_DEPTH) + 1024
    except ValueShapeError as e:
        raise NotADcpCheckpointError(f"{where}: {e}") from None
    pending: list[tuple[ObjPath, Any]] = [(path, obj)]
    expands: dict[int, bool] = {}  # a list's items are entries (it holds containers or tensors): decided once per list
    while pending:
        path, obj = pending.pop()
        budget -= 1 + (len(obj) if isinstance(obj, (dict, list)) else 0)  # each path pays for what it holds
        if budget < 0 or len(out) >= MAX_ENTRIES:
            raise NotADcpCheckpointError(f"{where}: values nested more than {_MAX_DEPTH} deep or more than {MAX_ENTRIES} of them")
        if isinstance(obj, dict):
            pending += [((*path, key), value) for key, value in reversed(obj.items())]
        elif isinstance(obj, list) and (
            expands[id(obj)] if id(obj) in expands else expands.setdefault(id(obj), any(isinstance(v, _ENTRY) for v in obj))
        ):
            pending += [((*path, i), obj[i]) for i in reversed(range(len(obj)))]
        else:
            out.append((path, obj))


@dataclass(frozen=True, slots=True)
class _Local:
    """One rank's piece of a tensor: global shape and dtype, and its box(es)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], ObjPath]]  # offsets, sizes, record inside the file


def _naturals(values: Any, where: str, what: str) -> tuple[int, ...]:
    """A sequence of non-negative 64-bit ints from a file, or NotADcpCheckpointError naming ``what`` (not its value)."""
    try:
        out = tuple(values)
    except TypeError:
        out = (None,)
    if not all(type(v) is int and 0 <= v < 1 << 63 for v in out):
        raise NotADcpCheckpointError(f"{where}: its {what} is not a sequence of non-negative integers")
    return out


def _placements(spec: dict[str, Any], where: str) -> tuple[Placement, ...]:
    """A DTensor spec's placements as ``(kind, dim, split_factor)``, after checking its shard order.

    ``shard_order``, where recorded, must be the default left-to-right one that DCP's
    ``compute_local_shape_and_global_offset`` assumes (it reads the placements alone); a spec
    that treats ``_StridedShard`` as a plain ``Shard`` (``use_strided_shard_as_shard_order``
    false, as view propagation may) is refused too.

    Raises:
        NotADcpCheckpointError: a ``Partial`` or unknown placement, or a shard order other than the default.
    """
    out: list[Placement] = []
    for p in spec["placements"]:
        if kind(p) in ("Shard", "_StridedShard"):
            dim, split_factor = _naturals([p.fields.get("dim"), p.fields.get("split_factor", 1)], where, "placement")
            if split_factor < 1:
                raise NotADcpCheckpointError(f"{where}: placement {p!r} has split factor {split_factor}")
            out.append((kind(p), dim, split_factor))
        elif kind(p) == "Replicate":
            out.append(("Replicate", 0, 1))
        else:  # Partial is never saved in a state dict
            raise NotADcpCheckpointError(f"{where}: placement {p!r} is not supported (Shard, _StridedShard and Replicate are)")
    strided = any(k == "_StridedShard" for k, _, _ in out)
    if strided and spec.get("use_strided_shard_as_shard_order") is False:
        raise NotADcpCheckpointError(
            f"{where}: its _StridedShard stands for a plain Shard (use_strided_shard_as_shard_order); not supported"
        )
    order = spec.get("shard_order")
    if order is not None:
        by_dim: dict[int, list[int]] = {}
        for mesh_dim, (k, dim, _) in enumerate(out):
            if k != "Replicate":
                by_dim.setdefault(dim, []).append(mesh_dim)
        try:
            recorded = {int(e.args[0]): tuple(e.args[1]) for e in order}
        except (AttributeError, TypeError, ValueError, IndexError) as e:
            raise NotADcpCheckpointError(f"{where}: malformed DTensor shard_order ({type(e).__name__}: {e})") from e
        if recorded != {d: tuple(m) for d, m in by_dim.items()}:
            raise NotADcpCheckpointError(
                f"{where}: shard order {recorded} is not left to right over the mesh dims; not supported"
            )
    return tuple(out)


def _dtensor_local(value: Record, where: str) -> _Local:
    """A DTensor record's box: the global shape from its wrapper, the box from its placements."""
    try:
        fields = value.fields
        local, spec = fields["_local_tensor"], fields["_spec"].fields
        dtype, shape = value.wrapper.args[1], value.wrapper.args[2]  # type: ignore[attr-defined]
        mesh = spec["mesh"].fields
        axes = [axis.fields.get("shape") if isinstance(axis, Record) else None for axis in mesh["_layout"].fields["axes"]]
        coordinate = mesh.get("_coordinate_on_dim")
        placements = _placements(spec, where)
    except (KeyError, AttributeError, TypeError, IndexError) as e:
        raise NotADcpCheckpointError(f"{where}: malformed DTensor ({type(e).__name__}: {e})") from e
    mesh_shape = mesh_sizes(axes, where)
    if coordinate is None:
        raise NotADcpCheckpointError(f"{where}: the DTensor does not record this rank's place in its mesh")
    coordinate = _naturals(coordinate, where, "mesh coordinate")
    if len(coordinate) != len(mesh_shape) or not all(c < n for c, n in zip(coordinate, mesh_shape, strict=True)):
        raise NotADcpCheckpointError(f"{where}: mesh coordinate {list(coordinate)[:8]} lies outside mesh {list(mesh_shape)}")
    if len(placements) != len(mesh_shape):
        raise NotADcpCheckpointError(f"{where}: {len(placements)} placements for a {len(mesh_shape)}-dim mesh")
    if not isinstance(local, torch.Tensor) or not isinstance(dtype, torch.dtype) or local.dtype != dtype:
        raise NotADcpCheckpointError(f"{where}: malformed DTensor (its local tensor and dtype disagree)")
    shape = _naturals(shape, where, "shape")
    check_elements(local, where)
    if any(k != "Replicate" and d >= len(shape) for k, d, _ in placements):
        raise NotADcpCheckpointError(f"{where}: a placement shards a dim the tensor does not have")
    if any(k == "_StridedShard" for k, _, _ in placements):
        try:
            box = strided_box(shape, mesh_shape, coordinate, placements)
        except TorchFeatureError as e:
            raise TorchFeatureError(f"{where}: {e}") from None
        if isinstance(box, str):
            raise NotADcpCheckpointError(f"{where}: {box}")
        sizes, offsets = box
    else:
        sizes, offsets = _local_box(shape, mesh_shape, coordinate, [None if k == "Replicate" else d for k, d, _ in placements])
    if tuple(local.shape) != sizes:
        raise CorruptChunkError(f"{where}: local tensor {list(local.shape)} does not match its placement's {list(sizes)}")
    return _Local(shape, local.dtype, [(offsets, sizes, ("_local_tensor",))])


@functools.lru_cache(maxsize=16)
def _strided_boxes(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] | str:
    """Every mesh coordinate's ``strided_box``, or the first reason one has none: O(mesh size), for small meshes."""
    boxes = {}
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        box = strided_box(shape, mesh_shape, coordinate, placements)
        if isinstance(box, str):
            return box
        boxes[coordinate] = box
    return boxes


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


def _sharded_tensor_local(value: Record, where: str) -> _Local:
    """A ShardedTensor record's local shards and their boxes, from its ``ShardMetadata``."""
    try:
        local_shards, meta, *_ = value.fields["__tuple_state__"]
        meta_fields = meta.fields
        shape = _naturals(meta_fields["size"], where, "size")
        properties = meta_fields["tensor_properties"].fields
        dtype = properties["dtype"] if "dtype" in properties else properties["__tuple_state__"][0]
        boxes: list[tuple[tuple[int, ...], tuple[int, ...], ObjPath]] = []
        for i, shard in enumerate(local_shards):
            tensor, shard_meta = shard.fields["tensor"], shard.fields["metadata"].fields
            offsets = _naturals(shard_meta["shard_offsets"], where, f"shard {i}'s offsets")
            sizes = _naturals(shard_meta["shard_sizes"], where, f"shard {i}'s sizes")
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != sizes or tensor.dtype != dtype:
                raise CorruptChunkError(f"{where}: local shard {i} does not match its metadata ({list(sizes)[:8]}, {dtype})")
            check_elements(tensor, f"{where} (shard {i})")
            boxes.append((offsets, sizes, ("local_shards", i)))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise NotADcpCheckpointError(f"{where}: malformed ShardedTensor ({type(e).__name__}: {e})") from e
    if not isinstance(dtype, torch.dtype):
        raise NotADcpCheckpointError(f"{where}: malformed ShardedTensor (no dtype)")
    return _Local(shape, dtype, boxes)


def _local_of(value: Any, where: str, first_rank: bool) -> _Local | None:
    """The tensor piece a leaf holds, or None for a plain value."""
    if value.__class__ is SHARDED_TENSOR:
        return _sharded_tensor_local(value, where)
    if kind(value) == "DTensor":
        return _dtensor_local(value, where)
    if isinstance(value, Record):  # a mesh, a placement... where a value should be
        raise NotADcpCheckpointError(f"{where}: a {value.qualname} is not a state dict value")
    if isinstance(value, torch.Tensor):  # replicated: every rank saved it whole; rank 0's copy is read
        check_elements(value, where)
        shape = tuple(value.shape)
        return _Local(shape, value.dtype, [((0,) * len(shape), shape, ())] if first_rank else [])
    return None


def rank_files_index(root: Path) -> CheckpointIndex:
    """Index a folder of per-rank torch.save files (see the module docstring).

    Every file is loaded (memory-mapped, no tensor data read). A DTensor's box comes from its
    placements and mesh coordinate, a ShardedTensor's from its ``ShardMetadata``; a plain tensor
    (present on every rank, as replicated state is) is read from the first rank's file, as are
    plain values. Entries go under ``model``/``optim`` by file prefix, others under their prefix.
    A ``_StridedShard`` placement (FSDP over tensor parallelism) gets torch's box for it, the one
    ``dcp.save`` records (``_rank_pieces.strided_box``: this rank's alone, whatever the mesh
    size); one whose shards are not boxes is refused. Work is linear in the files' sizes.

    Raises:
        NotADcpCheckpointError: no rank files, files that disagree on a value's kind, shape or
            dtype, or claims past the caps (mesh size, split factor, nesting, number of values).
        MissingDataFileError: a rank's file is missing.
        UnsafeContentError, CorruptChunkError: a file would run code, does not load, or holds a
            local tensor whose elements overlap in storage (stride 0).
        TorchFeatureError: a ``_StridedShard`` placement, and this torch cannot compute its offsets.
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
            _walk(_load_inside(root, path, None), (), leaves, path)  # no link out of the folder
            for obj_path, value in leaves:
                where = f"{path} {'.'.join(map(str, obj_path))}"
                local = _local_of(value, where, rank == first)
                saw_sharded_tensor |= value.__class__ is SHARDED_TENSOR
                if obj_path not in tensors and obj_path not in values:
                    order.append(obj_path)
                    if local is None:
                        values[obj_path] = BytesEntry(
                            fqn=dcp_key((top, *obj_path)), path=(top, *obj_path), relative_path=path.name,
                            offset_bytes=0, length_bytes=0, record=obj_path,
                        )  # fmt: skip
                    else:
                        tensors[obj_path] = (local.shape, local.dtype, [])
                elif (obj_path in values) != (local is None) or (local and tensors[obj_path][:2] != (local.shape, local.dtype)):
                    raise NotADcpCheckpointError(f"{where}: rank files disagree on this value's kind, shape or dtype")
                if local is None:
                    continue
                chunks = tensors[obj_path][2]
                for offsets, sizes, record in local.boxes:
                    chunks.append(
                        ChunkEntry(
                            offsets=offsets, sizes=sizes, relative_path=path.name, offset_bytes=0,
                            length_bytes=math.prod(sizes) * local.dtype.itemsize,
                            record=(*obj_path, *record),
                        )
                    )  # fmt: skip
        for obj_path in order:
            if obj_path in values:
                entries.append(values[obj_path])
                continue
            shape, dtype, chunks = tensors[obj_path]
            chunks = drop_replicas(chunks)  # (Replicate placements, sub-meshes of size 1)
            fqn = dcp_key((top, *obj_path))
            stored = tuple(c for c in chunks if c.numel > 0) or tuple(chunks[:1])  # empty shards of small tensors
            entries.append(TensorEntry(fqn=fqn, path=(top, *obj_path), shape=shape, dtype=dtype, chunks=stored))
    producer = "fsdp1" if saw_sharded_tensor else "verl" if any("_world_size_" in f for f in files) else "torch_save"
    ranks = max(len(by_rank) for by_rank in groups.values())
    return CheckpointIndex(
        checkpoint_id=root, entries=tuple(entries), data_files=tuple(sorted(files)), producer=producer, ranks=ranks
    )


class RankFilesReader(ChunkedReader):
    """Reads the tensors and values of per-rank torch.save files; each file is loaded once, memory-mapped.

    A chunk's ``record`` names its local tensor inside the file (``local_value``); the file's data
    is read only when a tensor is copied out of it.

    Args:
        checkpoint_id: the folder of rank files (local only).
        check_crc: unused (torch.save files are read memory-mapped); kept for the shared signature.
    """

    def __init__(self, checkpoint_id: Any, *, check_crc: bool = True) -> None:
        super().__init__(checkpoint_id, check_crc=check_crc)
        self._rank_files: dict[str, Any] = {}  # relative path -> loaded per-rank torch.save file

    def close(self) -> None:
        """Drop the loaded files (and their memory maps) and close the read log."""
        self._rank_files.clear()
        super().close()

    def _rank_file(self, relative_path: str) -> Any:
        """A per-rank torch.save file, loaded once (memory-mapped) and kept while the reader is open."""
        loaded = self._rank_files.get(relative_path)
        if loaded is None:
            path = self.root / relative_path
            if isinstance(path, Url):
                raise InvalidOptionError(f"{path}: per-rank torch.save files are read from local paths only")
            if not path.is_file():
                raise MissingDataFileError(f"cannot open {path}: No such file")
            loaded = self._rank_files[relative_path] = _load_inside(Path(self.root), path, self.follow_symlinks)
        return loaded

    def _load_chunk(self, entry: TensorEntry, chunk: ChunkEntry) -> Any:
        assert chunk.relative_path is not None
        return local_value(self._rank_file(chunk.relative_path), chunk.record)

    def read_value(self, entry: BytesEntry) -> Any:
        """The plain value a rank file holds at ``entry.record`` (param group field, train state).

        Raises:
            MissingDataFileError, CorruptChunkError, UnsafeContentError: as their names say.
        """
        return local_value(self._rank_file(entry.relative_path), entry.record)

    def read_raw(self, entry: BytesEntry) -> bytes:
        """The value as DCP stores a bytes entry: its torch.save payload.

        Raises:
            As ``read_value``.
        """
        buf = io.BytesIO()
        torch.save(self.read_value(entry), buf)
        return buf.getvalue()


def _load_inside(root: Path, path: Path, follow_symlinks: bool | None) -> Any:
    """``load_rank_file`` of ``path`` opened by ``location.open_inside`` (its descriptor loaded, never its name again).

    Raises:
        As ``load_rank_file``; UnsafeContentError: a link out of ``root``; MissingDataFileError: it cannot be opened.
    """
    try:
        fd = open_inside(root, path, follow_symlinks=follow_symlinks)
    except OSError as e:
        raise MissingDataFileError(f"cannot open {path}: {e.strerror}") from e
    try:
        return load_rank_file(cast(Path, FdPath(fd, path)))  # opens /proc/self/fd/N; its messages name path
    finally:
        os.close(fd)  # the memory map keeps the file
