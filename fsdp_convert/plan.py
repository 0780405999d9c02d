"""Plan stage: from an index and options to a ``WorkPlan``; pure functions, no I/O.

Every user mistake that can be caught from ``.metadata`` and the options (an impossible format,
chunks that do not tile their tensor) is caught here, before a tensor is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from fsdp_convert.constants import (
    EXTRA_STATE_FILENAME,
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
from fsdp_convert.writers.safetensors import safetensors_layout
from fsdp_convert.writers.torch_save import TensorSlot, torch_save_layout

__all__ = [
    "OutputFormat",
    "Only",
    "RequestedFormat",
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "DEFAULT_MAX_SHARD_BYTES",
    "output_format",
    "groups_for",
    "FilePlan",
    "WorkPlan",
    "assign_owners",
    "plan_shards",
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

OutputFormat = Literal["torch_save", "safetensors", "hf_dir"]
Only = Literal["all", "model", "optim"]
RequestedFormat = Literal["auto", "torch", "safetensors"]
DEFAULT_MEMORY_BUDGET_BYTES = 256 << 20
DEFAULT_MAX_SHARD_BYTES = 50 * 10**9  # "50GB", save_pretrained's default since transformers 5 (4.x: "5GB")
MIN_BYTES_PER_WORKER = 2 << 30  # below this a worker's start-up (forkserver, launcher, gloo: 0.5-2 s) costs more than it saves
THREADS_PER_WORKER = 2  # mover threads per process: one's read overlaps the other's write
MAX_PIECE_BYTES = 32 << 20  # larger buffers than this gain nothing per read or write
MIN_PIECE_BYTES = 64 << 10
RECORD_TAIL_BYTES = 256  # per torch.save item, past its storage: its data.pkl share, zip headers, central directory
STRIPE_BYTES = 64 << 20  # workers take turns at stripes of the output this long
WAVE_BYTES = 2 << 30  # an output to object storage is written in waves of files this large (or one larger file)


def output_format(output: Path, requested: RequestedFormat = "auto") -> OutputFormat:
    """The writer an output path (and ``--format``) asks for.

    ``auto``: ``.pt``/``.pth``/``.bin`` is one torch.save file; ``.safetensors`` one safetensors
    file; no suffix, or an existing folder, a Hugging Face folder (safetensors shards plus index).
    ``torch``: one torch.save file, whatever the name (Lightning's ``.ckpt``), unless it names a
    folder or a ``.safetensors`` file. ``safetensors``: a ``.safetensors`` file, or else a Hugging
    Face folder.

    Raises:
        InvalidOptionError: an unknown suffix with ``auto`` (the message suggests ``--format
            torch``), or a name that contradicts ``requested``.
    """
    suffix = output.suffix.lower()
    known = ", ".join(TORCH_SAVE_SUFFIXES + SAFETENSORS_SUFFIXES)
    if requested not in ("auto", "torch", "safetensors"):
        raise InvalidOptionError(f"--format {requested!r}: use auto, torch or safetensors")
    if requested == "torch":
        if suffix in SAFETENSORS_SUFFIXES or output.is_dir():
            what = "an existing folder" if output.is_dir() else f"a {output.suffix} name"
            raise InvalidOptionError(f"{output}: --format torch writes one torch.save file, not {what}")
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
    raise InvalidOptionError(
        f"{output}: unknown output suffix {output.suffix!r}; use one of {known} or a folder name, "
        "or --format torch to write a torch.save file under this name"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class FilePlan:
    """One output file, laid out before any data is read: its items and where each tensor's bytes go.

    Attributes:
        filename: name inside the output folder, or None for the output path itself.
        item_ids: indices into ``WorkPlan.items``, in file order.
        strip: leading path elements dropped in the file (1 for ``optimizer.pt``, which holds the
            optimizer state dict itself, not ``{"optim": ...}``).
        output_format: ``torch_save`` or ``safetensors``.
        data_offsets: per item of ``item_ids``, where its tensor's bytes start in the file, in
            bytes (None for a plain value); ``writers.torch_save.torch_save_layout`` or
            ``writers.safetensors.safetensors_layout``.
        header: a safetensors file's header bytes (empty for torch.save, whose headers rank 0
            writes once the values are read).
    """

    filename: str | None
    item_ids: tuple[int, ...]
    strip: int
    output_format: OutputFormat
    data_offsets: tuple[int | None, ...]
    header: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkPlan:
    """What a consolidation writes, file by file, and which worker moves each tensor.

    Attributes:
        items: the output items (see ``transform.build_items``).
        owners: for each item, the rank that moves its bytes; values are read by rank 0.
        nproc: number of workers.
        output_format: ``torch_save`` or ``safetensors`` (one file), or ``hf_dir`` (a folder).
        files: every output file: the output itself, or a folder's safetensors shards (in shard
            order) then ``optimizer.pt`` and ``extra_state.pt``.
        memory_budget_bytes: buffers each process may hold, in bytes.
        threads: mover threads per worker.
        piece_bytes: size of each mover buffer (two per thread), in bytes.
        drop_cache: drop read and written ranges from the page cache (the output is larger than
            half the RAM).
    """

    items: tuple[OutputItem, ...]
    owners: tuple[int, ...]
    nproc: int
    output_format: OutputFormat
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
    def shards(self) -> tuple[FilePlan, ...]:
        """The safetensors shards of an ``hf_dir`` output (none otherwise)."""
        return tuple(f for f in self.files if f.output_format == "safetensors") if self.output_format == "hf_dir" else ()

    def bytes_per_rank(self) -> list[int]:
        """Bytes assigned to each rank to move, in bytes."""
        loads = [0] * self.nproc
        for item, owner in zip(self.items, self.owners, strict=True):
            loads[owner] += item.nbytes
        return loads


def assign_owners(
    items: tuple[OutputItem, ...], nproc: int, order: list[int] | None = None, stripe_bytes: int = STRIPE_BYTES
) -> tuple[int, ...]:
    """Split the tensors over ``nproc`` ranks in interleaved stripes of the output.

    Walking the tensors in output order (``order``, default item order), the output is cut into
    stripes and stripe ``k`` goes to rank ``k % nproc`` (a tensor to the stripe of its middle
    byte). Stripes are ``stripe_bytes`` long, or shorter so each rank gets at least 4. So all
    workers move through the checkpoint together, in one region of the disk at a time, as one
    process's threads do, and each gets about ``1 / nproc`` of the bytes. Values go to rank 0,
    which writes them. Deterministic, so every process computes the same plan.
    """
    ids = [i for i in (order if order is not None else range(len(items))) if items[i].is_tensor]
    total = sum(items[i].nbytes for i in ids)
    stripe_bytes = max(1, min(stripe_bytes, -(-total // (4 * nproc))))
    owners = [0] * len(items)
    done = 0
    for i in ids:
        owners[i] = (done + items[i].nbytes // 2) // stripe_bytes % nproc
        done += items[i].nbytes
    return tuple(owners)


def _file_plan(
    items: tuple[OutputItem, ...], ids: tuple[int, ...], filename: str | None, fmt: OutputFormat, strip: int
) -> FilePlan:
    """Lay one output file out: every tensor's byte range, from shapes and dtypes alone.

    Raises:
        InvalidOptionError: a tensor safetensors cannot hold, or two tensors of one name.
    """
    if fmt == "safetensors":
        spec = []
        for i in ids:
            dtype = items[i].dtype
            assert dtype is not None  # safetensors files hold tensors only (checked by the caller)
            spec.append((items[i].path[strip:], dtype, items[i].shape))
        try:
            layout = safetensors_layout(spec)
        except ValueError as e:
            raise InvalidOptionError(f"{filename or 'the output'}: {e}") from e
        return FilePlan(
            filename=filename,
            item_ids=ids,
            strip=strip,
            output_format=fmt,
            data_offsets=layout.data_offsets,
            header=layout.header,
        )
    slots = [TensorSlot(dtype, items[i].shape) if items[i].is_tensor and (dtype := items[i].dtype) else None for i in ids]
    return FilePlan(filename=filename, item_ids=ids, strip=strip, output_format=fmt, data_offsets=torch_save_layout(slots))


def plan_shards(items: tuple[OutputItem, ...], item_ids: list[int], max_shard_bytes: int) -> tuple[FilePlan, ...]:
    """Pack tensors into shard files in order, as transformers' ``save_pretrained`` does, and lay each out.

    A new shard starts when the next tensor would take the current one past ``max_shard_bytes``;
    a tensor larger than that gets a shard of its own. One shard is named ``model.safetensors``;
    several ``model-0000i-of-0000n.safetensors``.
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
    n = len(groups)
    return tuple(
        _file_plan(
            items, tuple(g), HF_SINGLE_FILENAME if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors", "safetensors", 0
        )
        for k, g in enumerate(groups)
    )


def default_nproc(total_bytes: int, data_files: int, cpus: int) -> int:
    """Workers to start when the user does not say: one per CPU core.

    At most one per data file and one per ``MIN_BYTES_PER_WORKER`` of data, and at least 1. Every
    worker writes its own tensors in place and reads and writes in two threads, so more workers
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
    ram_bytes: int | None = None,
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
        memory_budget_bytes: buffers each process may hold, in bytes (``mover_buffers``).
        max_shard_bytes: largest shard file of a folder output, in bytes.
        cpus: CPU cores available, for the default ``nproc``.
        ram_bytes: the machine's memory, in bytes; an output larger than half of it is dropped
            from the page cache as it is written. None: never.

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
            for entry in item.sources or (item.entry,):  # a derived tensor's inputs
                check_coverage(entry)
    total = sum(item.nbytes for item in items)
    if nproc is None:
        nproc = default_nproc(total, len(index.data_files) or 1, cpus)
    if fmt != "hf_dir":
        files: tuple[FilePlan, ...] = (_file_plan(items, tuple(range(len(items))), None, fmt, 0),)
    else:
        files = plan_shards(items, model_ids, max_shard_bytes) if model_ids else ()
        for group, filename, strip in (("optim", OPTIMIZER_FILENAME, 1), ("other", EXTRA_STATE_FILENAME, 0)):
            ids = tuple(i for i, item in enumerate(items) if item.group == group)
            if ids:
                files += (_file_plan(items, ids, filename, "torch_save", strip),)
    threads, piece_bytes = mover_buffers(memory_budget_bytes)
    return WorkPlan(
        items=items,
        owners=assign_owners(items, nproc, [i for f in files for i in f.item_ids]),
        nproc=nproc,
        output_format=fmt,
        files=files,
        memory_budget_bytes=memory_budget_bytes,
        threads=threads,
        piece_bytes=piece_bytes,
        drop_cache=ram_bytes is not None and total > ram_bytes // 2,
    )


def output_bytes(plan: WorkPlan) -> int:
    """The consolidated output's size, in bytes, from its layout (known before any data is read).

    A safetensors file ends with its last tensor; a torch.save file's storages are followed by
    ``data.pkl`` (the values, each at most its payload size) and the zip's central directory,
    counted as ``RECORD_TAIL_BYTES`` per item, so the estimate is a few bytes per item high, never low.
    A folder's ``model.safetensors.index.json`` and copied HF assets are not counted (small).
    """
    return sum(file_bytes(plan, file) for file in plan.files)


def file_bytes(plan: WorkPlan, file: FilePlan) -> int:
    """One output file's size, in bytes, from its layout (as ``output_bytes`` counts it)."""
    ends = [o + plan.items[i].nbytes for i, o in zip(file.item_ids, file.data_offsets, strict=True) if o is not None]
    size = max(ends, default=len(file.header))
    if file.output_format == "torch_save":
        size += sum(RECORD_TAIL_BYTES + (0 if plan.items[i].is_tensor else plan.items[i].nbytes) for i in file.item_ids)
    return size


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

    Each wave's plan holds its files only, and its tensors are striped over all the workers anew
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
