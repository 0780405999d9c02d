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
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp_convert._location import Location, Url
from fsdp_convert.errors import CoverageError

__all__ = [
    "ObjPath",
    "Url",  # from _location, as every format and operation names them
    "Location",
    "ChunkEntry",
    "TensorEntry",
    "BytesEntry",
    "Entry",
    "CheckpointIndex",
    "dtype_name",
    "dcp_key",
    "DictKey",
    "plain_path",
    "flatten_with_paths",
    "unflatten",
    "check_coverage",
]

_DATA_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


ObjPath = tuple[str | int, ...]


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


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    """A tensor of the checkpoint: global shape and dtype, and its chunks.

    Attributes:
        fqn: the flattened key as DCP stores it (e.g. ``model.layers.0.attn.wq.weight``).
        path: the key's path in the nested state dict the producer saved (from ``planner_data``).
        shape: global shape, in elements.
        dtype: element type.
        chunks: the stored boxes, in ``.metadata`` order.
    """

    fqn: str
    path: ObjPath
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[ChunkEntry, ...]

    @property
    def numel(self) -> int:
        """Number of elements of the global tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the full tensor in memory, in bytes."""
        return self.numel * self.dtype.itemsize

    @property
    def stored_bytes(self) -> int:
        """Sum of the chunk payload lengths in the data files, in bytes."""
        return sum(c.length_bytes for c in self.chunks)


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
        producer: the producer when the folder's files name it (``accelerate``, ``lightning``,
            ``verl``, ``hf_storage``...), else None and ``layout.detect_producer`` judges by the keys.
        ranks: the producer's world size when the data file names do not follow DCP's
            ``__<rank>_<n>.distcp`` (per-rank torch.save files, safetensors shards).
    """

    checkpoint_id: Location
    entries: tuple[Entry, ...]
    data_files: tuple[str, ...]
    version: str | None = None
    save_id: str | None = None
    producer: str | None = None
    ranks: int | None = None

    @property
    def writer_ranks(self) -> tuple[int, ...]:
        """Ranks that wrote data files, parsed from ``__<rank>_<n>.distcp`` names."""
        ranks = {int(m.group(1)) for f in self.data_files if (m := _DATA_FILE_RE.match(Path(f).name))}
        return tuple(sorted(ranks))

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


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as JSON output and tables write dtypes."""
    return str(dtype).removeprefix("torch.")


def dcp_key(path: ObjPath) -> str:
    """DCP's flattened key of a nested path: its elements joined by dots (``optim.param_groups.0.lr``)."""
    return ".".join(str(p) for p in path)


class DictKey(int):
    """An ``int`` path element that keys a dict rather than indexing a list (optimizer state by id).

    DCP's paths cannot tell ``{"state": {0: ...}}`` from a list; the transform marks the ids it
    makes, and ``unflatten`` returns them as plain ``int`` keys.
    """

    __slots__ = ()


def plain_path(path: ObjPath) -> ObjPath:
    """``path`` as DCP's ``planner_data`` records it: dict keys as strings (``DictKey(0)`` -> ``"0"``).

    torch's ``unflatten_state_dict`` then rebuilds a dict, not a list, from them.
    """
    return tuple(str(int(p)) if isinstance(p, DictKey) else p for p in path)


def flatten_with_paths(obj: Mapping[Any, Any]) -> dict[str, tuple[ObjPath, Any]]:
    """Flatten a nested state dict as DCP's ``flatten_state_dict`` does: dotted key -> (path, value).

    Dicts are always walked; lists only when they hold tensors or containers that do
    (``torch/distributed/checkpoint/_traverse.py``); anything else is a value. The path is the
    value's place in the nested dict, as DCP records it in ``planner_data``; an ``int`` dict key
    becomes a ``DictKey`` (so ``unflatten`` gives back ``{0: ...}``, not ``{"0": ...}``).

    Raises:
        ValueError: a dict key that is neither a string nor an integer, or two paths with the same
            dotted key (``{"a.b": x, "a": {"b": y}}``); the message names the key.
    """
    flat: dict[str, tuple[ObjPath, Any]] = {}

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        return not any(isinstance(v, torch.Tensor) or (isinstance(v, (Mapping, list)) and not terminal(v)) for v in value)

    def element(path: ObjPath, key: Any) -> str | int:
        if isinstance(key, str):
            return key
        if isinstance(key, int) and not isinstance(key, bool):
            return DictKey(key)
        where = dcp_key(path) or "the top level"
        raise ValueError(f"key {key!r} under {where} is a {type(key).__name__}, not a string or integer")

    def visit(path: ObjPath, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit((*path, element(path, k)), v)
        elif terminal(value):
            key = dcp_key(path)
            if key in flat:
                raise ValueError(f"two entries flatten to the key {key!r} ({flat[key][0]!r} and {path!r})")
            flat[key] = (path, value)
        else:
            for i, v in enumerate(value):
                visit((*path, i), v)

    for key, value in obj.items():
        visit((element((), key),), value)
    return flat


def unflatten(items: Iterable[tuple[ObjPath, Any]]) -> dict[str, Any]:
    """Rebuild the nested state dict from (path, value) pairs, as DCP's ``unflatten_state_dict``.

    A path element that is an ``int`` indexes a list (``("optim", "param_groups", 0, "lr")``);
    a ``str`` or ``DictKey`` element keys a dict. Lists come out dense, in index order.

    Raises:
        ValueError: two paths disagree on whether a level is a list or a dict, a path is given
            twice or runs through another's value, or a list index is missing (names the path).
    """
    root: dict[Any, Any] = {}
    list_nodes: set[int] = set()  # ids of dicts that stand for lists (int keys)
    for path, value in items:
        node = root
        for i, key in enumerate(path):
            is_index = isinstance(key, int) and not isinstance(key, DictKey)
            if node and is_index != (id(node) in list_nodes):
                raise ValueError(f"path {path!r} mixes list and dict keys at level {i}")
            if is_index:
                list_nodes.add(id(node))
            if i == len(path) - 1:
                if key in node:
                    raise ValueError(f"path {path!r} is given twice, or also holds other values")
                node[key] = _Leaf(value)
            else:
                node = node.setdefault(key, {})
                if isinstance(node, _Leaf):
                    raise ValueError(f"path {path!r} runs through a value at level {i}")
    nested: dict[str, Any] = _densify(root, list_nodes)
    return nested


class _Leaf:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _densify(node: Any, list_nodes: set[int]) -> Any:
    if isinstance(node, _Leaf):
        return node.value
    if id(node) in list_nodes:
        keys = sorted(node)
        if keys != list(range(len(keys))):
            raise ValueError(f"list indices {keys} are not 0..{len(keys) - 1}")
        return [_densify(node[k], list_nodes) for k in keys]
    return {int(k) if isinstance(k, DictKey) else k: _densify(v, list_nodes) for k, v in node.items()}


def _box_end(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(o + s for o, s in zip(offsets, sizes, strict=True))


def check_coverage(entry: TensorEntry) -> None:
    """Check that the entry's chunks tile its global shape exactly: inside it, no overlap, no gap.

    Runs in O(chunks^2 x ndim), which is small: one chunk per writing rank and placement.

    Raises:
        CoverageError: a chunk lies outside the shape, two chunks overlap, or elements are missing;
            the message names the FQN and the chunks' offsets.
    """
    for c in entry.chunks:
        if len(c.offsets) != len(entry.shape) or len(c.sizes) != len(entry.shape):
            raise CoverageError(
                f"{entry.fqn}: chunk at offsets {list(c.offsets)} has not the {len(entry.shape)} dims of its tensor"
            )
        if any(o < 0 for o in c.offsets) or any(s < 0 for s in c.sizes):
            raise CoverageError(f"{entry.fqn}: chunk at offsets {list(c.offsets)} with sizes {list(c.sizes)} is negative")
    boxes = [(c.offsets, c.sizes) for c in entry.chunks if c.numel > 0]
    for offsets, sizes in boxes:
        if any(e > s for e, s in zip(_box_end(offsets, sizes), entry.shape, strict=True)):
            raise CoverageError(
                f"{entry.fqn}: chunk at offsets {list(offsets)} with sizes {list(sizes)} lies outside shape {list(entry.shape)}"
            )
    for (oa, sa), (ob, sb) in itertools.combinations(boxes, 2):
        ea, eb = _box_end(oa, sa), _box_end(ob, sb)
        if all(max(a0, b0) < min(a1, b1) for a0, a1, b0, b1 in zip(oa, ea, ob, eb, strict=True)):
            raise CoverageError(f"{entry.fqn}: chunks at offsets {list(oa)} and {list(ob)} overlap")
    covered = sum(c.numel for c in entry.chunks)
    if covered != entry.numel:
        raise CoverageError(f"{entry.fqn}: chunks cover {covered} of {entry.numel} elements; the checkpoint has a gap")
