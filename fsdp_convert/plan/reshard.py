"""Plan stage for ``reshard``: every item's chunks per target rank; pure functions, no I/O.

Tensors are split on dim 0 in ``torch.chunk`` order, the layout FSDP2's ``Shard(0)`` and FSDP1
load; what stays whole (0-dim, empty, replicated tensors, values) goes to rank 0. A source whose
data lie in several DCP folders (accelerate's ``pytorch_model_fsdp_0/`` and ``optimizer_0/``) is
planned folder by folder (``split_by_folder``), so the output has the same folders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import PurePosixPath

from fsdp_convert.errors import InvalidOptionError, NotADcpCheckpointError
from fsdp_convert.formats.index import CheckpointIndex, Entry, TensorEntry, check_coverage, unflatten
from fsdp_convert.item import OutputItem
from fsdp_convert.output_table import METADATA_FILENAME
from fsdp_convert.writers.torch_save import PayloadPlacement, TensorSlot, tensor_payload_placement

__all__ = [
    "TargetChunk",
    "PayloadPlan",
    "ReshardPlan",
    "dim0_boxes",
    "plan_reshard",
    "split_by_folder",
    "rank_file_bytes",
    "wave_plan",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetChunk:
    """One chunk of the reshard output: the box of an item that one target rank stores.

    Attributes:
        rank: the target rank whose data file holds it.
        offsets: per-dimension start of the chunk in the global tensor, in elements (``()`` for
            a bytes entry or a 0-dim tensor).
        sizes: per-dimension extent of the chunk, in elements (``()`` likewise).
    """

    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadPlan:
    """One tensor chunk's torch.save payload in its target rank's data file, laid out ahead.

    Attributes:
        item: index into ``ReshardPlan.items``.
        chunk: the target chunk (its rank names the data file).
        offset: where the payload starts in the data file, in bytes.
        placement: the payload's size and where its storage bytes lie in it.
        owner: the worker that moves its bytes and writes its headers.
    """

    item: int
    chunk: TargetChunk
    offset: int
    placement: PayloadPlacement
    owner: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshardPlan:
    """Target placement of a reshard: every item's chunks per target rank, each tensor chunk's byte range, and its worker.

    Each rank's data file holds its tensor chunks' payloads back to back, in item order; rank 0's
    then holds the values (bytes entries), which rank 0 appends from ``values_offset``.

    Attributes:
        items: the output items (``transform.build_items``), in output order.
        chunks: per item, its ``TargetChunk`` s; a value gets one on rank 0 with empty offsets
            and sizes (rank 0 carries them).
        payloads: every tensor chunk's payload, rank by rank.
        values_offset: where the values start in rank 0's data file, in bytes.
        target_world_size: ranks of the output.
        nproc: workers (tensor chunks are balanced over them by bytes).
    """

    items: tuple[OutputItem, ...]
    chunks: tuple[tuple[TargetChunk, ...], ...]
    payloads: tuple[PayloadPlan, ...]
    values_offset: int
    target_world_size: int
    nproc: int

    @property
    def data_ranks(self) -> tuple[int, ...]:
        """The target ranks that get a data file (those holding a chunk or, for rank 0, a value)."""
        ranks = {p.chunk.rank for p in self.payloads}
        if any(not item.is_tensor for item in self.items):
            ranks.add(0)
        return tuple(sorted(ranks))


def dim0_boxes(shape: tuple[int, ...], world_size: int) -> list[TargetChunk]:
    """``torch.chunk(world_size)`` on dim 0, as FSDP2's ``Shard(0)`` and FSDP1 lay tensors out.

    Chunks are ``ceil(shape[0] / world_size)`` rows; ranks past the last non-empty chunk get none.
    Returns one ``TargetChunk`` per non-empty chunk, in rank order.
    """
    rows = shape[0]
    step = -(-rows // world_size)
    chunks = []
    for rank in range(world_size):
        start = rank * step
        if start >= rows:
            break
        offsets = (start, *(0,) * (len(shape) - 1))
        chunks.append(TargetChunk(rank=rank, offsets=offsets, sizes=(min(step, rows - start), *shape[1:])))
    return chunks


def _folder(entry: Entry, folders: tuple[str, ...]) -> str | None:
    """The DCP folder (one of ``folders``) of the data file holding ``entry``'s payloads; ``""``: the checkpoint's own.

    A data file in another subfolder (a DeepSpeed save's tag folder) belongs to the checkpoint itself.
    """
    if isinstance(entry, TensorEntry):
        path = next((c.relative_path for c in entry.chunks if c.relative_path is not None), None)
    else:
        path = entry.relative_path
    if path is None:
        return None
    parent = PurePosixPath(path).parent.as_posix()
    return parent if parent in folders else ""


def split_by_folder(items: tuple[OutputItem, ...], folders: tuple[str, ...]) -> tuple[tuple[str, tuple[OutputItem, ...]], ...]:
    """The items by the DCP folder (``CheckpointIndex.folders``) their source data lie in, in order of first appearance.

    A DCP folder gives one group, ``""``. accelerate's checkpoint folder, read as one index whose
    data file names carry their folder (``pytorch_model_fsdp_0/__0_0.distcp``), gives one group
    per DCP folder, so that each is written as its own DCP folder. An item with no payload
    anywhere (a tensor of no elements that DCP stored without data) joins the first group.
    """
    groups: dict[str, list[OutputItem]] = {}
    homeless = []
    for item in items:
        folder = _folder(item.entry, folders)
        if folder is None:
            homeless.append(item)
        else:
            groups.setdefault(folder, []).append(item)
    if not groups:
        return (("", tuple(homeless)),)
    first = next(iter(groups))
    groups[first] = homeless + groups[first]
    return tuple((folder, tuple(part)) for folder, part in groups.items())


def plan_reshard(
    index: CheckpointIndex, items: tuple[OutputItem, ...], target_world_size: int, *, nproc: int | None = None
) -> ReshardPlan:
    """Lay every item out for ``target_world_size`` ranks.

    Tensors are split on dim 0 in ``torch.chunk`` order (``dim0_boxes``). 0-dim tensors, empty
    tensors, and tensors a multi-rank source stored whole (replicated, e.g. buffers) stay whole on
    rank 0; values are carried to rank 0.

    Raises:
        InvalidOptionError: ``target_world_size`` or ``nproc`` below 1, or nothing to write.
        CoverageError: a source tensor's chunks do not tile it.
        NotADcpCheckpointError: inconsistent planner paths.
    """
    if target_world_size < 1:
        raise InvalidOptionError(f"--world-size must be at least 1, got {target_world_size}")
    if nproc is not None and nproc < 1:
        raise InvalidOptionError(f"--nproc must be at least 1, got {nproc}")
    if not items:
        raise InvalidOptionError(f"{index.checkpoint_id}: nothing to write (no entries are left after --include/--exclude)")
    try:
        unflatten((item.path, None) for item in items)
    except ValueError as err:
        raise NotADcpCheckpointError(f"{index.checkpoint_id / METADATA_FILENAME}: planner data is inconsistent: {err}") from err
    chunks: list[tuple[TargetChunk, ...]] = []
    for item in items:
        e = item.entry
        if not item.is_tensor:
            chunks.append((TargetChunk(rank=0, offsets=(), sizes=()),))
            continue
        assert isinstance(e, TensorEntry)
        for source in item.sources or (e,):  # a derived tensor's inputs
            check_coverage(source)
        full = [c for c in e.chunks if c.numel > 0]
        replicated = item.derived is None and index.world_size > 1 and len(full) == 1 and full[0].sizes == e.shape
        shape = item.shape
        if not shape or math.prod(shape) == 0 or replicated:
            chunks.append((TargetChunk(rank=0, offsets=(0,) * len(shape), sizes=shape),))
        else:
            chunks.append(tuple(dim0_boxes(shape, target_world_size)))
    workers = nproc or 1
    payloads, values_offset = _lay_out_rank_files(items, chunks, target_world_size, workers)
    return ReshardPlan(
        items=items,
        chunks=tuple(chunks),
        payloads=payloads,
        values_offset=values_offset,
        target_world_size=target_world_size,
        nproc=workers,
    )


def _lay_out_rank_files(
    items: tuple[OutputItem, ...], chunks: list[tuple[TargetChunk, ...]], world_size: int, nproc: int
) -> tuple[tuple[PayloadPlan, ...], int]:
    """Every tensor chunk's payload, back to back per rank file in item order; workers take contiguous runs of them.

    Returns:
        The payloads, and where rank 0's values start (the end of its payloads), in bytes.
    """
    ends = [0] * world_size
    placements: dict[tuple[object, ...], PayloadPlacement] = {}
    placed: list[tuple[int, TargetChunk, int, PayloadPlacement]] = []
    for rank in range(world_size):
        for i, (item, item_chunks) in enumerate(zip(items, chunks, strict=True)):
            if not item.is_tensor or item.dtype is None:
                continue
            for chunk in item_chunks:
                if chunk.rank != rank:
                    continue
                key = (item.dtype, chunk.sizes)
                placement = placements.get(key) or placements.setdefault(
                    key, tensor_payload_placement(TensorSlot(item.dtype, chunk.sizes))
                )
                placed.append((i, chunk, ends[rank], placement))
                ends[rank] += placement.size
    owners = _balance([placement.size for *_, placement in placed], nproc)
    payloads = tuple(
        PayloadPlan(item=i, chunk=chunk, offset=offset, placement=placement, owner=owners[k])
        for k, (i, chunk, offset, placement) in enumerate(placed)
    )
    return payloads, ends[0]


def _balance(sizes: list[int], nproc: int) -> list[int]:
    """Workers for payloads of these sizes, in order: contiguous runs, balanced by bytes."""
    total = sum(sizes) or 1
    owners, done = [], 0
    for size in sizes:
        owners.append(min(nproc - 1, (2 * done + size) * nproc // (2 * total)))
        done += size
    return owners


def rank_file_bytes(plan: ReshardPlan) -> dict[int, int]:
    """Each target rank's data file size, in bytes: its payloads, and rank 0's values (their payload sizes, a little low)."""
    ends = dict.fromkeys(plan.data_ranks, 0)
    for p in plan.payloads:
        ends[p.chunk.rank] = max(ends[p.chunk.rank], p.offset + p.placement.size)
    if 0 in ends:
        ends[0] = max(ends[0], plan.values_offset) + sum(item.nbytes for item in plan.items if not item.is_tensor)
    return ends


def wave_plan(plan: ReshardPlan, ranks: frozenset[int]) -> ReshardPlan:
    """The payloads of ``ranks``' data files only, balanced anew over all the workers (a wave of an output to object storage).

    Offsets are unchanged: each payload goes where the whole plan lays it out.
    """
    payloads = [p for p in plan.payloads if p.chunk.rank in ranks]
    owners = _balance([p.placement.size for p in payloads], plan.nproc)
    return replace(plan, payloads=tuple(replace(p, owner=o) for p, o in zip(payloads, owners, strict=True)))
