"""Per-rank torch.save files (verl, FSDP1 ``SHARDED_STATE_DICT``): index from placements, reads of their tensors.

verl saves ``model_world_size_{N}_rank_{r}.pt`` (and ``optim_...``, ``extra_state_...``) holding
FSDP2 DTensors; FSDP1 users save ``SHARDED_STATE_DICT`` rank by rank with ``torch.save``
(``ShardedTensor`` values). There is no ``.metadata``: the index is built from the files' own
shard offsets and placements (``_rank_shards``). Files are loaded by ``_rank_unpickler.load_rank_file`` (memory-mapped,
nothing runs, no process group needed); a chunk is the local tensor its ``record`` names.
"""

from __future__ import annotations

import io
import math
import os
import re
from pathlib import Path
from typing import Any, cast

import torch

from fsdp_convert.errors import InvalidOptionError, MissingDataFileError, NotADcpCheckpointError
from fsdp_convert.formats._rank_pieces import drop_replicas
from fsdp_convert.formats._rank_shards import local_shard
from fsdp_convert.formats._rank_unpickler import SHARDED_TENSOR, Record, load_rank_file, local_value
from fsdp_convert.formats.index import (
    MAX_ENTRIES,
    BytesEntry,
    CheckpointIndex,
    ChunkEntry,
    Entry,
    Mark,
    ObjPath,
    TensorEntry,
    Url,
    ValueShapeError,
    check_value,
    dcp_key,
)
from fsdp_convert.formats.reader import ChunkedReader
from fsdp_convert.held_roots import open_inside
from fsdp_convert.location import FdPath

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
                local = local_shard(value, where, rank == first)
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
    marks: frozenset[Mark] = frozenset({"rank_files", "sharded_tensor"} if saw_sharded_tensor else {"rank_files"})
    ranks = max(len(by_rank) for by_rank in groups.values())
    return CheckpointIndex(checkpoint_id=root, entries=tuple(entries), data_files=tuple(sorted(files)), marks=marks, ranks=ranks)


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
