"""Transform stage, with its few reads: the output items of a checkpoint, ready to plan.

``transform.build_items`` is pure; a flattened optimizer state dict needs some small param group
values (the ``params`` lists, every field of each group) to build the items, so this reads them
first, from whatever source the index describes. A consolidation in the producer's layout also
reads the file whose entries the producer's own loader merges (``producers.Producer.merged``,
``torch.load(weights_only=True)``): Lightning's ``meta.pt`` at the top level, Megatron-Core's
``common.pt`` also into the checkpoint's own ``optimizer`` (its ``param_groups`` and step). A small
tensor in that file (Megatron's 0-dim step) is an item of its own, written as that tensor.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_convert.dtypes import ITEMSIZES, as_dtype, is_tensor
from fsdp_convert.errors import CorruptChunkError, InvalidOptionError, UnsafeContentError, UnsupportedTransformError
from fsdp_convert.formats.index import (
    BytesEntry,
    CheckpointIndex,
    ObjPath,
    Url,
    flatten_with_paths,
    holds,
)
from fsdp_convert.formats.reader import checked_value
from fsdp_convert.item import OutputItem
from fsdp_convert.location import read_inside
from fsdp_convert.producers import check_optimizer, classify, detect_producer, merged_files, optimizer_path
from fsdp_convert.remote import read_bytes, size_of
from fsdp_convert.roles import Group, dcp_key, group_of_top
from fsdp_convert.transform import TransformOptions, build_items, clean_fqn, needs_group_values
from fsdp_convert.writers.safetensors import safetensors_name

if TYPE_CHECKING:
    from fsdp_convert.formats.source import Reader, Source

__all__ = ["MERGED_TENSOR_MAX_BYTES", "prepare_items", "read_merged", "leave_out_model_keys"]

# a tensor in a merged file (common.pt's step, a meta.pt counter) is read into memory at items time
MERGED_TENSOR_MAX_BYTES = 1 << 20
MERGED_FILE_MAX_BYTES = 256 << 20  # the side file is loaded whole: plain values and small tensors


def prepare_items(
    source: Source,
    options: TransformOptions,
    groups: tuple[Group, ...],
    *,
    keep_layout: bool = False,
    reader: Reader | None = None,
) -> tuple[OutputItem, ...]:
    """Classify the entries, read the small param group values the transform needs, build the items.

    Called on every rank that plans (each reads the same few values). Every producer rule comes
    from the records of ``producers.PRODUCERS``: the detected producer's, and the key layouts of
    all (``producers.classify``, ``optimizer_path``, ``check_optimizer``).

    Args:
        source: the checkpoint (any source format: DCP, rank files, safetensors shards, a full
            file), its format decided once (``formats.open_checkpoint``): read with its reader
            and its ``check_crc``.
        options: the transforms.
        groups: which groups to produce (``outputs.OutputKind.groups``).
        keep_layout: keep the producer's nesting (``reshard``; see ``transform.build_items``).
        reader: an open reader of ``source`` to read the values with (left open); None: one is
            opened (``Source.open_reader``) and closed here.

    Raises:
        UnsupportedTransformError: a ``params`` list, or a field of a flattened optimizer state
            dict, stored as a tensor; optimizer state a producer cannot put per parameter
            (``producers.check_optimizer``).
        As ``transform.build_items`` and ``producers.detect_producer``, and the read errors of
        ``Reader.read_value`` (MissingDataFileError, CorruptChunkError, UnsafeContentError).
    """
    index = source.index
    producer = detect_producer(index)
    slots = classify(index)
    wanted = needs_group_values(slots) if "optim" in groups else []
    tensor = next((index.entries[i] for i in wanted if not isinstance(index.entries[i], BytesEntry)), None)
    if tensor is not None:  # params lists, and a flattened state dict's fields, are regrouped by value
        raise UnsupportedTransformError(f"{tensor.fqn}: a tensor, where this tool reads a param group field as a plain value")
    values: dict[int, Any] = {}
    if wanted and reader is not None:
        values = _group_values(reader, index, wanted)
    elif wanted:
        with source.open_reader() as opened:  # its format, decided once
            values = _group_values(opened, index, wanted)
    # OLMo-core's unshard_checkpoint keeps its flattened optimizer state dict (producers.Producer.flat_optimizer)
    keep_flat = producer.flat_optimizer and options.layout == "producer" and options.optim_keys == "names"
    items = build_items(
        index,
        slots,
        options,
        values,
        groups=groups,
        keep_layout=keep_layout or keep_flat,
        params_in_model_order=producer.params_in_model_order,
    )
    items = _placed_optimizer(items, keep_layout)
    if not keep_layout and "optim" in groups:
        check_optimizer(index)
    if keep_layout or options.layout != "producer" or "other" not in groups or options.adapter is not None:
        return items  # an adapter maps model weights only (transform.build_items)
    return items + _merged_items(index, items)


def _group_values(reader: Reader, index: CheckpointIndex, wanted: list[int]) -> dict[int, Any]:
    """The plain values of the entries ``wanted`` (param group fields), read with ``reader``."""
    values: dict[int, Any] = {}
    for i in wanted:
        entry = index.entries[i]
        assert isinstance(entry, BytesEntry)  # prepare_items checked it
        values[i] = reader.read_value(entry)
    return values


def _placed_optimizer(items: tuple[OutputItem, ...], keep_layout: bool) -> tuple[OutputItem, ...]:
    """Optimizer items read from a producer's own keys, placed as its loader has them (``producers.optimizer_path``)."""
    out = []
    for item in items:
        path = optimizer_path(item.entry.path, item.path, keep_layout) if item.group == "optim" else None
        out.append(item if path is None else dataclasses.replace(item, path=path))
    return tuple(out)


def _merged_location(index: CheckpointIndex) -> Path | Url | None:
    """Where the file the producer's loader merges lies beside ``.metadata``, if it does.

    Local: the detected producer's ``merged`` file (its detection checked it is there). Remote
    (the index names no producer): the first ``merged`` file of the table that exists, one size
    request each.
    """
    root = index.checkpoint_id
    if isinstance(root, Url):
        return next((root / name for name in merged_files() if size_of(root / name) is not None), None)
    merged = detect_producer(index).merged
    return None if merged is None else root / merged


def read_merged(index: CheckpointIndex) -> dict[str, Any] | None:
    """The file whose entries the producer's loader merges at the top level (Lightning's ``meta.pt``), or None.

    Loaded with ``torch.load(weights_only=True)``; its values are plain (a step counter,
    hyperparameters) or small tensors (Megatron's 0-dim step in ``common.pt``), each of those
    at most ``MERGED_TENSOR_MAX_BYTES``, dense, on the CPU, in a dict or list (not a tuple or set).

    Raises:
        UnsafeContentError: it would run code when loaded.
        CorruptChunkError: it does not load, or is not a dict with string keys.
        UnsupportedTransformError: a tensor larger than ``MERGED_TENSOR_MAX_BYTES``, of a layout or
            dtype this tool does not write, or inside a tuple or set (use ``--layout nested``, which
            leaves the file out).
    """
    where = _merged_location(index)
    return None if where is None else _load_merged(where, index.checkpoint_id)


def _load_merged(where: Path | Url, root: Path | Url) -> dict[str, Any]:
    """``read_merged``'s load and checks of the file at ``where``, in checkpoint ``root`` (same Raises)."""
    import torch

    try:
        if isinstance(where, Url):
            raw = read_bytes(where)
        elif (local := read_inside(Path(root), where, MERGED_FILE_MAX_BYTES)) is None:  # never by name: no link out
            raise CorruptChunkError(f"{where} is larger than {MERGED_FILE_MAX_BYTES} bytes; use --layout nested to leave it out")
        else:
            raw = local
        meta = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        detail = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln), None)
        if detail is not None:
            raise UnsafeContentError(f"{where}: would run code when loaded, refused ({detail})") from e
        raise CorruptChunkError(f"{where}: does not load as a torch.save file") from e
    except (OSError, RuntimeError, EOFError) as e:
        raise CorruptChunkError(f"{where}: does not load as a torch.save file ({e})") from e
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise CorruptChunkError(f"{where}: expected a dict with string keys (Lightning's meta.pt), got {type(meta).__name__}")
    checked_value(meta, str(where))  # the walks below and the writers recurse: a bounded depth, no value holding itself
    for key, value in meta.items():
        why = _unmergeable(value)
        if why is not None:
            raise UnsupportedTransformError(
                f"{where}: {key!r} holds {why}, which this tool does not merge; use --layout nested to leave {where.name} out"
            )
    return meta


def _unmergeable(value: Any) -> str | None:
    """Why ``value`` cannot be written as the output's items (its tensors each an item of their own), or None.

    A loop over each container once (a pickle may share one list under many: ``x = [x, x]``).
    """
    seen: set[int] = set()
    pending = [value]
    while pending:
        node = pending.pop()
        if is_tensor(node):
            import torch

            nbytes = node.numel() * node.element_size()
            if node.layout != torch.strided or node.is_quantized or as_dtype(node.dtype).name not in ITEMSIZES:
                return f"a {node.dtype} {node.layout} tensor"
            if nbytes > MERGED_TENSOR_MAX_BYTES:
                return f"a tensor of {nbytes} bytes (at most {MERGED_TENSOR_MAX_BYTES})"
        elif id(node) in seen:
            continue
        elif isinstance(node, (dict, list)):
            seen.add(id(node))
            pending += reversed(node.values() if isinstance(node, dict) else node)
        elif isinstance(node, (tuple, set, frozenset)) and _holds_tensor(node):
            return f"a tensor inside a {type(node).__name__}"
    return None


def _holds_tensor(value: Any) -> bool:
    return holds(value, is_tensor)


def _own_tensor(value: Any) -> Any:
    """A merged tensor as its own dense, contiguous copy (what torch.save of it stores); any other value as it is."""
    if not is_tensor(value):
        return value
    return value.detach().resolve_conj().resolve_neg().contiguous().clone()


def _merged_items(index: CheckpointIndex, items: tuple[OutputItem, ...]) -> tuple[OutputItem, ...]:
    """The merged file's entries, after the checkpoint's own.

    Top-level values, as Lightning merges ``meta.pt``'s; a dict under a key the checkpoint's items
    also nest under is merged into theirs, as Megatron's ``dist_checkpointing.load`` merges
    ``common.pt``'s ``optimizer`` (``param_groups``, ``state.common_step``), its values flattened
    as the output is read back (``param_groups.0.lr``). A tensor is an item of its own (a top-level
    value holding some is flattened as DCP flattens it), its value a dense copy that every output
    kind writes as a tensor (``outputs.kind.value_tensor``): ``common_step`` stays ``tensor(3.)``.

    Raises:
        InvalidOptionError: a value of the merged file is also one of the checkpoint's, or holds
            some of the checkpoint's values without being a dict.
        UnsupportedTransformError: a key of a merged dict is neither a string nor an integer.
        As ``read_merged``.
    """
    where = _merged_location(index)
    meta = None if where is None else _load_merged(where, index.checkpoint_id)
    if not meta or where is None:
        return ()
    paths = {item.path for item in items}
    inner = {path[:k] for path in paths for k in range(1, len(path))}  # the dicts the checkpoint's items make
    leaves: list[tuple[ObjPath, Any]] = []
    pending: list[tuple[ObjPath, dict[str, Any]]] = [((), meta)]
    while pending:
        prefix, tree = pending.pop(0)
        for key, value in tree.items():
            path = (*prefix, key)
            if path in inner and isinstance(value, dict):
                pending.append((path, value))  # merged into the checkpoint's own dict (Megatron's optimizer)
            elif path in inner or path in paths:
                held = key if not prefix else ".".join(map(str, path))
                raise InvalidOptionError(
                    f"{index.checkpoint_id}: {where.name} and the checkpoint both hold {held!r}; "
                    f"use --layout nested to leave {where.name} out"
                )
            elif prefix:  # inside the checkpoint's dicts: flattened as the output reads back (param_groups.0.lr)
                try:
                    leaves += [((*prefix, *p), v) for p, v in flatten_with_paths({key: value}).values()]
                except ValueError as e:  # a key neither a string nor an integer
                    raise UnsupportedTransformError(f"{where}: {e}; use --layout nested to leave {where.name} out") from e
            elif _holds_tensor(value):  # its tensors are items of their own, as DCP flattens them
                try:
                    leaves += [((*path, *p[1:]), v) for p, v in flatten_with_paths({key: value}).values()]
                except ValueError as e:  # shared into too many paths (x = [x, x]), or a key of another type
                    raise UnsupportedTransformError(f"{where}: {e}; use --layout nested to leave {where.name} out") from e
            else:
                leaves.append((path, value))
    return tuple(
        OutputItem(
            entry=BytesEntry(fqn=dcp_key(path), path=path, relative_path=where.name, offset_bytes=0, length_bytes=0),
            path=path,
            group="optim" if group_of_top(path[0]) == "optim" else "other",
            constant=True,
            value=_own_tensor(value),  # a tensor: written as one (outputs.kind.value_tensor)
        )
        for path, value in leaves
    )


def leave_out_model_keys(
    index: CheckpointIndex, items: tuple[OutputItem, ...], options: TransformOptions, keys: Collection[str]
) -> tuple[tuple[OutputItem, ...], TransformOptions]:
    """Drop the model items written under ``keys`` (output names, after renames), as ``--exclude`` would.

    Used for the tied output embedding of ``consolidate --hf-assets``: the returned options exclude
    the same checkpoint FQNs (wrapper names removed, before renames; glob characters escaped), so
    ``--verify`` reads the checkpoint through them and expects the same keys.

    Returns:
        The remaining items, and ``options`` with the extra ``exclude`` patterns.
    """
    if not keys:
        return items, options
    slots = classify(index)
    fqns = {id(entry): slot.param for entry, slot in zip(index.entries, slots, strict=True) if slot.role == "model"}
    patterns = []
    for item in items:
        param = fqns.get(id(item.entry))
        if item.group == "model" and safetensors_name(item.path) in keys and isinstance(param, str):
            fqn = clean_fqn(param, keep_wrapper_names=options.keep_wrapper_names)
            patterns.append(re.sub(r"([*?[])", r"[\1]", fqn))
    kept = tuple(item for item in items if not (item.group == "model" and safetensors_name(item.path) in keys))
    return kept, dataclasses.replace(options, exclude=options.exclude + tuple(patterns))
