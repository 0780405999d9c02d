"""Operation ``consolidate``: index, transform, plan, then read and write on the workers (launch).

Rank 0 writes a single-file output, which every other worker feeds over gloo in file order; for a
folder output each worker writes its own safetensors shards and rank 0 the index and the torch.save
side files. Progress bars (tqdm, on stderr) count bytes read and written.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, closing
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fsdp_convert.constants import HF_INDEX_FILENAME
from fsdp_convert.errors import VerificationError
from fsdp_convert.formats import Reader, check_data_files, open_reader, read_index
from fsdp_convert.formats.index import BytesEntry, Location, TensorEntry
from fsdp_convert.items import prepare_items
from fsdp_convert.launch import Cluster, GlooTransport, job_world_size, run_ranks, shared_tag
from fsdp_convert.ops.verify import verify
from fsdp_convert.plan import (
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_MEMORY_BUDGET_BYTES,
    FilePlan,
    Only,
    RequestedFormat,
    WorkPlan,
    groups_for,
    plan_consolidate,
)
from fsdp_convert.plan import output_format as plan_output_format
from fsdp_convert.prefetch import prefetch
from fsdp_convert.remote import local_output
from fsdp_convert.transform import OutputItem, TransformOptions
from fsdp_convert.writers import SafetensorsWriter, StateDictWriter, TorchSaveWriter, atomic_output
from fsdp_convert.writers._atomic import LeaveToOwner, check_output_free, writing
from fsdp_convert.writers.safetensors import ShardFile, write_hf_index

__all__ = ["ConsolidateResult", "consolidate"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsolidateResult:
    """What ``consolidate`` wrote.

    Attributes:
        output: the output file.
        output_format: ``torch_save`` or ``safetensors``.
        tensors: number of tensors written.
        values: number of plain values written (param group fields, train state).
        tensor_bytes: tensor data written, in bytes.
        file_bytes: size of the output file, in bytes.
        nproc: number of reading workers (all nodes).
        seconds: wall time, in seconds.
        owner: False in a process whose workers do not hold rank 0 (another node of a multi-node
            run, or a non-zero rank under the user's torchrun): it read and sent its share, and
            rank 0's process wrote the output (``file_bytes`` is then 0).
    """

    output: Location
    output_format: str
    tensors: int
    values: int
    tensor_bytes: int
    file_bytes: int
    nproc: int
    seconds: float
    owner: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class _ConsolidateJob:
    checkpoint_id: Location
    plan: WorkPlan
    tmp_output: Path
    progress: bool
    check_crc: bool


def _bar(desc: str, total: int, enabled: bool, position: int) -> tqdm:
    return tqdm(
        desc=desc,
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not enabled,
        file=sys.stderr,
        position=position,
    )


def _counted(bar: tqdm, nbytes: int, produce: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        value = produce()
        bar.update(nbytes)
        return value

    return run


def _read_item(reader: Reader, item: OutputItem) -> tuple[torch.Tensor, int | None]:
    """The item's full tensor in its output dtype, and the CRC-32 of its bytes when known."""
    assert isinstance(item.entry, TensorEntry)
    tensor, crc = reader.read_tensor_with_crc(item.entry)
    if item.dtype is not None and item.dtype != tensor.dtype:
        return tensor.to(item.dtype), None
    return tensor, crc


def _send_share(job: _ConsolidateJob, file: FilePlan, rank: int, transport: GlooTransport) -> None:
    """Non-zero ranks, for a file rank 0 writes: read this rank's tensors in file order, send to rank 0."""
    plan = job.plan
    with open_reader(job.checkpoint_id, check_crc=job.check_crc) as reader:
        for i in file.item_ids:
            item = plan.items[i]
            if plan.owners[i] == rank and item.is_tensor:
                transport.make_room(item.read_bytes)  # the tensor about to be read counts against the window
                transport.send(_read_item(reader, item)[0])
        transport.drain()


def _received(transport: GlooTransport, item: OutputItem, owner: int) -> tuple[torch.Tensor, None]:
    assert item.dtype is not None
    return transport.recv(item.shape, item.dtype, owner), None


def _value_job(reader: Reader, item: OutputItem) -> Callable[[], Any]:
    if item.constant:
        return lambda: item.value
    assert isinstance(item.entry, BytesEntry)
    return partial(reader.read_value, item.entry)


def _write_file(job: _ConsolidateJob, file: FilePlan, transport: GlooTransport | None) -> int:
    """Rank 0: read or receive every item of ``file`` in order and write it; returns its size in bytes."""
    plan = job.plan
    items = [plan.items[i] for i in file.item_ids]
    owners = [plan.owners[i] for i in file.item_ids]
    total = sum(item.nbytes for item in items)
    path = job.tmp_output if file.filename is None else job.tmp_output / file.filename
    with open_reader(job.checkpoint_id, check_crc=job.check_crc) as reader, ExitStack() as stack:
        read_bar = stack.enter_context(_bar("read", total, job.progress, 0))
        write_bar = stack.enter_context(_bar("write", total, job.progress, 1))
        jobs: list[tuple[int, Callable[[], Any]]] = []
        for item, owner in zip(items, owners, strict=True):
            if not item.is_tensor:
                jobs.append((0, _counted(read_bar, item.nbytes, _value_job(reader, item))))
            elif owner == 0:
                jobs.append((item.read_bytes, _counted(read_bar, item.nbytes, partial(_read_item, reader, item))))
            else:
                assert transport is not None
                jobs.append((item.nbytes, _counted(read_bar, item.nbytes, partial(_received, transport, item, owner))))
        writer = _open_writer(file.output_format, path, items, file.strip)
        # closing: on an error, stop the read-ahead thread here, not whenever the frame is freed
        values = stack.enter_context(closing(prefetch(jobs, plan.memory_budget_bytes)))
        try:
            for item, value in zip(items, values, strict=True):
                out_path = item.path[file.strip :]
                if not item.is_tensor:
                    writer.add_value(out_path, value)
                else:
                    tensor, crc = value
                    writer.add_tensor(out_path, tensor, crc)
                    del tensor
                write_bar.update(item.nbytes)
                del value  # free the tensor before the read-ahead budget is given back
            return writer.finish()
        except BaseException:
            writer.close()
            raise


def _write_shards(job: _ConsolidateJob, rank: int) -> None:
    """Folder output: write this rank's safetensors shards. No tensor goes through rank 0.

    Only rank 0 shows a bar (shards are balanced by bytes, so it stands for the whole job): one
    line, however many workers and nodes.
    """
    plan = job.plan
    mine = [s for s in plan.shards if s.owner == rank]
    desc = f"write ({len(mine)} of {len(plan.shards)} shards here)"
    with (
        open_reader(job.checkpoint_id, check_crc=job.check_crc) as reader,
        _bar(desc, sum(s.tensor_bytes for s in mine), job.progress and rank == 0, 0) as bar,
    ):
        for shard in mine:
            items = [plan.items[i] for i in shard.item_ids]
            writer = _open_writer("safetensors", job.tmp_output / shard.filename, items, 0)
            jobs = [(item.read_bytes, partial(_read_item, reader, item)) for item in items]
            try:
                with closing(prefetch(jobs, plan.memory_budget_bytes)) as values:
                    for item, (tensor, _) in zip(items, values, strict=True):
                        writer.add_tensor(item.path, tensor)
                        bar.update(item.nbytes)
                        del tensor
                writer.finish()
            except BaseException:
                writer.close()
                raise


def _open_writer(fmt: str, path: Path, items: list[OutputItem], strip: int) -> StateDictWriter:
    if fmt == "safetensors":
        layout = []
        for item in items:
            assert item.dtype is not None  # safetensors files hold tensors only (checked by the planner)
            layout.append((item.path[strip:], item.dtype, item.shape))
        return SafetensorsWriter(path, layout)
    return TorchSaveWriter(path)


def _consolidate_rank(job: _ConsolidateJob, rank: int, world_size: int, transport: GlooTransport | None) -> int | None:
    """One rank's share of a consolidation. Called on every rank.

    Folder outputs: each rank first writes its own safetensors shards. Files rank 0 writes (the
    single-file output, or a folder's ``optimizer.pt``): rank 0 walks the file's items in order,
    reading its own and receiving the others from their owners, and alone writes; the other ranks
    read their tensors in the same order and send them to rank 0.

    Returns:
        On rank 0, the output's size in bytes; ``None`` elsewhere.
    """
    plan = job.plan
    with writing(job.tmp_output):
        if plan.shards:
            _write_shards(job, rank)
        size = 0
        for file in plan.files:
            if rank != 0:
                assert transport is not None
                _send_share(job, file, rank, transport)
            else:
                size += _write_file(job, file, transport)
        if transport is not None:
            transport.barrier()
        if rank != 0:
            return None
        if plan.output_format != "hf_dir":
            return size
        if len(plan.shards) > 1:
            shards = [
                ShardFile(filename=s.filename, paths=tuple(plan.items[i].path for i in s.item_ids), tensor_bytes=s.tensor_bytes)
                for s in plan.shards
            ]
            write_hf_index(job.tmp_output / HF_INDEX_FILENAME, shards)
        return sum(p.stat().st_size for p in job.tmp_output.iterdir())


def consolidate(
    checkpoint_id: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    nproc: int | None = None,
    only: Only = "all",
    options: TransformOptions | None = None,
    output_format: RequestedFormat = "auto",
    overwrite: bool = False,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    check_crc: bool = True,
    verify_output: bool = False,
    progress: bool = False,
    cluster: Cluster | None = None,
) -> ConsolidateResult:
    """Write a DCP checkpoint as one full (unsharded) state dict: a file, or a folder of shards.

    Steps: read the index; classify its entries by producer layout and build the output items
    (wrapper names removed, renames, filters, optimizer re-keying, casts); plan (check coverage,
    balance tensors over workers by bytes); check the data files exist; read chunks into full
    tensors on the workers, overlapping reading with writing; write into a temporary sibling of
    ``output``; rename it into place.

    Args:
        checkpoint_id: the DCP checkpoint folder (or accelerate's parent folder of
            ``pytorch_model_fsdp_0/`` and ``optimizer_0/``).
        output: ``.pt``/``.pth``/``.bin`` for torch.save of the nested state dict
            (``{"model": {fqn: tensor}, "optim": {"state": {fqn: {...}}, "param_groups": [...]},
            ...}``, as ``get_model_state_dict``/``get_optimizer_state_dict`` with
            ``full_state_dict=True`` give it); ``.safetensors`` for the model weights in one file;
            a folder (no suffix) for the model weights as Hugging Face safetensors shards with
            ``model.safetensors.index.json``, plus ``optimizer.pt`` (the optimizer state dict) and
            ``extra_state.pt`` (other entries) when ``only`` is ``all``.
        nproc: reading workers; 1 runs in this process, more start workers with torch's
            elastic launcher (gloo on CPU). ``None``: ``plan.default_nproc`` (one per two CPU
            cores for a file, one per core for a folder; at most one per data file and 256 MiB).
        only: ``all``, ``model`` or ``optim``: which groups to write.
        options: key and dtype transforms (``TransformOptions``); default: wrapper names removed,
            optimizer state keyed by FQN, dtypes kept.
        output_format: ``auto`` (by suffix), ``torch`` or ``safetensors`` (see ``plan.output_format``).
        overwrite: replace an existing ``output`` (at the final rename only).
        memory_budget_bytes: read-ahead and transfer buffers each process may hold, in bytes.
            Peak memory per process is about this plus the largest tensor.
        max_shard_bytes: largest shard of a folder output, in bytes.
        check_crc: check the CRC-32 of every zip record of every payload read (torch does not).
            Sources without CRC-32s (safetensors shards, per-rank torch.save files, read through
            their storage records) are read as they are.
        verify_output: read the written output back and compare it with the checkpoint (through
            the same transforms), key by key, before moving it into place.
        progress: show tqdm bars (bytes, rate, ETA) on stderr.
        cluster: torchrun's multi-node options; every node calls ``consolidate`` with the same
            arguments and ``nproc`` workers per node, and the output (on storage every node
            reaches) is written by rank 0's node. Under the user's own torchrun (``RANK`` and
            ``WORLD_SIZE`` set) this process is one worker and ``nproc`` is ignored.

    Returns:
        What was written (``owner`` False on the processes that did not write).

    Raises:
        CheckpointNotFoundError, NotADcpCheckpointError, UnsafeContentError: unreadable index.
        InvalidOptionError: unknown suffix, optimizer state into a safetensors file, bad ``nproc``,
            two keys renamed to one.
        UnsupportedTransformError: ``optim_keys="ids"`` without param groups listing the parameters.
        OutputExistsError: ``output`` exists and ``overwrite`` is false.
        MissingDataFileError, CorruptChunkError, CoverageError, ShapeMismatchError: bad data files.
        OutputWriteError: the output cannot be written.
        WorkerFailedError: a worker died.
        VerificationError: ``verify_output`` found a difference (nothing is left at ``output``).
    """
    shared = shared_tag(cluster) is not None
    with local_output(output, overwrite=overwrite, shared=shared, last=(HF_INDEX_FILENAME,)) as (output, shown):
        start = time.monotonic()
        options = options or TransformOptions()
        index = read_index(checkpoint_id)
        fmt = plan_output_format(output, output_format)
        groups = groups_for(fmt, only)
        check_output_free(output, overwrite=overwrite, directory=fmt == "hf_dir")
        check_data_files(index)
        items = prepare_items(index, options, groups, check_crc=check_crc)
        plan = plan_consolidate(
            index,
            items,
            output,
            fmt=fmt,
            nproc=job_world_size(nproc, cluster),
            memory_budget_bytes=memory_budget_bytes,
            max_shard_bytes=max_shard_bytes,
            cpus=len(os.sched_getaffinity(0)),
        )
        owner = True
        with atomic_output(output, overwrite=overwrite, directory=fmt == "hf_dir", tag=shared_tag(cluster)) as tmp:
            job = _ConsolidateJob(
                checkpoint_id=index.checkpoint_id, plan=plan, tmp_output=tmp, progress=progress, check_crc=check_crc
            )
            owner, file_bytes = run_ranks(_consolidate_rank, job, plan.nproc, plan.memory_budget_bytes, cluster)
            if not owner:
                raise LeaveToOwner
            if verify_output:
                check = verify(index.checkpoint_id, tmp, only=only, check_crc=check_crc, options=options, in_process=True)
                if not check.equal:
                    d = check.differences[0]
                    raise VerificationError(
                        f"{output}: read back, {d.key} {d.detail} ({len(check.differences)} difference(s)); nothing was written"
                    )
        tensors = [item for item in plan.items if item.is_tensor]
        result = ConsolidateResult(
            output=output,
            output_format=plan.output_format,
            tensors=len(tensors),
            values=len(plan.items) - len(tensors),
            tensor_bytes=sum(item.nbytes for item in tensors),
            file_bytes=file_bytes if owner else 0,
            nproc=plan.nproc,
            seconds=time.monotonic() - start,
            owner=owner,
        )
        logger.info(
            "Consolidated %d tensors (%.1f MiB) into %s in %.1f s with %d worker(s)",
            result.tensors,
            result.tensor_bytes / 2**20,
            output,
            result.seconds,
            plan.nproc,
        )
    return dataclasses.replace(result, output=shown)
