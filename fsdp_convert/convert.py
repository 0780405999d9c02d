"""The operations: each a short function calling the stages in order (index, plan, read, write)."""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fsdp_convert.launch import GlooTransport, run_workers
from fsdp_convert.layout import Group, detect_producer, group_of
from fsdp_convert.metadata import BytesEntry, TensorEntry, read_index
from fsdp_convert.plan import Only, WorkPlan, plan_consolidate
from fsdp_convert.reader import ChunkReader, check_data_files
from fsdp_convert.writers import SafetensorsWriter, StateDictWriter, TorchSaveWriter, atomic_output
from fsdp_convert.writers._atomic import check_output_free

__all__ = ["EntrySummary", "InspectResult", "ConsolidateResult", "inspect_checkpoint", "consolidate"]

logger = logging.getLogger(__name__)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True, kw_only=True)
class EntrySummary:
    """One row of ``inspect``.

    Attributes:
        fqn: flattened key as stored.
        group: ``model``, ``optim`` or ``other`` (by top-level key).
        kind: ``tensor`` or ``bytes`` (a pickled plain value).
        shape: global shape in elements (``None`` for bytes).
        dtype: element type name, e.g. ``"bfloat16"`` (``None`` for bytes).
        chunks: number of stored chunks (1 for bytes).
        nbytes: tensor size (elements x item size) or payload size, in bytes.
    """

    fqn: str
    group: Group
    kind: str
    shape: tuple[int, ...] | None
    dtype: str | None
    chunks: int
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class InspectResult:
    """What ``.metadata`` says about a checkpoint; see ``inspect_checkpoint``."""

    checkpoint_id: Path
    producer: str
    world_size: int
    total_bytes: int
    data_files: tuple[str, ...]
    version: str | None
    entries: tuple[EntrySummary, ...]

    def to_json_dict(self) -> dict[str, Any]:
        """JSON-ready form: dtypes as strings, shapes as lists, ``schema_version`` 1."""
        groups: dict[str, list[dict[str, Any]]] = {g: [] for g in ("model", "optim", "other")}
        for e in self.entries:
            groups[e.group].append(
                {
                    "fqn": e.fqn,
                    "kind": e.kind,
                    "shape": None if e.shape is None else list(e.shape),
                    "dtype": e.dtype,
                    "chunks": e.chunks,
                    "bytes": e.nbytes,
                }
            )
        return {
            "schema_version": 1,
            "checkpoint": str(self.checkpoint_id),
            "producer": self.producer,
            "world_size": self.world_size,
            "total_bytes": self.total_bytes,
            "data_files": list(self.data_files),
            "dcp_version": self.version,
            "groups": groups,
        }


def inspect_checkpoint(checkpoint_id: str | os.PathLike[str]) -> InspectResult:
    """Describe a DCP checkpoint from its ``.metadata`` alone (no data file is opened).

    Args:
        checkpoint_id: the checkpoint folder.

    Returns:
        Producer, world size (distinct writer ranks), total bytes, data files, and one
        ``EntrySummary`` per entry in the producer's order.

    Raises:
        CheckpointNotFoundError, NotADcpCheckpointError, UnsafeContentError: see ``read_index``.
    """
    index = read_index(checkpoint_id)
    rows = []
    for e in index.entries:
        if isinstance(e, TensorEntry):
            rows.append(
                EntrySummary(
                    fqn=e.fqn,
                    group=group_of(e),
                    kind="tensor",
                    shape=e.shape,
                    dtype=_dtype_name(e.dtype),
                    chunks=len(e.chunks),
                    nbytes=e.nbytes,
                )
            )
        else:
            rows.append(
                EntrySummary(fqn=e.fqn, group=group_of(e), kind="bytes", shape=None, dtype=None, chunks=1, nbytes=e.nbytes)
            )
    return InspectResult(
        checkpoint_id=index.checkpoint_id,
        producer=detect_producer(index),
        world_size=index.world_size,
        total_bytes=index.total_bytes,
        data_files=index.data_files,
        version=index.version,
        entries=tuple(rows),
    )


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
        nproc: number of reading workers.
        seconds: wall time, in seconds.
    """

    output: Path
    output_format: str
    tensors: int
    values: int
    tensor_bytes: int
    file_bytes: int
    nproc: int
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class _ConsolidateJob:
    checkpoint_id: Path
    plan: WorkPlan
    tmp_output: Path
    progress: bool


def _open_writer(plan: WorkPlan, path: Path) -> StateDictWriter:
    if plan.output_format == "safetensors":
        layout = [(e.path, e.dtype, e.shape) for e in plan.entries if isinstance(e, TensorEntry)]
        return SafetensorsWriter(path, layout)
    return TorchSaveWriter(path)


def _consolidate_rank(job: _ConsolidateJob, rank: int, world_size: int, transport: GlooTransport | None) -> int | None:
    """One rank's share of a consolidation. Called on every rank; rank 0 alone writes.

    Rank 0 walks the plan in output order, reading its own tensors and receiving the others from
    their owners; every other rank reads its tensors in the same order and sends them to rank 0.

    Returns:
        On rank 0, the output file's size in bytes; ``None`` elsewhere.
    """
    plan = job.plan
    with ChunkReader(job.checkpoint_id) as reader:
        if rank != 0:
            assert transport is not None
            for entry, owner in zip(plan.entries, plan.owners, strict=True):
                if owner == rank and isinstance(entry, TensorEntry):
                    transport.send(reader.read_tensor(entry))
            transport.drain()
            return None
        writer = _open_writer(plan, job.tmp_output)
        try:
            with tqdm(total=plan.total_bytes, unit="B", unit_scale=True, disable=not job.progress, file=sys.stderr) as bar:
                for entry, owner in zip(plan.entries, plan.owners, strict=True):
                    if isinstance(entry, BytesEntry):
                        writer.add_value(entry.path, reader.read_value(entry))
                    elif owner == 0:
                        writer.add_tensor(entry.path, reader.read_tensor(entry))
                    else:
                        assert transport is not None
                        writer.add_tensor(entry.path, transport.recv(entry.shape, entry.dtype, owner))
                    bar.update(entry.nbytes)
            return writer.finish()
        except BaseException:
            writer.close()
            raise


def consolidate(
    checkpoint_id: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    nproc: int = 1,
    only: Only = "all",
    overwrite: bool = False,
    progress: bool = False,
) -> ConsolidateResult:
    """Write a DCP checkpoint as one full (unsharded) state dict file.

    Steps: read the index; plan (select entries, check coverage, balance tensors over workers
    by bytes); check the data files exist; read chunks into full tensors on the workers and hand
    them to rank 0, which writes them in the producer's order into a temporary sibling of
    ``output``; rename into place.

    Args:
        checkpoint_id: the DCP checkpoint folder.
        output: ``.pt``/``.pth``/``.bin`` for torch.save of the nested state dict
            (``{"model": {fqn: tensor}, "optim": {"state": {fqn: {...}}, "param_groups": [...]},
            ...}``, as ``get_model_state_dict``/``get_optimizer_state_dict`` with
            ``full_state_dict=True`` give it); ``.safetensors`` for the model weights alone.
        nproc: reading workers; 1 runs in this process, more start workers with torch's
            elastic launcher (gloo on CPU).
        only: ``all``, ``model`` or ``optim``: which top-level groups to write.
        overwrite: replace an existing ``output`` (at the final rename only).
        progress: show a tqdm bar on stderr.

    Returns:
        What was written.

    Warning:
        Rank 0 holds one full tensor at a time, and each worker up to its send window
        (``GlooTransport.window_bytes``) of tensors in flight.

    Raises:
        CheckpointNotFoundError, NotADcpCheckpointError, UnsafeContentError: unreadable index.
        InvalidOptionError: unknown suffix, optimizer state into safetensors, bad ``nproc``.
        OutputExistsError: ``output`` exists and ``overwrite`` is false.
        MissingDataFileError, CorruptChunkError, CoverageError, ShapeMismatchError,
        UnsupportedTransformError: bad data files.
        OutputWriteError: the output cannot be written.
        WorkerFailedError: a worker died.
    """
    start = time.monotonic()
    output = Path(output)
    index = read_index(checkpoint_id)
    plan = plan_consolidate(index, output, only=only, nproc=nproc)
    check_output_free(output, overwrite=overwrite)
    check_data_files(index)
    with atomic_output(output, overwrite=overwrite) as tmp:
        job = _ConsolidateJob(checkpoint_id=index.checkpoint_id, plan=plan, tmp_output=tmp, progress=progress)
        if nproc == 1:
            file_bytes = _consolidate_rank(job, 0, 1, None)
        else:
            file_bytes = run_workers(_consolidate_rank, job, nproc)
    assert file_bytes is not None
    tensors = [e for e in plan.entries if isinstance(e, TensorEntry)]
    result = ConsolidateResult(
        output=output,
        output_format=plan.output_format,
        tensors=len(tensors),
        values=len(plan.entries) - len(tensors),
        tensor_bytes=sum(e.nbytes for e in tensors),
        file_bytes=file_bytes,
        nproc=nproc,
        seconds=time.monotonic() - start,
    )
    logger.info(
        "Consolidated %d tensors (%.1f MiB) into %s in %.1f s",
        result.tensors,
        result.tensor_bytes / 2**20,
        output,
        result.seconds,
    )
    return result
