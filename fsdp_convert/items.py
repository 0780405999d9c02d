"""Transform stage, with its few reads: the output items of a checkpoint, ready to plan.

``transform.build_items`` is pure; a flattened optimizer state dict needs some small param group
values (the ``params`` lists, every field of each group) to build the items, so this reads them
first, from whatever source the index describes. A consolidation in the producer's layout of a
Lightning checkpoint also reads its ``meta.pt`` (``torch.load(weights_only=True)``), whose entries
Lightning's own loader merges at the top level.
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
from fsdp_convert.formats import Reader, open_reader
from fsdp_convert.formats.dcp import LIGHTNING_META_FILENAME
from fsdp_convert.formats.index import BytesEntry, CheckpointIndex, Url
from fsdp_convert.layout import Group, classify, detect_producer
from fsdp_convert.remote import read_bytes, size_of
from fsdp_convert.transform import OutputItem, TransformOptions, build_items, clean_fqn, needs_group_values
from fsdp_convert.writers.safetensors import safetensors_name

__all__ = ["prepare_items", "read_lightning_meta", "leave_out_model_keys"]


def _value_reader(index: CheckpointIndex, check_crc: bool) -> Reader:
    return open_reader(index.checkpoint_id, check_crc=check_crc, full_files=True)  # the index's own format


def prepare_items(
    index: CheckpointIndex,
    options: TransformOptions,
    groups: tuple[Group, ...],
    *,
    check_crc: bool = True,
    keep_layout: bool = False,
) -> tuple[OutputItem, ...]:
    """Classify the entries, read the small param group values the transform needs, build the items.

    Called on every rank that plans (each reads the same few values).

    Args:
        index: the checkpoint (any source: DCP, rank files, safetensors shards, a full file).
        options: the transforms.
        groups: which groups to produce (``plan.groups_for``).
        check_crc: check CRC-32s of the param group payloads read.
        keep_layout: keep the producer's nesting (``reshard``; see ``transform.build_items``).

    Raises:
        UnsupportedTransformError: a ``params`` list, or a field of a flattened optimizer state
            dict, stored as a tensor.
        As ``transform.build_items``, and the read errors of ``Reader.read_value``
        (MissingDataFileError, CorruptChunkError, UnsafeContentError).
    """
    slots = classify(index)
    wanted = needs_group_values(slots) if "optim" in groups else []
    tensor = next((index.entries[i] for i in wanted if not isinstance(index.entries[i], BytesEntry)), None)
    if tensor is not None:  # params lists, and a flattened state dict's fields, are regrouped by value
        raise UnsupportedTransformError(f"{tensor.fqn}: a tensor, where this tool reads a param group field as a plain value")
    values: dict[int, Any] = {}
    if wanted:
        with _value_reader(index, check_crc) as reader:
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
        params_in_model_order=detect_producer(index) in ("fsdp1", "fsdp"),
    )
    if keep_layout or options.layout != "producer" or "other" not in groups:
        return items
    return items + _lightning_meta_items(index, items)


def _meta_location(index: CheckpointIndex) -> Path | Url | None:
    """Where Lightning's ``meta.pt`` lies beside ``.metadata``, if it does (remote: one size request)."""
    root = index.checkpoint_id
    if isinstance(root, Url):
        return root / LIGHTNING_META_FILENAME if size_of(root / LIGHTNING_META_FILENAME) is not None else None
    return root / LIGHTNING_META_FILENAME if index.producer == "lightning" else None


def read_lightning_meta(index: CheckpointIndex) -> dict[str, Any] | None:
    """Lightning Fabric's ``meta.pt`` (the saved state that is neither module nor optimizer), or None.

    Loaded with ``torch.load(weights_only=True)``; its values must be plain (no tensor), as
    ``fabric.save`` writes a step counter or hyperparameters there.

    Raises:
        UnsafeContentError: it would run code when loaded.
        CorruptChunkError: it does not load, or is not a dict with string keys.
        UnsupportedTransformError: a value holds a tensor (use ``--layout nested``, which leaves it out).
    """
    where = _meta_location(index)
    if where is None:
        return None
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
                f"{where}: {key!r} holds a tensor, which this tool does not merge; use --layout nested to leave meta.pt out"
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


def _lightning_meta_items(index: CheckpointIndex, items: tuple[OutputItem, ...]) -> tuple[OutputItem, ...]:
    """``meta.pt``'s entries as top-level values, after the checkpoint's own, as Lightning merges them.

    Raises:
        InvalidOptionError: a ``meta.pt`` key is also a top-level key of the checkpoint.
        As ``read_lightning_meta``.
    """
    meta = read_lightning_meta(index)
    if not meta:
        return ()
    tops = {item.path[0] for item in items}
    clash = sorted(k for k in meta if k in tops)
    if clash:
        raise InvalidOptionError(
            f"{index.checkpoint_id}: {LIGHTNING_META_FILENAME} and the checkpoint both hold {clash[0]!r}; "
            "use --layout nested to leave meta.pt out"
        )
    return tuple(
        OutputItem(
            entry=BytesEntry(fqn=key, path=(key,), relative_path=LIGHTNING_META_FILENAME, offset_bytes=0, length_bytes=0),
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
