"""Transform stage, with its few reads: the output items of a checkpoint, ready to plan.

``transform.build_items`` is pure; a flattened optimizer state dict needs some small param group
values (the ``params`` lists, every field of each group) to build the items, so this reads them
first, from whatever source the index describes.
"""

from __future__ import annotations

from typing import Any

from fsdp_convert.formats import Reader, open_reader
from fsdp_convert.formats.index import BytesEntry, CheckpointIndex
from fsdp_convert.layout import Group, classify, detect_producer
from fsdp_convert.transform import OutputItem, TransformOptions, build_items, needs_group_values

__all__ = ["prepare_items"]


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
        As ``transform.build_items``, and the read errors of ``Reader.read_value``
        (MissingDataFileError, CorruptChunkError, UnsafeContentError).
    """
    slots = classify(index)
    wanted = needs_group_values(slots) if "optim" in groups else []
    values: dict[int, Any] = {}
    if wanted:
        with _value_reader(index, check_crc) as reader:
            for i in wanted:
                entry = index.entries[i]
                assert isinstance(entry, BytesEntry)
                values[i] = reader.read_value(entry)
    return build_items(
        index,
        slots,
        options,
        values,
        groups=groups,
        keep_layout=keep_layout,
        params_in_model_order=detect_producer(index) in ("fsdp1", "fsdp"),
    )
