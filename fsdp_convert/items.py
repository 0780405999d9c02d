"""Transform stage, with its few reads: the output items of a checkpoint, ready to plan.

``transform.build_items`` is pure; a flattened optimizer state dict needs some small param group
values (the ``params`` lists, every field of each group) to build the items, so this reads them
first, from whatever source the index describes. A consolidation in the producer's layout also
reads the file whose entries the producer's own loader merges at the top level
(``producers.Producer.merged``: Lightning's ``meta.pt``, ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from fsdp_convert.errors import CorruptChunkError, InvalidOptionError, UnsafeContentError, UnsupportedTransformError
from fsdp_convert.formats import Reader, Source, open_reader
from fsdp_convert.formats.index import BytesEntry, CheckpointIndex, Url
from fsdp_convert.producers import detect_producer, merged_files
from fsdp_convert.remote import read_bytes, size_of
from fsdp_convert.roles import Group, classify
from fsdp_convert.transform import OutputItem, TransformOptions, build_items, clean_fqn, needs_group_values
from fsdp_convert.writers.safetensors import safetensors_name

__all__ = ["prepare_items", "read_merged", "leave_out_model_keys"]


def _value_reader(source: CheckpointIndex | Source, check_crc: bool) -> Reader:
    if isinstance(source, Source):
        return source.open_reader()  # its format, decided once
    return open_reader(source.checkpoint_id, check_crc=check_crc, full_files=True)  # the index's own format


def prepare_items(
    source: CheckpointIndex | Source,
    options: TransformOptions,
    groups: tuple[Group, ...],
    *,
    check_crc: bool = True,
    keep_layout: bool = False,
) -> tuple[OutputItem, ...]:
    """Classify the entries, read the small param group values the transform needs, build the items.

    Called on every rank that plans (each reads the same few values).

    Args:
        source: the checkpoint (any source format: DCP, rank files, safetensors shards, a full
            file), as its ``Source`` (read with its reader and its ``check_crc``) or its index.
        options: the transforms.
        groups: which groups to produce (``outputs.OutputKind.groups``).
        check_crc: check CRC-32s of the param group payloads read (an index only).
        keep_layout: keep the producer's nesting (``reshard``; see ``transform.build_items``).

    Raises:
        UnsupportedTransformError: a ``params`` list, or a field of a flattened optimizer state
            dict, stored as a tensor.
        As ``transform.build_items``, and the read errors of ``Reader.read_value``
        (MissingDataFileError, CorruptChunkError, UnsafeContentError).
    """
    index = source.index if isinstance(source, Source) else source
    slots = classify(index)
    wanted = needs_group_values(slots) if "optim" in groups else []
    tensor = next((index.entries[i] for i in wanted if not isinstance(index.entries[i], BytesEntry)), None)
    if tensor is not None:  # params lists, and a flattened state dict's fields, are regrouped by value
        raise UnsupportedTransformError(f"{tensor.fqn}: a tensor, where this tool reads a param group field as a plain value")
    values: dict[int, Any] = {}
    if wanted:
        with _value_reader(source, check_crc) as reader:
            for i in wanted:
                entry = index.entries[i]
                assert isinstance(entry, BytesEntry)  # checked above
                values[i] = reader.read_value(entry)
    items = build_items(
        index,
        slots,
        options,
        values,
        groups=groups,
        keep_layout=keep_layout,
        params_in_model_order=detect_producer(index).params_in_model_order,
    )
    if keep_layout or options.layout != "producer" or "other" not in groups:
        return items
    return items + _merged_items(index, items)


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

    Loaded with ``torch.load(weights_only=True)``; its values must be plain (no tensor), as
    ``fabric.save`` writes a step counter or hyperparameters in Lightning's ``meta.pt``.

    Raises:
        UnsafeContentError: it would run code when loaded.
        CorruptChunkError: it does not load, or is not a dict with string keys.
        UnsupportedTransformError: a value holds a tensor (use ``--layout nested``, which leaves it out).
    """
    where = _merged_location(index)
    return None if where is None else _load_merged(where)


def _load_merged(where: Path | Url) -> dict[str, Any]:
    """``read_merged``'s load and checks of the file at ``where`` (same Raises)."""
    try:
        raw = read_bytes(where) if isinstance(where, Url) else where.read_bytes()
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
    for key, value in meta.items():
        if _holds_tensor(value):
            raise UnsupportedTransformError(
                f"{where}: {key!r} holds a tensor, which this tool does not merge; use --layout nested to leave {where.name} out"
            )
    return meta


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v) for v in value)
    return False


def _merged_items(index: CheckpointIndex, items: tuple[OutputItem, ...]) -> tuple[OutputItem, ...]:
    """The merged file's entries as top-level values, after the checkpoint's own, as Lightning merges ``meta.pt``'s.

    Raises:
        InvalidOptionError: a key of the merged file is also a top-level key of the checkpoint.
        As ``read_merged``.
    """
    where = _merged_location(index)
    meta = None if where is None else _load_merged(where)
    if not meta or where is None:
        return ()
    tops = {item.path[0] for item in items}
    clash = sorted(k for k in meta if k in tops)
    if clash:
        raise InvalidOptionError(
            f"{index.checkpoint_id}: {where.name} and the checkpoint both hold {clash[0]!r}; "
            f"use --layout nested to leave {where.name} out"
        )
    return tuple(
        OutputItem(
            entry=BytesEntry(fqn=key, path=(key,), relative_path=where.name, offset_bytes=0, length_bytes=0),
            path=(key,),
            group="other",
            constant=True,
            value=value,
        )
        for key, value in meta.items()
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
