"""Operation ``reshard``: index, transform, plan, then each worker writes whole rank files (launch); ``.metadata`` last.

Each worker writes its target ranks' data files and records where every payload went in
``.records-<rank>`` (``StoredChunk.to_json`` rows); the process holding rank 0 gathers them into
``.metadata`` once every worker is done.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp_convert.constants import METADATA_FILENAME
from fsdp_convert.formats import check_data_files, open_reader, read_index
from fsdp_convert.formats.index import BytesEntry, Location, dcp_key
from fsdp_convert.items import prepare_items
from fsdp_convert.launch import Cluster, GlooTransport, job_world_size, run_ranks, shared_tag
from fsdp_convert.layout import GROUPS
from fsdp_convert.plan import DEFAULT_MEMORY_BUDGET_BYTES, ReshardPlan, plan_reshard
from fsdp_convert.remote import as_location, local_output
from fsdp_convert.transform import TransformOptions
from fsdp_convert.writers import atomic_output
from fsdp_convert.writers._atomic import LeaveToOwner, check_output_free, writing
from fsdp_convert.writers.dcp import MetadataEntry, RankFileWriter, StoredChunk, rank_filename, write_metadata

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


def _reshard_rank(job: _ReshardJob, worker: int, world_size: int, transport: GlooTransport | None) -> None:
    """Write the rank files of ``worker``'s target ranks; their records go to ``.records-<rank>``."""
    plan = job.plan
    reader = open_reader(job.checkpoint_id, check_crc=job.check_crc, full_files=True)
    with reader, writing(job.tmp_output):
        for rank in plan.ranks_of(worker):
            out = RankFileWriter(job.tmp_output, rank)
            try:
                for item, chunks in zip(plan.items, plan.chunks, strict=True):
                    for chunk in chunks:
                        if chunk.rank != rank:
                            continue
                        fqn = dcp_key(item.path)
                        if item.constant:
                            out.add_raw(fqn, _payload(item.value))
                        elif isinstance(item.entry, BytesEntry):
                            out.add_raw(fqn, reader.read_raw(item.entry))
                        else:
                            box = reader.read_box(item.entry, chunk.offsets, chunk.sizes)
                            out.add_box(fqn, chunk.offsets, box if box.dtype == item.dtype else box.to(item.dtype))
                out.finish()
            except BaseException:
                out.close()
                raise
            # our own records for the parent, which writes .metadata once every rank is done
            _records_path(job.tmp_output, rank).write_text(json.dumps([c.to_json() for c in out.stored]))


def _records_path(folder: Path, rank: int) -> Path:
    return folder / f".records-{rank}"


def _write_index(folder: Path, plan: ReshardPlan, version: str | None) -> int:
    """Rank 0's process, once every rank file is written: gather the workers' records into ``.metadata``.

    Removes the records and the data files of ranks that hold nothing; returns the folder's size
    in bytes (data files and ``.metadata``).
    """
    stored: list[StoredChunk] = []
    for rank in range(plan.target_world_size):
        records = _records_path(folder, rank)
        stored += [StoredChunk.from_json(row) for row in json.loads(records.read_text())]
        records.unlink()
    for rank in range(plan.target_world_size):  # a rank that holds nothing needs no file
        data_file = folder / rank_filename(rank)
        if data_file.stat().st_size == 0:
            data_file.unlink()
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
    write_metadata(folder, entries, stored, version)
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
        nproc: writing workers (each writes whole rank files); default 1.
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
        workers = job_world_size(nproc, cluster)
        plan = plan_reshard(index, items, world_size, nproc=workers)
        owner, file_bytes = False, 0
        with atomic_output(output, overwrite=overwrite, directory=True, tag=shared_tag(cluster)) as tmp:
            job = _ReshardJob(checkpoint_id=index.checkpoint_id, plan=plan, tmp_output=tmp, check_crc=check_crc)
            size = workers if shared_tag(cluster) else plan.nproc  # a shared job's plan may idle some workers
            owner, _ = run_ranks(_reshard_rank, job, size or plan.nproc, DEFAULT_MEMORY_BUDGET_BYTES, cluster)
            if not owner:
                raise LeaveToOwner
            file_bytes = _write_index(tmp, plan, index.version)
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
