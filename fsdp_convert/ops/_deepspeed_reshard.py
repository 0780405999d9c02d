"""``reshard`` of a DeepSpeed ZeRO save to another data-parallel size, as a DeepSpeed save its own loader reads.

DeepSpeed's ``engine.load_checkpoint`` refuses a save of another data-parallel size ("Automatic
adjustment of ZeRO's optimizer state partitioning with a new world size is not currently
supported"). Here the save is written again as an engine of the same stage and dtype at ``M``
ranks would have saved it (``plan/deepspeed.py``: partitions, paddings, slice mappings,
ZeRO-3's sub-groups): ``latest`` and the tag folder; the model states file(s) (ZeRO-1/2: the
same module; ZeRO-3: one per rank with its share of the frozen parameters) with
``dp_world_size`` set to ``M``; one optimizer states file per rank whose fp32 partitions and
optimizer state are the parameters' flat ranges, copied byte for byte from the source's
(``writers.copied_torch_save``), and whose other fields are the source's rank 0's. DeepSpeed's
classes are written as references to them (``writers._torch_pickle.Reduced``), never imported.
"""

from __future__ import annotations

import bisect
import functools
import math
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_convert.errors import CorruptChunkError, InvalidOptionError, UnsupportedTransformError
from fsdp_convert.formats.deepspeed_files import LATEST
from fsdp_convert.formats.index import BytesEntry, CheckpointIndex, DictKey, ObjPath, TensorEntry, unflatten
from fsdp_convert.formats.source import Reader, Source
from fsdp_convert.held_roots import open_inside
from fsdp_convert.ops.options import ReshardOptions
from fsdp_convert.transform import TransformOptions
from fsdp_convert.writers.copied_torch_save import ByteCopy, CopiedTensor, write_copied_files
from fsdp_convert.writers.torch_save import STORAGE_ALIGNMENT, Reduced, TensorSlot, dumps_with_storages

if TYPE_CHECKING:  # imported where a save is written: deciding whether one is (writes_zero) imports no torch
    from fsdp_convert.formats.deepspeed import ZeroSave
    from fsdp_convert.plan.deepspeed import ZeroLayout

__all__ = ["reshard_zero", "writes_zero", "zero_files"]

_ZIP_BYTES_PER_RECORD = 256  # a zip record's local header, data descriptor and central entry (zip64), at most

_Flat = list[tuple[int, int, str, int]]  # a tensor's stored flat ranges: [lo, hi) elements, file, byte offset of lo


def _flat(entry: TensorEntry) -> _Flat:
    """Where each flat range of ``entry``'s elements lies (its chunks, each contiguous in row-major order).

    Raises:
        CorruptChunkError: a chunk that is not one contiguous range of the tensor.
    """
    shape, out = entry.shape, []
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    for chunk in entry.chunks:
        if chunk.numel == 0 or chunk.relative_path is None:
            continue
        lead = next((d for d, n in enumerate(chunk.sizes) if n > 1), len(shape))
        if any(chunk.sizes[d] != shape[d] for d in range(lead + 1, len(shape))):
            raise CorruptChunkError(f"{entry.fqn}: a chunk that is not a contiguous range of the tensor")
        lo = sum(o * s for o, s in zip(chunk.offsets, strides, strict=True))
        out.append((lo, lo + chunk.numel, chunk.relative_path, chunk.offset_bytes))
    return sorted(out)


def _copies(stored: _Flat, lo: int, hi: int, itemsize: int, dst: int) -> list[ByteCopy]:
    """The byte copies that put elements ``[lo, hi)`` of a tensor stored as ``stored`` at byte ``dst`` of a storage.

    ``stored`` is sorted and its ranges do not overlap (``_flat``): only those that meet ``[lo, hi)`` are visited.

    Raises:
        CorruptChunkError: some element of ``[lo, hi)`` is stored nowhere.
    """
    out = []
    i = max(bisect.bisect_right(stored, (lo, math.inf)) - 1, 0)
    while i < len(stored) and stored[i][0] < hi:
        s_lo, s_hi, file, at = stored[i]
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a < b:
            out.append(ByteCopy(file, at + (a - s_lo) * itemsize, (b - a) * itemsize, dst + (a - lo) * itemsize))
        i += 1
    if sum(c.nbytes for c in out) != (hi - lo) * itemsize:
        raise CorruptChunkError(f"elements [{lo}, {hi}) are not all stored")
    return out


_SCALARS = (type(None), bool, int, float, str, bytes)


def _plain(value: Any, where: str = "a value") -> Any:
    """A loaded value with DeepSpeed's inert records (``_rank_unpickler.Record``) made ``Reduced`` stand-ins again.

    Only plain data (``None``, numbers, strings, bytes, and dicts, lists and tuples of them),
    tensors, ``torch.Size``/``torch.dtype`` and record instances are written back: a class, a
    function or anything else the source's pickle named would be pickled by this tool's own names.

    Raises:
        UnsupportedTransformError: another object, naming its type and where it sits.
    """
    import torch

    if type(value) in _SCALARS or isinstance(value, (torch.Tensor, torch.Size, torch.dtype)):
        return value
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _plain(v, where)) for k, v in value.items())
    if type(value) is list:
        return [_plain(v, where) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v, where) for v in value)
    qualname = getattr(type(value), "qualname", None)
    if isinstance(qualname, str) and not isinstance(value, type) and hasattr(value, "args"):  # a record instance
        module, name = qualname.rsplit(".", 1)
        args = tuple(_plain(a, where) for a in value.args)
        return Reduced(module, name, args, _plain(value.state, where), newobj=value.newobj)
    raise UnsupportedTransformError(
        f"{where}: holds a {type(value).__name__} ({qualname or type(value).__qualname__}), not plain data; "
        "a DeepSpeed save for another world size writes only data, records and tensors back"
    )


def _state_fqn(key: str, name: str) -> str:
    return f"optim.state.{name}.{key}"


def _fragment(numel: int, start: int) -> Reduced:
    """``deepspeed.utils.tensor_fragment.fragment_address(numel, start)``, as a dataclass pickles."""
    return Reduced("deepspeed.utils.tensor_fragment", "fragment_address", (), {"numel": numel, "start": start}, newobj=True)


class _Target:
    """The target save's files for ``layout``, built from the source's index (tensors) and ``save`` (the rest)."""

    def __init__(self, save: ZeroSave, layout: ZeroLayout, index: CheckpointIndex, reader: Reader) -> None:
        self.save, self.layout, self.reader = save, layout, reader
        self.entries = {e.fqn: e for e in index.entries}
        self._stored: dict[str, _Flat] = {}  # fqn -> its flat ranges (_flat), each worked out once
        # (name, rank, flat tensor) -> (first element there, the parameter's range [lo, hi)): each piece placed once
        self.slots: dict[tuple[str, int, int], list[tuple[int, int, int]]] = {}
        for name, pieces in layout.pieces().items():
            for rank, container, local, lo, hi in pieces:
                self.slots.setdefault((name, rank, container), []).append((local, lo, hi))

    def tensor(self, fqn: str) -> TensorEntry:
        entry = self.entries.get(fqn)
        if not isinstance(entry, TensorEntry):
            raise UnsupportedTransformError(
                f"{fqn}: not in the DeepSpeed save's index; it cannot be written for another world size"
            )
        return entry

    def stored(self, entry: TensorEntry) -> _Flat:
        """``_flat(entry)``, worked out once per tensor (every rank's partitions read from it)."""
        found = self._stored.get(entry.fqn)
        if found is None:
            found = self._stored[entry.fqn] = _flat(entry)
        return found

    def flat(self, rank: int, container: int, numel: int, fqn_of: Callable[[str], str]) -> CopiedTensor:
        """Rank ``rank``'s flat tensor ``container`` (``numel`` elements) of the entries ``fqn_of(name)``."""
        copies: list[ByteCopy] = []
        dtype = None
        for name, _ in self.layout.groups[container]:
            entry = self.tensor(fqn_of(name))
            dtype = entry.dtype.torch
            for local, lo, hi in self.slots.get((name, rank, container), ()):
                copies += _copies(self.stored(entry), lo, hi, entry.itemsize, local * entry.itemsize)
        assert dtype is not None
        return CopiedTensor(TensorSlot(dtype, (numel,)), tuple(sorted(copies, key=lambda c: c.dst_offset)))

    def optim_file(self, rank: int) -> list[tuple[ObjPath, Any]]:
        """Rank ``rank``'s optimizer states file: the source rank 0's, its per-rank fields for ``rank`` of ``M``."""
        layout, src = self.layout, self.save.optim_states
        osd = dict(src["optimizer_state_dict"])
        base_key = "optimizer_state_dict" if layout.stage == 3 else "base_optimizer_state"
        base = osd[base_key]
        state: dict[int, dict[str, Any]] = {}
        items: list[tuple[ObjPath, Any]] = []
        for c, group in enumerate(layout.groups):
            first = group[0][0]
            state[c] = {}
            for key in base["state"].get(0, {}):
                fqn = f"optim.state.{first}.{key}"
                entry = self.entries.get(fqn)
                if isinstance(entry, TensorEntry) and entry.shape:
                    state[c][key] = self.flat(rank, c, layout.partition[c], functools.partial(_state_fqn, key))
                elif isinstance(entry, TensorEntry):  # a 0-dim step: read, written with the headers
                    state[c][key] = self.reader.read_tensor(entry)
                elif isinstance(entry, BytesEntry):
                    state[c][key] = self.reader.read_value(entry)
        fp32 = [self.flat(rank, c, layout.saved[rank][c], lambda n: f"model.{n}") for c in range(len(layout.groups))]
        groups = []
        for g, group in enumerate(base["param_groups"]):
            groups.append({**group, "params": [c for c, of in enumerate(layout.group_of) if of == g]})
        where = str(self.save.files.optim[0])
        new_base = {"state": state, "param_groups": _plain(groups, where)}
        fields: dict[str, Any] = {}
        for key, value in osd.items():
            if key == base_key:
                fields[key] = new_base
            elif key in ("single_partition_of_fp32_groups", "fp32_flat_groups"):
                fields[key] = fp32
            elif key == "partition_count":
                fields[key] = layout.world_size if layout.stage == 3 else [layout.world_size] * len(layout.groups)
            elif key == "group_paddings":
                fields[key] = list(layout.group_paddings[rank])
            elif key == "param_slice_mappings":
                fields[key] = [
                    OrderedDict((n, _fragment(*m)) for n, m in mapping.items()) for mapping in layout.slice_mappings[rank]
                ]
            else:
                fields[key] = _plain(value, f"{where} optimizer_state_dict.{key}")
        top = {k: (fields if k == "optimizer_state_dict" else _plain(v, f"{where} {k}")) for k, v in src.items()}
        _flatten(top, (), items)
        return items


def _flatten(value: Any, path: ObjPath, out: list[tuple[ObjPath, Any]]) -> None:
    """(path, leaf) pairs of a nested dict whose ``CopiedTensor`` and tensor leaves become items, the rest values."""
    if isinstance(value, dict) and type(value) is dict and value and any(_holds_tensor(v) for v in value.values()):
        for k, v in value.items():
            _flatten(v, (*path, DictKey(k) if type(k) is int else k), out)
    elif isinstance(value, list) and any(_holds_tensor(v) for v in value):
        for i, v in enumerate(value):
            _flatten(v, (*path, i), out)
    else:
        out.append((path, value))


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, CopiedTensor) or hasattr(value, "untyped_storage"):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_tensor(v) for v in value)
    return False


def writes_zero(opts: ReshardOptions, producer: str) -> bool:
    """Whether ``reshard`` writes a DeepSpeed save (``--format auto`` of a DeepSpeed source, or ``deepspeed``).

    Raises:
        InvalidOptionError: ``--format deepspeed`` of another source; or, for a DeepSpeed output, a
            transform, ``--compress``, ``--resume`` or several nodes, which it does not take (each named).
    """
    if opts.output_format == "dcp" or (opts.output_format == "auto" and producer != "deepspeed"):
        return False
    if producer != "deepspeed":
        raise InvalidOptionError(
            f"--format deepspeed: the source is a {producer} checkpoint; only a DeepSpeed save is written as one"
        )
    refused = [
        ("a key or dtype transform (--rename, --include, --dtype, --adapter...)", opts.transform != TransformOptions()),
        ("--compress", opts.compress is not None),
        ("--resume", opts.resume),
        ("several nodes", opts.cluster is not None and opts.cluster.nnodes > 1),
    ]
    for what, given in refused:
        if given:
            raise InvalidOptionError(
                f"{what}: a DeepSpeed save for another world size keeps the source's names, dtypes and files as they are; "
                "use --format dcp for a DCP checkpoint (FSDP2) that takes it"
            )
    return True


def _target_files(source: Source, world_size: int) -> tuple[str, list[tuple[str, list[tuple[ObjPath, Any]]]]]:
    """The target save's tag folder (``"<tag>/"``) and its files: (name under OUT, items), none written."""
    from fsdp_convert.formats.deepspeed import zero_save
    from fsdp_convert.plan.deepspeed import zero_layout

    root = source.index.checkpoint_id
    assert isinstance(root, Path)  # deepspeed_index reads local folders only
    save = zero_save(root)
    layout = zero_layout(save.stage, world_size, save.groups, save.paddings, save.sub_group_size)
    tag = save.files.tag or f"{root.name}/"
    prefix = "bf16_" if save.files.bf16 else ""
    with source.open_reader() as reader:
        target = _Target(save, layout, source.index, reader)
        files = [(tag + name, items) for name, items in _model_files(target, save, layout)]
        for rank in range(world_size):
            files.append((f"{tag}{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", target.optim_file(rank)))
    return tag, files


def zero_files(source: Source, world_size: int) -> list[tuple[str, int]]:
    """What ``reshard_zero`` would write: each file's name under OUT and size in bytes (an upper bound), ``latest`` last.

    Raises:
        As ``reshard_zero`` before it writes.
    """
    tag, files = _target_files(source, world_size)
    out = []
    for name, items in files:
        tensors = sum(v.slot.nbytes + STORAGE_ALIGNMENT for _, v in items if isinstance(v, CopiedTensor))
        small = sum(v.numel() * v.element_size() + STORAGE_ALIGNMENT for _, v in items if hasattr(v, "untyped_storage"))
        plain = [(p, None if isinstance(v, CopiedTensor) or hasattr(v, "untyped_storage") else v) for p, v in items]
        out.append(
            (name, tensors + small + len(dumps_with_storages(unflatten(plain), 0)[0]) + _ZIP_BYTES_PER_RECORD * (len(items) + 8))
        )
    return [*out, (LATEST, len(tag) - 1)]


def reshard_zero(source: Source, tmp: Path, world_size: int, workers: int) -> tuple[int, int]:
    """Write ``source`` (a DeepSpeed save) into the empty folder ``tmp`` as a save for ``world_size`` ranks.

    Returns:
        Tensors written (each its own storage), and the files' bytes.

    Raises:
        CorruptChunkError, UnsupportedTransformError: the source's index and files disagree.
        OSError: a write failed.
    """
    root = source.index.checkpoint_id
    assert isinstance(root, Path)
    tag, files = _target_files(source, world_size)
    (tmp / tag).mkdir()
    fds: dict[str, int] = {}

    def source_fd(name: str) -> int:
        if name not in fds:
            fds[name] = open_inside(root, root / name)
        return fds[name]

    opened = [(os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), items) for name, items in files]
    try:
        total = write_copied_files(opened, source_fd, workers)
    finally:
        for fd, _ in opened:
            os.close(fd)
        for fd in fds.values():
            os.close(fd)
    (tmp / LATEST).write_text(tag.rstrip("/"))  # as engine.save_checkpoint writes it: the tag, no newline
    tensors = sum(isinstance(v, CopiedTensor) for _, items in files for _, v in items)
    return tensors, total + len(tag) - 1


def _model_files(target: _Target, save: ZeroSave, layout: ZeroLayout) -> list[tuple[str, list[tuple[ObjPath, Any]]]]:
    """The model states file (ZeRO-1/2) or files (ZeRO-3, one per rank) for ``layout``."""
    import torch

    module: dict[str, Any] = {}
    for m in save.module:
        if m.file is None:
            module[m.name] = torch.empty(m.shape, dtype=m.dtype)
        else:
            nbytes = math.prod(m.shape) * m.dtype.itemsize
            module[m.name] = CopiedTensor(TensorSlot(m.dtype, m.shape), (ByteCopy(m.file, m.offset, nbytes, 0),))
    rest = {k: _plain(v, f"{save.files.model[0]} {k}") for k, v in save.model_states.items() if k != "module"}
    rest["dp_world_size"] = layout.world_size
    if layout.stage != 3:
        items: list[tuple[ObjPath, Any]] = [(("module", n), v) for n, v in module.items()]
        items += [((k,), v) for k, v in rest.items()]
        return [("mp_rank_00_model_states.pt", items)]
    rest["param_shapes"] = [OrderedDict((n, torch.Size(s)) for n, s in group) for group in layout.groups]
    frozen = save.model_states.get("frozen_param_shapes") or {}
    out = []
    for rank in range(layout.world_size):
        fragments = {}
        for name, shape in frozen.items():
            entry = target.tensor(f"model.{name}")
            numel = math.prod(shape)
            part = -(-numel // layout.world_size)
            lo, hi = min(rank * part, numel), min((rank + 1) * part, numel)
            fragments[name] = CopiedTensor(
                TensorSlot(entry.dtype.torch, (part,)), tuple(_copies(target.stored(entry), lo, hi, entry.itemsize, 0))
            )
        items = [(("module", n), v) for n, v in module.items()]
        items += [((k,), v) for k, v in rest.items() if k != "frozen_param_fragments"]
        if frozen:
            items += [(("frozen_param_fragments", n), v) for n, v in fragments.items()]
        out.append((f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", items))
    return out
