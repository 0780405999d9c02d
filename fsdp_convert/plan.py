"""Plan stage: from an index and options to a ``WorkPlan``; pure functions, no I/O.

Every user mistake that can be caught from ``.metadata`` and the options (an impossible format,
chunks that do not tile their tensor) is caught here, before a tensor is read.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fsdp_convert.errors import CoverageError, InvalidOptionError
from fsdp_convert.layout import Group, group_of
from fsdp_convert.metadata import BytesEntry, CheckpointIndex, Entry, TensorEntry

__all__ = [
    "OutputFormat",
    "Only",
    "TORCH_SAVE_SUFFIXES",
    "SAFETENSORS_SUFFIXES",
    "output_format",
    "check_coverage",
    "WorkPlan",
    "plan_consolidate",
    "assign_owners",
]

OutputFormat = Literal["torch_save", "safetensors"]
Only = Literal["all", "model", "optim"]
TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_SUFFIXES = (".safetensors",)


def output_format(output: Path) -> OutputFormat:
    """The writer an output path asks for, by its suffix.

    Raises:
        InvalidOptionError: the suffix is neither a torch.save nor a safetensors suffix.
    """
    suffix = output.suffix.lower()
    if suffix in TORCH_SAVE_SUFFIXES:
        return "torch_save"
    if suffix in SAFETENSORS_SUFFIXES:
        return "safetensors"
    known = ", ".join(TORCH_SAVE_SUFFIXES + SAFETENSORS_SUFFIXES)
    raise InvalidOptionError(f"{output}: unknown output suffix {output.suffix!r}; use one of {known}")


def _box_end(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(o + s for o, s in zip(offsets, sizes, strict=True))


def check_coverage(entry: TensorEntry) -> None:
    """Check that the entry's chunks tile its global shape exactly: inside it, no overlap, no gap.

    Runs in O(chunks^2 x ndim), which is small: one chunk per writing rank and placement.

    Raises:
        CoverageError: a chunk lies outside the shape, two chunks overlap, or elements are missing;
            the message names the FQN and the chunks' offsets.
    """
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


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkPlan:
    """What a consolidation writes, in output order, and which worker reads each tensor.

    Attributes:
        entries: the selected entries in the producer's order (the output's order).
        owners: for each entry, the rank that reads it; bytes entries are read by rank 0.
        nproc: number of workers.
        output_format: the writer to use.
    """

    entries: tuple[Entry, ...]
    owners: tuple[int, ...]
    nproc: int
    output_format: OutputFormat

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data and bytes payloads to produce."""
        return sum(e.nbytes for e in self.entries)

    def bytes_per_rank(self) -> list[int]:
        """Tensor bytes assigned to each rank, in bytes."""
        loads = [0] * self.nproc
        for entry, owner in zip(self.entries, self.owners, strict=True):
            loads[owner] += entry.nbytes
        return loads


def assign_owners(entries: tuple[Entry, ...], nproc: int) -> tuple[int, ...]:
    """Balance tensors over ``nproc`` ranks by bytes (largest first onto the least loaded rank).

    Deterministic: ties go to the lower rank, so every process computes the same plan. Bytes
    entries go to rank 0, which writes them.
    """
    owners = [0] * len(entries)
    # rank 0 also reads every bytes entry: count those against it from the start
    values_bytes = sum(e.nbytes for e in entries if isinstance(e, BytesEntry))
    heap = [(values_bytes if rank == 0 else 0, rank) for rank in range(nproc)]
    tensor_ids = sorted((i for i, e in enumerate(entries) if isinstance(e, TensorEntry)), key=lambda i: (-entries[i].nbytes, i))
    for i in tensor_ids:
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + entries[i].nbytes, rank))
    return tuple(owners)


def plan_consolidate(index: CheckpointIndex, output: Path, *, only: Only = "all", nproc: int = 1) -> WorkPlan:
    """Plan a consolidation of ``index`` into the single file ``output``.

    Args:
        index: the checkpoint's index.
        output: the output file; its suffix picks the format (``.pt``/``.pth``/``.bin``:
            torch.save of the nested state dict; ``.safetensors``: model weights only).
        only: which top-level groups to keep: ``all`` (model, optimizer and other entries),
            ``model`` or ``optim``.
        nproc: number of workers that will read.

    Raises:
        InvalidOptionError: unknown suffix, optimizer state asked of safetensors, ``nproc < 1``,
            or nothing left to write.
        CoverageError: a selected tensor's chunks do not tile it.
    """
    fmt = output_format(output)
    if nproc < 1:
        raise InvalidOptionError(f"--nproc must be at least 1, got {nproc}")
    if fmt == "safetensors":
        if only == "optim":
            raise InvalidOptionError(f"{output}: safetensors holds model weights only; use a .pt output for optimizer state")
        only = "model"  # the suffix implies --only model
    wanted: set[Group] = {"model", "optim", "other"} if only == "all" else {only}
    entries = tuple(e for e in index.entries if group_of(e) in wanted)
    if not entries:
        raise InvalidOptionError(f"{index.checkpoint_id}: no {only} entries to write")
    if fmt == "safetensors":
        for e in entries:
            if isinstance(e, BytesEntry):
                raise InvalidOptionError(f"{e.fqn} is not a tensor; safetensors holds tensors only (use a .pt output)")
    for e in entries:
        if isinstance(e, TensorEntry):
            check_coverage(e)
    return WorkPlan(entries=entries, owners=assign_owners(entries, nproc), nproc=nproc, output_format=fmt)
