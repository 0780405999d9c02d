"""Plan stage: from an index and options to a ``WorkPlan``; pure functions, no I/O.

Every user mistake that can be caught from ``.metadata`` and the options (an impossible format,
chunks that do not tile their tensor) is caught here, before a tensor is read.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fsdp_convert.constants import (
    EXTRA_STATE_FILENAME,
    HF_INDEX_FILENAME,
    HF_SINGLE_FILENAME,
    METADATA_FILENAME,
    OPTIMIZER_FILENAME,
    SAFETENSORS_SUFFIXES,
    TORCH_SAVE_SUFFIXES,
)
from fsdp_convert.errors import InvalidOptionError, NotADcpCheckpointError
from fsdp_convert.formats.index import CheckpointIndex, TensorEntry, check_coverage, unflatten
from fsdp_convert.layout import GROUPS, Group
from fsdp_convert.transform import OutputItem

__all__ = [
    "ReshardPlan",
    "TargetChunk",
    "plan_reshard",
    "dim0_boxes",
    "OutputFormat",
    "ShardPlan",
    "plan_shards",
    "default_nproc",
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "DEFAULT_MAX_SHARD_BYTES",
    "HF_INDEX_FILENAME",
    "HF_SINGLE_FILENAME",
    "METADATA_FILENAME",
    "Only",
    "TORCH_SAVE_SUFFIXES",
    "SAFETENSORS_SUFFIXES",
    "output_format",
    "check_coverage",
    "WorkPlan",
    "FilePlan",
    "groups_for",
    "OPTIMIZER_FILENAME",
    "EXTRA_STATE_FILENAME",
    "plan_consolidate",
    "assign_owners",
]

OutputFormat = Literal["torch_save", "safetensors", "hf_dir"]
Only = Literal["all", "model", "optim"]
RequestedFormat = Literal["auto", "torch", "safetensors"]
DEFAULT_MEMORY_BUDGET_BYTES = 1 << 30
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # "5GB", transformers' save_pretrained default
MIN_BYTES_PER_WORKER = 256 << 20  # below this a worker's start-up (~2 s) costs more than it saves


def output_format(output: Path, requested: RequestedFormat = "auto") -> OutputFormat:
    """The writer an output path (and ``--format``) asks for.

    ``auto``: ``.pt``/``.pth``/``.bin`` is one torch.save file; ``.safetensors`` one safetensors
    file; no suffix, or an existing folder, a Hugging Face folder (safetensors shards plus index).
    ``safetensors``: a ``.safetensors`` file, or else a Hugging Face folder. ``torch``: a torch.save
    file, which needs one of the torch suffixes.

    Raises:
        InvalidOptionError: an unknown suffix, or one that contradicts ``requested``.
    """
    suffix = output.suffix.lower()
    known = ", ".join(TORCH_SAVE_SUFFIXES + SAFETENSORS_SUFFIXES)
    if requested not in ("auto", "torch", "safetensors"):
        raise InvalidOptionError(f"--format {requested!r}: use auto, torch or safetensors")
    if requested == "torch":
        if suffix not in TORCH_SAVE_SUFFIXES:
            raise InvalidOptionError(
                f"{output}: --format torch writes one torch.save file; name it with {', '.join(TORCH_SAVE_SUFFIXES)}"
            )
        return "torch_save"
    if requested == "safetensors":
        if suffix in TORCH_SAVE_SUFFIXES:
            raise InvalidOptionError(
                f"{output}: --format safetensors needs a .safetensors name or a folder, not {output.suffix!r}"
            )
        return "safetensors" if suffix in SAFETENSORS_SUFFIXES else "hf_dir"
    if suffix in TORCH_SAVE_SUFFIXES:
        return "torch_save"
    if suffix in SAFETENSORS_SUFFIXES:
        return "safetensors"
    if suffix == "" or output.is_dir():
        return "hf_dir"
    raise InvalidOptionError(f"{output}: unknown output suffix {output.suffix!r}; use one of {known}, or a folder name")


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardPlan:
    """One safetensors file of a folder output and the items it holds, read and written by one rank.

    Attributes:
        filename: file name inside the output folder (``model-00001-of-00003.safetensors``).
        item_ids: indices into ``WorkPlan.items``, in file order.
        owner: the rank that reads these items and writes the file.
        tensor_bytes: tensor data in the file, in bytes.
    """

    filename: str
    item_ids: tuple[int, ...]
    owner: int
    tensor_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FilePlan:
    """One file written by rank 0 from items every rank reads (a torch.save or safetensors file).

    Attributes:
        filename: name inside the output folder, or None for the output path itself.
        item_ids: indices into ``WorkPlan.items``, in file order.
        strip: leading path elements dropped in the file (1 for ``optimizer.pt``, which holds the
            optimizer state dict itself, not ``{"optim": ...}``).
        output_format: ``torch_save`` or ``safetensors``.
    """

    filename: str | None
    item_ids: tuple[int, ...]
    strip: int
    output_format: OutputFormat


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkPlan:
    """What a consolidation writes, in output order, and which worker reads each item.

    Attributes:
        items: the output items (see ``transform.build_items``), in output order.
        owners: for each item, the rank that reads it; values are read by rank 0.
        nproc: number of workers.
        output_format: ``torch_save`` or ``safetensors`` (one file), or ``hf_dir`` (a folder).
        memory_budget_bytes: what each process may hold in read-ahead and send buffers, in bytes.
        shards: the safetensors shards of an ``hf_dir`` output; empty otherwise.
        files: the files rank 0 writes: the output itself, or an ``hf_dir``'s ``optimizer.pt``
            and ``extra_state.pt``.
    """

    items: tuple[OutputItem, ...]
    owners: tuple[int, ...]
    nproc: int
    output_format: OutputFormat
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    shards: tuple[ShardPlan, ...] = ()
    files: tuple[FilePlan, ...] = ()

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data and value payloads to produce."""
        return sum(item.nbytes for item in self.items)

    def bytes_per_rank(self) -> list[int]:
        """Bytes assigned to each rank to read, in bytes."""
        loads = [0] * self.nproc
        for item, owner in zip(self.items, self.owners, strict=True):
            loads[owner] += item.nbytes
        return loads


def _balance(weights: list[int], nproc: int, rank0_start: int = 0) -> list[int]:
    """Largest first onto the least-loaded rank; ties go to the lower rank (deterministic)."""
    owners = [0] * len(weights)
    heap = [(rank0_start if rank == 0 else 0, rank) for rank in range(nproc)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + weights[i], rank))
    return owners


def assign_owners(items: tuple[OutputItem, ...], nproc: int) -> tuple[int, ...]:
    """Balance tensors over ``nproc`` ranks by bytes (largest first onto the least loaded rank).

    Deterministic, so every process computes the same plan. Values go to rank 0, which writes
    them, and count against its share.
    """
    tensor_ids = [i for i, item in enumerate(items) if item.is_tensor]
    values_bytes = sum(item.nbytes for item in items if not item.is_tensor)
    tensor_owners = _balance([items[i].nbytes for i in tensor_ids], nproc, values_bytes)
    owners = [0] * len(items)
    for i, owner in zip(tensor_ids, tensor_owners, strict=True):
        owners[i] = owner
    return tuple(owners)


def plan_shards(items: tuple[OutputItem, ...], item_ids: list[int], max_shard_bytes: int, nproc: int) -> tuple[ShardPlan, ...]:
    """Pack tensors into shard files in order, as transformers' ``save_pretrained`` does.

    A new shard starts when the next tensor would take the current one past ``max_shard_bytes``;
    a tensor larger than that gets a shard of its own. Shards are balanced over ranks by bytes.
    One shard is named ``model.safetensors``; several ``model-0000i-of-0000n.safetensors``.
    """
    groups: list[list[int]] = []
    size = 0
    for i in item_ids:
        nbytes = items[i].nbytes
        if not groups or (size + nbytes > max_shard_bytes and size > 0):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    sizes = [sum(items[i].nbytes for i in g) for g in groups]
    owners = _balance(sizes, nproc)
    n = len(groups)
    return tuple(
        ShardPlan(
            filename=HF_SINGLE_FILENAME if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors",
            item_ids=tuple(g),
            owner=owners[k],
            tensor_bytes=sizes[k],
        )
        for k, g in enumerate(groups)
    )


def default_nproc(total_bytes: int, data_files: int, cpus: int, *, single_file: bool = True) -> int:
    """Workers to start when the user does not say.

    At most one per data file and one per ``MIN_BYTES_PER_WORKER`` of data, and at least 1. For a
    folder output, one per CPU core. For a single-file output, one per two cores: rank 0 needs a
    core for writing beside its reading, and every tensor another worker reads is copied to rank 0
    over gloo; on a 2-core machine (scripts/bench.py, 3.4 GB) two workers took 2.9x as long as one.
    """
    cores = max(1, cpus // 2) if single_file else cpus
    return max(1, min(cores, data_files, -(-total_bytes // MIN_BYTES_PER_WORKER)))


def groups_for(fmt: OutputFormat, only: Only) -> tuple[Group, ...]:
    """The groups an output holds, for ``--only``.

    A safetensors file holds model weights only; a folder holds the model as shards and, with
    ``only="all"``, the optimizer in ``optimizer.pt`` and the rest in ``extra_state.pt``.

    Raises:
        InvalidOptionError: optimizer state asked of a safetensors file.
    """
    if fmt == "safetensors":
        if only == "optim":
            raise InvalidOptionError(
                "a .safetensors file holds model weights only; use a .pt file or a folder for optimizer state"
            )
        return ("model",)
    return GROUPS if only == "all" else (only,)


def plan_consolidate(
    index: CheckpointIndex,
    items: tuple[OutputItem, ...],
    output: Path,
    *,
    fmt: OutputFormat,
    nproc: int | None = None,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    cpus: int = 1,
) -> WorkPlan:
    """Plan a consolidation of ``index``'s ``items`` into ``output``.

    Args:
        index: the checkpoint's index.
        items: what to write (``transform.build_items``), already restricted to ``groups_for(fmt, only)``.
        output: the output path.
        fmt: ``torch_save`` (one file of the nested state dict), ``safetensors`` (model weights in
            one file), ``hf_dir`` (model weights as Hugging Face safetensors shards of at most
            ``max_shard_bytes`` plus ``model.safetensors.index.json``; optimizer state in
            ``optimizer.pt``, other entries in ``extra_state.pt``).
        nproc: workers that will read; ``None`` picks ``default_nproc`` (with ``cpus``).
        memory_budget_bytes: read-ahead and send buffers each process may hold, in bytes.
        max_shard_bytes: largest shard file of a folder output, in bytes.
        cpus: CPU cores available, for the default ``nproc``.

    Raises:
        InvalidOptionError: ``nproc < 1``, nothing left to write, or a value for a safetensors file.
        CoverageError: a selected tensor's chunks do not tile it.
        NotADcpCheckpointError: inconsistent planner paths.
    """
    if nproc is not None and nproc < 1:
        raise InvalidOptionError(f"--nproc must be at least 1, got {nproc}")
    if not items:
        raise InvalidOptionError(
            f"{index.checkpoint_id}: nothing to write (no entries are left after --only/--include/--exclude)"
        )
    model_ids = [i for i, item in enumerate(items) if item.group == "model"]
    if fmt != "torch_save":
        for i in model_ids:
            if not items[i].is_tensor:
                raise InvalidOptionError(
                    f"{items[i].entry.fqn} is not a tensor; safetensors holds tensors only (use a .pt output)"
                )
    try:
        unflatten((item.path, None) for item in items)
    except ValueError as err:
        raise NotADcpCheckpointError(f"{index.checkpoint_id / METADATA_FILENAME}: planner data is inconsistent: {err}") from err
    for item in items:
        if item.is_tensor:
            assert isinstance(item.entry, TensorEntry)
            check_coverage(item.entry)
    total = sum(item.nbytes for item in items)
    if nproc is None:
        nproc = default_nproc(total, len(index.data_files) or 1, cpus, single_file=fmt != "hf_dir")
    if fmt != "hf_dir":
        everything = FilePlan(filename=None, item_ids=tuple(range(len(items))), strip=0, output_format=fmt)
        return WorkPlan(
            items=items,
            owners=assign_owners(items, nproc),
            nproc=nproc,
            output_format=fmt,
            memory_budget_bytes=memory_budget_bytes,
            files=(everything,),
        )
    shards = plan_shards(items, model_ids, max_shard_bytes, nproc) if model_ids else ()
    owners = list(assign_owners(items, nproc))
    for shard in shards:
        for i in shard.item_ids:
            owners[i] = shard.owner
    files = []
    for group, filename, strip in (("optim", OPTIMIZER_FILENAME, 1), ("other", EXTRA_STATE_FILENAME, 0)):
        ids = tuple(i for i, item in enumerate(items) if item.group == group)
        if ids:
            files.append(FilePlan(filename=filename, item_ids=ids, strip=strip, output_format="torch_save"))
    return WorkPlan(
        items=items,
        owners=tuple(owners),
        nproc=nproc,
        output_format=fmt,
        memory_budget_bytes=memory_budget_bytes,
        shards=shards,
        files=tuple(files),
    )


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
class ReshardPlan:
    """Target layout of a reshard: every item's chunks per target rank, and who writes each rank.

    Attributes:
        items: the output items (``transform.build_items``), in output order.
        chunks: per item, its ``TargetChunk`` s; a value gets one on rank 0 with empty offsets
            and sizes (rank 0 carries them).
        target_world_size: ranks of the output.
        nproc: workers; worker ``w`` writes the rank files ``w, w + nproc, ...``.
    """

    items: tuple[OutputItem, ...]
    chunks: tuple[tuple[TargetChunk, ...], ...]
    target_world_size: int
    nproc: int

    def ranks_of(self, worker: int) -> list[int]:
        """The target ranks whose files ``worker`` writes (none for a worker past ``nproc``)."""
        return list(range(worker, self.target_world_size, self.nproc)) if worker < self.nproc else []


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
        check_coverage(e)
        full = [c for c in e.chunks if c.numel > 0]
        replicated = index.world_size > 1 and len(full) == 1 and full[0].sizes == e.shape
        if not e.shape or e.numel == 0 or replicated:
            chunks.append((TargetChunk(rank=0, offsets=(0,) * len(e.shape), sizes=e.shape),))
        else:
            chunks.append(tuple(dim0_boxes(e.shape, target_world_size)))
    workers = min(nproc or 1, target_world_size)
    return ReshardPlan(items=items, chunks=tuple(chunks), target_world_size=target_world_size, nproc=workers)
