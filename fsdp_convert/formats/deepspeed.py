"""DeepSpeed ZeRO checkpoints (stages 1, 2, 3 and BF16_Optimizer) as a source: index from the partitions, bare reads.

A ZeRO save (``deepspeed_files``) keeps the fp32 master weights and the optimizer state as flat
partitions per data-parallel rank: ZeRO-1/2 and BF16_Optimizer split each param group's flat
vector into equal partitions (``single_partition_of_fp32_groups``; ZeRO-1/2 with
``param_alignment_paddings`` between parameters), ZeRO-3 splits every parameter into
``ceil(numel / N)`` elements per rank, concatenated per sub-group (``fp32_flat_groups``), as
``deepspeed/utils/zero_to_fp32.py`` reads them back. Here each parameter is a ``TensorEntry`` of
its own shape whose chunks are the boxes (``_flat_ranges``) of the flat ranges each partition holds,
each one byte range of its file: the index is laid out as FSDP2's DCP save of the same model and
AdamW (``model.<fqn>``; ``optim.state.<fqn>.<key>``, ``optim.param_groups.<g>.<key>``), so every
operation reads it as it reads DCP. The model is the fp32 masters, with frozen parameters and buffers
as the module holds them and tied names (``shared_params``) as the module lists them; the model
states file's other keys (``global_steps``, ``ds_config``, client state) are values at the top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_convert.errors import CorruptChunkError, InvalidOptionError, UnsupportedTransformError
from fsdp_convert.formats._ds_records import holds_records
from fsdp_convert.formats._flat_ranges import Piece, flat_boxes, zero3_pieces, zero12_pieces
from fsdp_convert.formats.deepspeed_files import DeepSpeedFiles, LoadedSave, deepspeed_files, file_tensor, is_size, stage_of
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
    dcp_key,
    flatten_with_paths,
)

if TYPE_CHECKING:  # the index imports no torch; zero_save (reshard to a DeepSpeed save) loads with it
    import torch

__all__ = ["ModuleTensor", "Piece", "ZeroSave", "deepspeed_index", "zero_save", "zero3_pieces", "zero12_pieces"]

# The model states file's keys that describe the layout (read here), not state to keep.
# ``dp_world_size`` describes the save, not the run: a reshard rewrites it (and ``verify`` of the two is equal).
_LAYOUT_KEYS = frozenset(
    "module buffer_names param_shapes frozen_param_shapes frozen_param_fragments shared_params optimizer dp_world_size".split()
)
_MAX_DIMS = 64


class _NeedsTorch(Exception):
    """The model states file holds a value that torch's loader reads as tensors (a list of them): index with it."""


def _chunks(shape: tuple[int, ...], itemsize: int, pieces: list[tuple[str, int, int, int]]) -> tuple[ChunkEntry, ...]:
    """The chunks of a tensor stored as flat pieces: (file, byte offset of element ``lo``, lo, hi) each."""
    out = []
    for file, at, lo, hi in pieces:
        for offsets, sizes, first in flat_boxes(shape, lo, hi):
            nbytes = math.prod(sizes) * itemsize
            out.append(
                ChunkEntry(
                    offsets=offsets,
                    sizes=sizes,
                    relative_path=file,
                    offset_bytes=at + (first - lo) * itemsize,
                    length_bytes=nbytes,
                )
            )
    return tuple(out)


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not is_size(value) or len(value) > _MAX_DIMS or any(d < 0 for d in value):
        raise CorruptChunkError(f"{where}: a parameter shape that is not a torch.Size of at most {_MAX_DIMS} dims")
    return tuple(value)


def _frozen_fragments(loaded: LoadedSave, name: str, shape: tuple[int, ...]) -> TensorEntry:
    """A ZeRO-3 frozen parameter: ``ceil(numel / N)`` elements in each rank's ``frozen_param_fragments``."""
    ws, numel = loaded.files.world_size, math.prod(shape)
    part, located, dtype = -(-numel // ws), [], None
    for rank in range(ws):
        lo, hi = min(rank * part, numel), min((rank + 1) * part, numel)
        frags = loaded.model[rank][0].get("frozen_param_fragments") or {}
        where = f"{loaded.root / loaded.files.model[rank]} frozen_param_fragments.{name}"
        flat = frags.get(name)
        if lo == hi:
            continue
        at, facts = loaded.byte_offset(flat, loaded.model[rank], where)
        if len(facts.shape) != 1 or facts.numel < hi - lo:
            raise CorruptChunkError(f"{where}: holds fewer elements than its share of {name}")
        dtype = facts
        located.append((loaded.files.model[rank], at, lo, hi))
    name_of, itemsize = (dtype.dtype_name, dtype.itemsize) if dtype else ("float32", 4)
    return TensorEntry(
        fqn=dcp_key(("model", name)),
        path=("model", name),
        shape=shape,
        dtype_name=name_of,
        chunks=_chunks(shape, itemsize, located),
    )


class _Builder:
    """Builds the index's entries from the loaded files (see the module docstring)."""

    def __init__(self, loaded: LoadedSave, module_weights: bool = False) -> None:
        self.loaded, self.files = loaded, loaded.files
        self.model0 = loaded.model[0][0]
        if not isinstance(self.model0, dict) or not isinstance(self.model0.get("module"), dict):
            raise CorruptChunkError(f"{loaded.root / self.files.model[0]}: not a DeepSpeed model states file (no module)")
        self.osd = [self._optimizer_state(r) for r in range(self.files.world_size)]
        self.stage = stage_of(self.osd[0], str(loaded.root / self.files.optim[0]))
        self.entries: list[Entry] = []
        self.masters: dict[str, TensorEntry] = {}
        self.module_weights = module_weights  # the model from the module's own weights (deepspeed_index's weights="module")

    def _optimizer_state(self, rank: int) -> dict[str, Any]:
        obj = self.loaded.optim[rank][0]
        osd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
        if not isinstance(osd, dict):
            raise CorruptChunkError(f"{self.loaded.root / self.files.optim[rank]}: no optimizer_state_dict")
        return osd

    def where(self, rank: int, *keys: Any) -> str:
        return f"{self.loaded.root / self.files.optim[rank]} {'.'.join(map(str, keys))}"

    def param_shapes(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        groups = self.model0.get("param_shapes")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise CorruptChunkError(f"{self.loaded.root / self.files.model[0]}: param_shapes is not a list of dicts")
        where = str(self.loaded.root / self.files.model[0])
        return [[(name, _shape(shape, f"{where} param_shapes {name}")) for name, shape in g.items()] for g in groups]

    def containers(self, rank: int) -> tuple[list[Any], list[dict[str, Any]], list[int]]:
        """A rank's flat fp32 tensors (param groups, or ZeRO-3's sub-groups), their optimizer states, and the group of each."""
        osd = self.osd[rank]
        if self.stage == 3:
            flats, base = osd.get("fp32_flat_groups"), osd.get("optimizer_state_dict")
        else:
            flats, base = osd.get("single_partition_of_fp32_groups"), osd.get("base_optimizer_state")
        if not isinstance(base, dict) or not isinstance(base.get("state"), dict) or not isinstance(flats, list):
            raise UnsupportedTransformError(
                f"{self.where(rank)}: an optimizer state saved in a layout this tool does not read (elastic or offloaded)"
            )
        states = [base["state"].get(i, {}) for i in range(len(flats))]
        group_of = [0] * len(flats)
        for g, group in enumerate(base.get("param_groups", [])):
            for i in group.get("params", []):
                if type(i) is int and 0 <= i < len(flats):
                    group_of[i] = g
        return flats, states, group_of

    def pieces(self) -> dict[str, list[Piece]]:
        """Every trainable parameter's flat pieces, by name (``param_shapes`` order).

        Raises:
            CorruptChunkError: the partitions do not hold the parameters ``param_shapes`` lists.
        """
        ws, shapes = self.files.world_size, self.param_shapes()
        sizes = [[getattr(file_tensor(t), "numel", -1) for t in self.containers(r)[0]] for r in range(ws)]
        try:
            if self.stage == 3:
                return zero3_pieces(shapes, sizes)
            paddings = self.osd[0].get("param_alignment_paddings") or [[0] * len(g) for g in shapes]
            return zero12_pieces(shapes, sizes, paddings)
        except ValueError as e:
            raise CorruptChunkError(f"{self.where(0)}: {e}") from None

    def add(self, entry: Entry) -> None:
        if len(self.entries) >= MAX_ENTRIES:
            raise CorruptChunkError(f"{self.loaded.root}: more than {MAX_ENTRIES} entries")
        self.entries.append(entry)

    def flat_entry(self, path: ObjPath, shape: tuple[int, ...], pieces: list[Piece], tensor_of: Any, what: str) -> TensorEntry:
        """A tensor stored as ``pieces`` of the flat tensors ``tensor_of(rank, container)`` (``what`` names them)."""
        located = []
        dtype, itemsize = None, 4  # an empty parameter (no piece): float32
        for rank, j, local, lo, hi in pieces:
            flat = tensor_of(rank, j)
            where = self.where(rank, what, j)
            at, facts = self.loaded.byte_offset(flat, self.loaded.optim[rank], where)
            if len(facts.shape) != 1 or local + (hi - lo) > facts.numel:
                raise CorruptChunkError(f"{where}: holds {facts.numel} elements, {dcp_key(path)} needs more")
            if dtype not in (None, facts.dtype_name):
                raise CorruptChunkError(f"{where}: the ranks' partitions differ in dtype")
            dtype, itemsize = facts.dtype_name, facts.itemsize
            located.append((self.files.optim[rank], at + local * itemsize, lo, hi))
        chunks = _chunks(shape, itemsize, located) or (
            ChunkEntry(offsets=(0,) * len(shape), sizes=shape, relative_path=None, offset_bytes=0, length_bytes=0),
        )
        return TensorEntry(fqn=dcp_key(path), path=path, shape=shape, dtype_name=dtype or "float32", chunks=chunks)

    def whole_entry(self, path: ObjPath, tensor: Any, rank: int, model_file: bool, where: str) -> TensorEntry:
        """A tensor stored whole (a buffer, a frozen parameter of ZeRO-1/2, a step)."""
        loaded = (self.loaded.model if model_file else self.loaded.optim)[rank]
        file = (self.files.model if model_file else self.files.optim)[rank]
        facts = file_tensor(tensor)
        if facts is None:
            raise CorruptChunkError(f"{where}: not a tensor")
        nbytes = facts.numel * facts.itemsize  # none: an empty tensor, no bytes to read
        at = self.loaded.byte_offset(tensor, loaded, where)[0] if nbytes else 0
        chunk = ChunkEntry(
            offsets=(0,) * len(facts.shape),
            sizes=facts.shape,
            relative_path=file if nbytes else None,
            offset_bytes=at,
            length_bytes=nbytes,
        )
        return TensorEntry(fqn=dcp_key(path), path=path, shape=facts.shape, dtype_name=facts.dtype_name, chunks=(chunk,))

    def value(self, path: ObjPath, file: str, record: ObjPath) -> None:
        self.add(BytesEntry(fqn=dcp_key(path), path=path, relative_path=file, offset_bytes=0, length_bytes=0, record=record))

    def build(self) -> None:
        pieces = self.pieces()
        shapes = dict(p for group in self.param_shapes() for p in group)
        flats = [self.containers(r) for r in range(self.files.world_size)]
        for name, shape in shapes.items():
            self.masters[name] = self.flat_entry(
                ("model", name), shape, pieces[name], lambda r, j: flats[r][0][j], "fp32 partition"
            )
        self.model_entries(pieces)
        self.optimizer_entries(pieces, shapes, flats)
        model_file = self.files.model[0]
        rest = {k: v for k, v in self.model0.items() if k not in _LAYOUT_KEYS and isinstance(k, str)}
        try:  # nested dicts as leaves, as DCP flattens them (a consolidated file read back gives the same keys)
            leaves = flatten_with_paths(rest)
        except (ValueShapeError, ValueError) as e:
            raise CorruptChunkError(f"{self.loaded.root / model_file}: {e}") from None
        for path, value in leaves.values():
            if file_tensor(value) is not None:
                self.add(self.whole_entry(path, value, 0, True, f"{self.loaded.root / model_file} {dcp_key(path)}"))
            elif holds_records(value):  # a list of tensors, walked into as torch's tensors: index that file's way
                raise _NeedsTorch
            else:
                self.value(path, model_file, path)

    def model_entries(self, pieces: dict[str, list[Piece]]) -> None:
        module, model_file = self.model0["module"], self.files.model[0]
        shared = self.model0.get("shared_params") or {}
        frozen = self.model0.get("frozen_param_shapes") or {}
        by_name: dict[str, TensorEntry] = {}
        for name, tensor in module.items():
            where = f"{self.loaded.root / model_file} module.{name}"
            if name in self.masters and not self.module_weights:
                entry = self.masters[name]
            elif name in shared and (shared[name] in self.masters or shared[name] in by_name):
                target = by_name.get(shared[name]) or self.masters[shared[name]]
                entry = TensorEntry(
                    fqn=dcp_key(("model", name)),
                    path=("model", name),
                    shape=target.shape,
                    dtype=target.dtype,
                    chunks=target.chunks,
                )
            elif self.stage == 3 and name in frozen:
                entry = _frozen_fragments(self.loaded, name, _shape(frozen[name], where))
            else:
                entry = self.whole_entry(("model", name), tensor, 0, True, where)
            by_name[name] = entry
            self.add(entry)

    def optimizer_entries(self, pieces: dict[str, list[Piece]], shapes: dict[str, tuple[int, ...]], flats: list[Any]) -> None:
        _, states0, group_of = flats[0]
        for name, shape in shapes.items():
            first = pieces[name][0][1] if pieces[name] else 0
            for key, value in states0[first].items():
                path: ObjPath = ("optim", "state", name, key)
                facts = file_tensor(value)
                if facts is not None and len(facts.shape) == 1:
                    self.add(
                        self.flat_entry(path, shape, pieces[name], lambda r, j, key=key: flats[r][1][j][key], f"state {key}")
                    )
                elif facts is not None:
                    self.add(self.whole_entry(path, value, 0, False, self.where(0, "state", first, key)))
                else:
                    record = (
                        "optimizer_state_dict",
                        "optimizer_state_dict" if self.stage == 3 else "base_optimizer_state",
                        "state",
                        first,
                        key,
                    )
                    self.value(path, self.files.optim[0], record)
        base = "optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"
        groups = self.osd[0][base].get("param_groups", [])
        for g, group in enumerate(groups):
            for key in group:
                at: ObjPath = ("optim", "param_groups", g, key)
                if key == "params":  # ZeRO-3: the group's sub-groups, each a list of param_shapes
                    members = [i for i, of in enumerate(group_of) if of == g] if self.stage == 3 else [g]
                    self.value(at, self.files.model[0], ("param_shapes", *members))
                else:
                    self.value(at, self.files.optim[0], ("optimizer_state_dict", base, "param_groups", g, key))

    def details(self) -> tuple[tuple[str, str], ...]:
        module = self.model0["module"]
        params = {n for g in self.param_shapes() for n, _ in g} | set(self.model0.get("frozen_param_shapes") or ())
        dtypes = sorted({facts.dtype_name for n, t in module.items() if n in params and (facts := file_tensor(t))})
        kind = "BF16_Optimizer (ZeRO-1)" if self.stage == 0 else f"ZeRO-{self.stage}"
        return (("deepspeed", kind), ("parameters", ", ".join(dtypes) or "-"), ("master weights", "float32"))


def deepspeed_index(root: Path | Url, *, weights: str = "master") -> CheckpointIndex:
    """Index a DeepSpeed ZeRO save (see the module docstring): the tag folder, or the folder whose ``latest`` names it.

    Each file is loaded without torch (``load_ds_file``; torch's loader where that, or a list of tensors, needs it); work is
    linear in the number of parameters times the ranks each spans. ``weights="module"``: the model
    is the module's own weights as the model states file holds them (ZeRO-1/2: the whole module,
    in its dtype) instead of the fp32 masters; the optimizer state is the same.

    Raises:
        NotADcpCheckpointError: no model states, or a save with tensor or pipeline parallelism.
        MissingDataFileError: a rank's file is missing.
        UnsafeContentError: a file names a class other than torch's and DeepSpeed's three.
        CorruptChunkError: files that disagree with each other (partitions too small, shapes).
        UnsupportedTransformError: an optimizer state layout this tool does not read.
    """
    if isinstance(root, Url):
        raise InvalidOptionError(f"{root}: DeepSpeed checkpoints are read from local paths only")
    files = deepspeed_files(root)
    builder = _Builder(LoadedSave(root, files), weights == "module")
    if builder.module_weights and builder.stage == 3:
        raise UnsupportedTransformError(
            f"--weights module: {root} is a ZeRO-3 save, whose model states hold no weights (only placeholders); "
            "--dtype bf16 gives the master weights cast as DeepSpeed casts them"
        )
    try:
        builder.build()
    except _NeedsTorch:
        builder = _Builder(LoadedSave(root, files, use_torch=True), builder.module_weights)
        builder.build()
    return CheckpointIndex(
        checkpoint_id=root,
        entries=tuple(builder.entries),
        data_files=tuple(sorted({*files.model, *files.optim})),
        ranks=files.world_size,
        marks=frozenset({"deepspeed"}),
        details=builder.details(),
    )


@dataclass(frozen=True, slots=True)
class ModuleTensor:
    """A tensor of the model states file's ``module``: its dtype and shape, and where its bytes lie (None: no bytes)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str | None
    offset: int


@dataclass(frozen=True, slots=True)
class ZeroSave:
    """What writing a DeepSpeed save for another data-parallel size needs of the source save, besides its index.

    Attributes:
        files: its files (``deepspeed_files.DeepSpeedFiles``); ``files.tag`` is ``"<tag>/"`` or ``""``.
        stage: 1, 2, 3, or 0 for BF16_Optimizer.
        groups: each param group's parameters ``(name, shape)`` in order (ZeRO-3: sub-groups merged back).
        paddings: ZeRO-1/2's ``param_alignment_paddings``; None for the others.
        sub_group_size: ZeRO-3's ``zero_optimization.sub_group_size`` from the saved ``ds_config`` (elements).
        model_states: rank 0's model states file, loaded (``module`` and all), nothing run.
        optim_states: rank 0's optimizer states file, loaded; DeepSpeed's classes as inert records.
        module: the ``module`` tensors, in order (ZeRO-3: buffers, and empty placeholders).
    """

    files: DeepSpeedFiles
    stage: int
    groups: list[list[tuple[str, tuple[int, ...]]]]
    paddings: list[list[int]] | None
    sub_group_size: int
    model_states: dict[str, Any]
    optim_states: dict[str, Any]
    module: tuple[ModuleTensor, ...]


def zero_save(root: Path) -> ZeroSave:
    """The source save's layout and rank 0's files, to write it again for another data-parallel size.

    Raises:
        As ``deepspeed_index``.
    """
    files = deepspeed_files(root)
    loaded = LoadedSave(root, files, use_torch=True)  # the records are written back with torch's tensors
    builder = _Builder(loaded)
    groups = shapes = builder.param_shapes()
    if builder.stage == 3:  # the sub-groups of each param group, merged back in order
        _, _, group_of = builder.containers(0)
        merged: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
        for sub, g in zip(shapes, group_of, strict=False):
            merged.setdefault(g, []).extend(sub)
        groups = [merged[g] for g in sorted(merged)]
    module = []
    for name, tensor in builder.model0["module"].items():
        where = f"{root / files.model[0]} module.{name}"
        if file_tensor(tensor) is None:  # else a torch tensor: loaded with torch
            raise CorruptChunkError(f"{where}: not a tensor")
        offset = loaded.byte_offset(tensor, loaded.model[0], where)[0] if tensor.numel() else 0
        module.append(ModuleTensor(name, tensor.dtype, tuple(tensor.shape), files.model[0] if tensor.numel() else None, offset))
    zero = (builder.model0.get("ds_config") or {}).get("zero_optimization") or {}
    sub_group_size = zero.get("sub_group_size", 10**9) if isinstance(zero, dict) else 10**9
    paddings = builder.osd[0].get("param_alignment_paddings") if builder.stage in (1, 2) else None
    return ZeroSave(
        files=files,
        stage=builder.stage,
        groups=groups,
        paddings=paddings,
        sub_group_size=int(sub_group_size),
        model_states=builder.model0,
        optim_states=loaded.optim[0][0],
        module=tuple(module),
    )
