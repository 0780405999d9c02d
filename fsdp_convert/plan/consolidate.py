"""Plan stage: from an index and options to a ``WorkPlan``; pure functions, no I/O.

Every user mistake that can be caught from ``.metadata`` and the options (an impossible format,
chunks that do not tile their tensor) is caught here, before a tensor is read.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from fsdp_convert.errors import InvalidOptionError, NotADcpCheckpointError
from fsdp_convert.formats.index import CheckpointIndex, TensorEntry, check_coverage, unflatten
from fsdp_convert.item import OutputItem
from fsdp_convert.output_table import METADATA_FILENAME
from fsdp_convert.outputs import FilePlan, Only, OutputKind, RequestedFormat

__all__ = [
    "Only",  # from outputs
    "RequestedFormat",  # from outputs
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "DEFAULT_MAX_SHARD_BYTES",
    "FilePlan",  # from outputs
    "WorkPlan",
    "assign_owners",
    "default_nproc",
    "mover_buffers",
    "plan_consolidate",
    "output_bytes",
    "file_bytes",
    "WAVE_BYTES",
    "group_waves",
    "wave_plans",
    "staging_bytes",
]

DEFAULT_MEMORY_BUDGET_BYTES = 256 << 20
DEFAULT_MAX_SHARD_BYTES = 50 * 10**9  # "50GB", save_pretrained's default since transformers 5 (4.x: "5GB")
MIN_BYTES_PER_WORKER = 2 << 30  # below this a worker's start-up (forkserver, launcher, gloo: 0.5-2 s) costs more than it saves
THREADS_PER_WORKER = 2  # mover threads per process: one's read overlaps the other's write (one for small chunks: move)
MAX_PIECE_BYTES = 32 << 20  # larger buffers than this gain nothing per read or write
MIN_PIECE_BYTES = 64 << 10
WAVE_BYTES = 2 << 30  # an output to object storage is written in waves of files this large (or one larger file)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkPlan:
    """What a consolidation writes, file by file, and which worker moves each tensor.

    Attributes:
        items: the output items (see ``transform.build_items``).
        owners: for each item, the rank that moves its bytes; values are read by rank 0.
        nproc: number of workers.
        kind: what is written (``outputs.output_kind``): it placed the files and finishes the output.
        files: every output file (``OutputKind.plan_files``): the output itself, or a folder's
            safetensors shards (in shard order) then ``optimizer.pt`` and ``extra_state.pt``.
        memory_budget_bytes: buffers each process may hold, in bytes.
        threads: mover threads per worker, at most (``move.mover_threads``).
        piece_bytes: size of each mover buffer (two per thread), in bytes.
        drop_cache: drop read and written ranges from the page cache (the output is larger than
            half the RAM).
    """

    items: tuple[OutputItem, ...]
    owners: tuple[int, ...]
    nproc: int
    kind: OutputKind
    files: tuple[FilePlan, ...]
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    threads: int = THREADS_PER_WORKER
    piece_bytes: int = MAX_PIECE_BYTES
    drop_cache: bool = False

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data and value payloads to produce."""
        return sum(item.nbytes for item in self.items)

    @property
    def output_format(self) -> str:
        """The kind's name: ``torch_save`` or ``safetensors`` (one file), or ``hf_dir`` (a folder)."""
        return self.kind.name

    @property
    def shards(self) -> tuple[FilePlan, ...]:
        """The files the folder's index lists (``OutputKind.shards``: a Hugging Face folder's safetensors shards)."""
        return self.kind.shards(self.files)

    def bytes_per_rank(self) -> list[int]:
        """Bytes assigned to each rank to move, in bytes."""
        loads = [0] * self.nproc
        for item, owner in zip(self.items, self.owners, strict=True):
            loads[owner] += item.nbytes
        return loads


def assign_owners(items: tuple[OutputItem, ...], nproc: int, order: list[int] | None = None) -> tuple[int, ...]:
    """Split the tensors over ``nproc`` ranks, each to the rank with the fewest bytes so far.

    Walking the tensors in output order (``order``, default item order), each goes to the rank
    that holds the fewest tensor bytes so far (the lowest rank on a tie). So the ranks take turns
    along the output, all moving through one region of the checkpoint at a time as one process's
    threads do, and end within one tensor of ``1 / nproc`` of the bytes each (fixed stripes of the
    output left 70/30 splits where a few large tensors fell into one rank's stripes). Values go to
    rank 0, which writes them. Deterministic, so every process computes the same plan.
    """
    ids = [i for i in (order if order is not None else range(len(items))) if items[i].is_tensor]
    owners = [0] * len(items)
    loads = [(0, rank) for rank in range(nproc)]  # a heap of (bytes so far, rank)
    for i in ids:
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + items[i].nbytes, rank))
    return tuple(owners)


def default_nproc(total_bytes: int, data_files: int, cpus: int) -> int:
    """Workers to start when the user does not say: one per CPU core.

    At most one per data file and one per ``MIN_BYTES_PER_WORKER`` of data, and at least 1. Every
    worker writes its own tensors in place and reads and writes in two threads (one for small chunks), so more workers
    use more of the disk and the cores; nothing funnels through one process.
    """
    return max(1, min(cpus, data_files, -(-total_bytes // MIN_BYTES_PER_WORKER)))


def mover_buffers(memory_budget_bytes: int) -> tuple[int, int]:
    """Mover threads per worker and the size of each of their two buffers, in bytes, for a memory budget.

    The buffers of all threads fit in the budget: ``threads x 2 x piece_bytes <= budget`` (unless
    the budget is below ``THREADS_PER_WORKER x 2 x MIN_PIECE_BYTES``).
    """
    piece = memory_budget_bytes // (2 * THREADS_PER_WORKER)
    return THREADS_PER_WORKER, max(MIN_PIECE_BYTES, min(MAX_PIECE_BYTES, piece))


def plan_consolidate(
    index: CheckpointIndex,
    items: tuple[OutputItem, ...],
    output: Path,
    *,
    kind: OutputKind,
    nproc: int | None = None,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    cpus: int = 1,
    ram_bytes: int | None = None,
) -> WorkPlan:
    """Plan a consolidation of ``index``'s ``items`` into ``output``.

    Args:
        index: the checkpoint's index.
        items: what to write (``transform.build_items``), already restricted to ``kind.groups(only)``.
        output: the output path.
        kind: what to write (``outputs.output_kind``); it places the files (``OutputKind.plan_files``).
        nproc: workers that will read; ``None`` picks ``default_nproc`` (with ``cpus``).
        memory_budget_bytes: buffers each process may hold, in bytes (``mover_buffers``).
        max_shard_bytes: largest shard file of a folder output, in bytes.
        cpus: CPU cores available, for the default ``nproc``.
        ram_bytes: the machine's memory, in bytes; an output larger than half of it is dropped
            from the page cache as it is written. None: never.

    Raises:
        InvalidOptionError: ``nproc < 1``, nothing left to write, or what ``kind`` cannot hold (``OutputKind.plan_files``).
        CoverageError: a selected tensor's chunks do not tile it.
        NotADcpCheckpointError: inconsistent planner paths.
    """
    if nproc is not None and nproc < 1:
        raise InvalidOptionError(f"--nproc must be at least 1, got {nproc}")
    if not items:
        raise InvalidOptionError(
            f"{index.checkpoint_id}: nothing to write (no entries are left after --only/--include/--exclude)"
        )
    try:
        unflatten((item.path, None) for item in items)
    except ValueError as err:
        raise NotADcpCheckpointError(f"{index.checkpoint_id / METADATA_FILENAME}: planner data is inconsistent: {err}") from err
    for item in items:
        if item.is_tensor:
            assert isinstance(item.entry, TensorEntry)
            for entry in item.sources or (item.entry,):  # a derived tensor's inputs
                check_coverage(entry)
    total = sum(item.nbytes for item in items)
    if nproc is None:
        nproc = default_nproc(total, len(index.data_files) or 1, cpus)
    files = kind.plan_files(items, max_shard_bytes=max_shard_bytes)
    threads, piece_bytes = mover_buffers(memory_budget_bytes)
    return WorkPlan(
        items=items,
        owners=assign_owners(items, nproc, [i for f in files for i in f.item_ids]),
        nproc=nproc,
        kind=kind,
        files=files,
        memory_budget_bytes=memory_budget_bytes,
        threads=threads,
        piece_bytes=piece_bytes,
        drop_cache=ram_bytes is not None and total > ram_bytes // 2,
    )


def output_bytes(plan: WorkPlan) -> int:
    """The consolidated output's size, in bytes, from its placement (known before any data is read).

    A safetensors file ends with its last tensor; a torch.save file's storages are followed by
    ``data.pkl`` (the values, each at most its payload size) and the zip's central directory,
    counted as ``RECORD_TAIL_BYTES`` per item, so the estimate is a few bytes per item high, never low.
    A folder's ``model.safetensors.index.json`` and copied HF assets are not counted (small).
    """
    return sum(file_bytes(plan, file) for file in plan.files)


def file_bytes(plan: WorkPlan, file: FilePlan) -> int:
    """One output file's size, in bytes, from its placement (``FileKind.size_bytes``, as ``output_bytes`` counts it)."""
    return file.kind.size_bytes(file, plan.items)


def group_waves(sizes: Sequence[int], wave_bytes: int) -> tuple[tuple[int, ...], ...]:
    """Cut files, in order, into waves of consecutive files totalling at most ``wave_bytes`` each.

    A wave holds at least one file, so a file larger than ``wave_bytes`` is a wave of its own.

    Args:
        sizes: each file's size, in bytes.
        wave_bytes: the most bytes a wave of several files may hold.

    Returns:
        The waves, each the indices into ``sizes`` of its files.
    """
    waves: list[list[int]] = []
    total = 0
    for k, size in enumerate(sizes):
        if not waves or (total + size > wave_bytes and total > 0):
            waves.append([])
            total = 0
        waves[-1].append(k)
        total += size
    return tuple(tuple(w) for w in waves)


def wave_plans(plan: WorkPlan, wave_bytes: int = WAVE_BYTES) -> tuple[WorkPlan, ...]:
    """The plan cut into waves of whole files (``group_waves``): an output to object storage is written and uploaded by waves.

    Each wave's plan holds its files only, and its tensors are shared over all the workers anew
    (``assign_owners`` in the wave's file order), so every worker moves a share of every wave.
    """
    waves = group_waves([file_bytes(plan, f) for f in plan.files], wave_bytes)
    parts = []
    for wave in waves:
        files = tuple(plan.files[k] for k in wave)
        owners = assign_owners(plan.items, plan.nproc, [i for f in files for i in f.item_ids])
        parts.append(replace(plan, files=files, owners=owners))
    return tuple(parts)


def staging_bytes(sizes: Sequence[int]) -> int:
    """Local bytes, for an output written in waves of these sizes (bytes): two waves, one uploading while the next is written."""
    return max((a + b for a, b in zip(sizes, sizes[1:], strict=False)), default=max(sizes, default=0))
