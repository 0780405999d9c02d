"""Operation ``reshard``: index, transform, plan (every rank file laid out), workers move the chunks in place; ``.metadata`` last.

The plan gives every tensor chunk's torch.save payload a byte range in its target rank's data
file and a worker, balanced by bytes. Each worker moves its chunks' bytes there (``move``) and
writes each payload's zip headers around them; rank 0 appends the values (bytes entries) to its
own file, and its process writes ``.metadata`` once every worker is done. No tensor crosses
between workers.
"""

from __future__ import annotations

import dataclasses
import io
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fsdp_convert.constants import METADATA_FILENAME
from fsdp_convert.formats import check_data_files, open_reader, read_index
from fsdp_convert.formats.index import BytesEntry, Location, TensorEntry, dcp_key
from fsdp_convert.items import prepare_items
from fsdp_convert.launch import Cluster, WorkerGroup, job_world_size, run_ranks, shared_tag
from fsdp_convert.layout import GROUPS
from fsdp_convert.move import MoveJob, Piece, move_all, pwrite_all, range_crc
from fsdp_convert.plan import DEFAULT_MEMORY_BUDGET_BYTES, default_nproc, mover_buffers
from fsdp_convert.remote import as_location, local_output
from fsdp_convert.reshard_plan import PayloadPlan, ReshardPlan, plan_reshard
from fsdp_convert.transform import TransformOptions
from fsdp_convert.writers import atomic_output
from fsdp_convert.writers._atomic import LeaveToOwner, check_output_free, writing
from fsdp_convert.writers.dcp import MetadataEntry, StoredChunk, rank_filename, write_metadata
from fsdp_convert.writers.torch_save import TensorSlot, write_tensor_payload_headers

__all__ = ["ReshardResult", "reshard"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshardResult:
    """What ``reshard`` wrote.

    Attributes:
        output: the output DCP folder.
        target_world_size: ranks it is laid out for (one data file each, if it holds chunks).
        chunks: tensor chunks written.
        file_bytes: size of the data files and ``.metadata``, in bytes.
        nproc: writing workers.
        seconds: wall time, in seconds.
        owner: False in a process that did not write ``.metadata`` (see ``ConsolidateResult``).
    """

    output: Location
    target_world_size: int
    chunks: int
    file_bytes: int
    nproc: int
    seconds: float
    owner: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class _ReshardJob:
    checkpoint_id: Location
    plan: ReshardPlan
    tmp_output: Path
    check_crc: bool


def _payload(value: Any) -> bytes:
    """A plain value as DCP stores a bytes entry: a torch.save payload."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _move_job(plan: ReshardPlan, payload: PayloadPlan, fd: int) -> MoveJob:
    item = plan.items[payload.item]
    assert isinstance(item.entry, TensorEntry) and item.dtype is not None
    chunk = payload.chunk
    rows = (chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]) if chunk.sizes else None
    return MoveJob(
        entry=item.entry, dtype=item.dtype, file=chunk.rank, fd=fd, offset=payload.offset + payload.layout.data_offset, rows=rows
    )


def _write_values(job: _ReshardJob, fd: int) -> list[StoredChunk]:
    """Rank 0: append every value's payload to rank 0's data file after its tensor chunks."""
    plan = job.plan
    stored, at = [], plan.values_offset
    with open_reader(job.checkpoint_id, check_crc=job.check_crc, full_files=True) as reader:
        for item in plan.items:
            if item.is_tensor:
                continue
            if item.constant:
                raw = _payload(item.value)
            else:
                assert isinstance(item.entry, BytesEntry)
                raw = reader.read_raw(item.entry)
            pwrite_all(fd, memoryview(raw), at)
            stored.append(StoredChunk(dcp_key(item.path), None, rank_filename(0), at, len(raw)))
            at += len(raw)
    return stored


def _reshard_rank(job: _ReshardJob, worker: int, world_size: int, group: WorkerGroup | None) -> list[dict[str, Any]] | None:
    """Move this worker's chunks into their payloads and write each payload's headers; rank 0 appends the values.

    Returns:
        On rank 0, where every value's payload went (``StoredChunk.to_json`` rows); None elsewhere.
    """
    plan = job.plan
    with writing(job.tmp_output), ExitStack() as stack:
        fds: dict[int, int] = {}
        for rank in plan.data_ranks:
            fds[rank] = os.open(job.tmp_output / rank_filename(rank), os.O_RDWR | os.O_CREAT, 0o644)
            stack.callback(os.close, fds[rank])
        mine = {}
        for payload in plan.payloads:
            if payload.owner == worker:
                move = _move_job(plan, payload, fds[payload.chunk.rank])
                mine[(move.file, move.offset)] = (move, payload)

        def write_headers(moved: MoveJob, pieces: list[Piece]) -> None:
            payload = mine[(moved.file, moved.offset)][1]
            crc = range_crc(moved.fd, {p.offset: p for p in pieces}, moved.offset, moved.nbytes)
            slot = TensorSlot(moved.dtype, payload.chunk.sizes)
            write_tensor_payload_headers(moved.fd, payload.offset, slot, crc)

        threads, piece_bytes = mover_buffers(DEFAULT_MEMORY_BUDGET_BYTES)
        move_all(
            partial(open_reader, job.checkpoint_id, check_crc=job.check_crc, full_files=True),
            [move for move, _ in mine.values()],
            threads=threads,
            piece_bytes=piece_bytes,
            on_done=write_headers,
        )
        values = _write_values(job, fds[0]) if worker == 0 and 0 in fds else []
        for fd in fds.values():
            os.fsync(fd)
        if group is not None:
            group.barrier()
        return [c.to_json() for c in values] if worker == 0 else None


def _write_index(folder: Path, plan: ReshardPlan, values: list[StoredChunk], version: str | None) -> int:
    """Rank 0's process, once every worker is done: write ``.metadata``; return the folder's size in bytes."""
    stored = [
        StoredChunk(dcp_key(plan.items[p.item].path), p.chunk.offsets, rank_filename(p.chunk.rank), p.offset, p.layout.size)
        for p in plan.payloads
    ]
    entries = [
        MetadataEntry(
            fqn=dcp_key(item.path),
            path=item.path,
            dtype=item.dtype if item.is_tensor else None,
            shape=item.shape if item.is_tensor else None,
            chunks=chunks,
        )
        for item, chunks in zip(plan.items, plan.chunks, strict=True)
    ]
    write_metadata(folder, entries, stored + values, version)
    return sum(p.stat().st_size for p in folder.iterdir())


def reshard(
    checkpoint_id: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    world_size: int,
    nproc: int | None = None,
    options: TransformOptions | None = None,
    overwrite: bool = False,
    check_crc: bool = True,
    cluster: Cluster | None = None,
) -> ReshardResult:
    """Lay a checkpoint out for ``world_size`` ranks: a new DCP folder any DCP loader reads.

    The source is a DCP folder (any world size), or a full checkpoint: a torch.save file
    (``.pt``/``.pth``/``.bin``, read with ``weights_only=True, mmap=True``), a safetensors file or
    a Hugging Face folder, whose nesting (or flat names) the output keeps.

    Every tensor is split on dim 0 in ``torch.chunk(world_size)`` order, rank r's chunks in
    ``__r_0.distcp`` (the layout of FSDP2's ``Shard(0)``), so at that world size each rank reads
    only its own file; 0-dim and replicated tensors stay whole and bytes entries are carried over
    unchanged, both in rank 0's file. ``.metadata`` is written last.

    Args:
        checkpoint_id: the source: a DCP folder, a full torch.save or safetensors file, or an HF folder.
        output: the output folder.
        world_size: the target world size.
        nproc: workers, each moving its share of the chunks (balanced by bytes) into any rank
            file; default ``plan.default_nproc`` (one per CPU core, at most one per data file and 2 GiB).
        options: key and dtype transforms, as for ``consolidate``; the output keeps the source's
            nesting (``{"model": ..., "optim": ...}``, torchtitan's top-level weights...), so the
            producer's own loader reads it.
        overwrite: replace an existing ``output`` (at the final rename only).
        check_crc: check CRC-32s of the source payloads.
        cluster: torchrun's multi-node options, as for ``consolidate``; rank 0's node writes ``.metadata``.

    Raises:
        As ``consolidate``, and InvalidOptionError for ``world_size < 1``.
    """
    shared = shared_tag(cluster) is not None
    with local_output(output, overwrite=overwrite, shared=shared, last=(METADATA_FILENAME,)) as (output, shown):
        start = time.monotonic()
        source = as_location(checkpoint_id)
        index = read_index(source, full_files=True)  # a DCP-like folder, or a full file / HF folder
        check_output_free(output, overwrite=overwrite, directory=True)
        check_data_files(index)
        items = prepare_items(index, options or TransformOptions(), GROUPS, check_crc=check_crc, keep_layout=True)
        workers = job_world_size(nproc, cluster) or default_nproc(
            sum(item.nbytes for item in items), len(index.data_files) or 1, len(os.sched_getaffinity(0))
        )
        plan = plan_reshard(index, items, world_size, nproc=workers)
        owner, file_bytes = False, 0
        with atomic_output(output, overwrite=overwrite, directory=True, tag=shared_tag(cluster)) as tmp:
            job = _ReshardJob(checkpoint_id=index.checkpoint_id, plan=plan, tmp_output=tmp, check_crc=check_crc)
            owner, values = run_ranks(_reshard_rank, job, plan.nproc, cluster)
            if not owner:
                raise LeaveToOwner
            file_bytes = _write_index(tmp, plan, [StoredChunk.from_json(row) for row in values], index.version)
        chunks = sum(len(c) for item, c in zip(plan.items, plan.chunks, strict=True) if item.is_tensor)
        result = ReshardResult(
            output=output,
            target_world_size=world_size,
            chunks=chunks,
            file_bytes=file_bytes,
            nproc=plan.nproc,
            seconds=time.monotonic() - start,
            owner=owner,
        )
    return dataclasses.replace(result, output=shown)
