"""One worker's share of a reshard (``ops.reshard``), called on every worker of the job.

Each worker moves its chunks' bytes into their payloads' byte ranges in the target rank files
(``move.move_all``), writes each payload's zip headers around them and logs them for ``--resume``
(``resume.begin_share``); rank 0 appends the values (bytes entries) to its own file. Rank 0's
process writes ``.metadata`` once every worker is done (``ops.reshard``).
"""

from __future__ import annotations

import io
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_convert.formats import Source
from fsdp_convert.formats.index import BytesEntry, TensorEntry, dcp_key
from fsdp_convert.launch import WorkerGroup, worker_bars
from fsdp_convert.move import MoveJob, move_all, mover_threads, pwrite_all
from fsdp_convert.pieces import Piece, range_crc
from fsdp_convert.plan.consolidate import DEFAULT_MEMORY_BUDGET_BYTES, mover_buffers
from fsdp_convert.plan.reshard import PayloadPlan, ReshardPlan
from fsdp_convert.resume import ResumeState, begin_share
from fsdp_convert.writers.dcp import StoredChunk, rank_filename
from fsdp_convert.writers.torch_save import TensorSlot, write_tensor_payload_headers
from fsdp_convert.writers.transaction import is_plain, value_payload, writing

__all__ = ["ReshardJob", "reshard_rank"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshardJob:
    """What every worker of a reshard needs: the plans, where to write, and a resumable output's state.

    Attributes:
        source: the source read (its format and index, decided once; ``Source.open_reader``).
        plans: (folder relative to the output, its plan), one per DCP folder of the output.
        tmp_output: the temporary output folder written.
        check_crc: check the CRC-32s of the source payloads.
        resume: a resumable output's (``resume.begin_share``); None: no manifest (object storage).
        files: a wave's (folder, target rank) data files (``ops._waves``); None: all.
        progress: a ``write`` bar of the whole job's tensor bytes on stderr, drawn by rank 0's worker.
    """

    source: Source
    plans: tuple[tuple[str, ReshardPlan], ...]
    tmp_output: Path
    check_crc: bool
    resume: ResumeState | None = None
    files: frozenset[tuple[int, int]] | None = None
    progress: bool = False


def _payload(value: Any) -> bytes:
    """A value as DCP stores a bytes entry: a torch.save payload.

    A plain value (``writers._dcp_pickle.is_plain``: no tensor in it) is written without torch,
    byte for byte as torch.save writes it; any other (a tensor in it: torch is loaded already) by torch.save.
    """
    if is_plain(value):
        return value_payload(value)
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _move_job(plan: ReshardPlan, payload: PayloadPlan, fd: int, file: int) -> MoveJob:
    item = plan.items[payload.item]
    assert isinstance(item.entry, TensorEntry) and item.dtype is not None
    chunk = payload.chunk
    rows = (chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]) if chunk.sizes else None
    offset = payload.offset + payload.placement.data_offset
    return MoveJob(
        entry=item.entry,
        dtype=item.dtype,
        file=file,
        fd=fd,
        offset=offset,
        rows=rows,
        derived=item.derived,
        sources=item.sources,
    )


def _write_values(job: ReshardJob, plan: ReshardPlan, fd: int) -> list[StoredChunk]:
    """Rank 0: append every value's payload to rank 0's data file after its tensor chunks."""
    stored, at = [], plan.values_offset
    with job.source.open_reader() as reader:
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


def reshard_rank(
    job: ReshardJob, worker: int, world_size: int, group: WorkerGroup | None
) -> dict[str, list[dict[str, Any]]] | None:
    """Move this worker's chunks into their payloads and write each payload's headers; rank 0 appends the values.

    Called on every worker. Every folder of the output (one, or accelerate's two) is written in
    the same pass, each with its own rank files. With ``job.progress``, rank 0's worker draws a
    ``write`` bar of every worker's bytes, its last frame once every worker is done.

    Returns:
        On rank 0, per output folder, where every value's payload went (``StoredChunk.to_json``
        rows); None elsewhere.
    """
    with writing(job.tmp_output), ExitStack() as stack:
        fds: dict[tuple[int, int], int] = {}  # (folder, target rank) -> its data file
        for p, (sub, plan) in enumerate(job.plans):
            folder = job.tmp_output / sub
            folder.mkdir(exist_ok=True)
            for rank in (r for r in plan.data_ranks if job.files is None or (p, r) in job.files):
                fds[p, rank] = os.open(folder / rank_filename(rank), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
                stack.callback(os.close, fds[p, rank])
        mine = {}
        for p, (_, plan) in enumerate(job.plans):
            for payload in plan.payloads:
                if payload.owner == worker:
                    rank = payload.chunk.rank
                    move = _move_job(plan, payload, fds[p, rank], file=p * plan.target_world_size + rank)
                    mine[(move.file, move.offset)] = (move, payload)

        def headers(moved: MoveJob, pieces: list[Piece]) -> int:
            """Write the payload's zip headers around its moved bytes; their CRC-32."""
            payload = mine[(moved.file, moved.offset)][1]
            crc = range_crc(moved.fd, {p.offset: p for p in pieces}, moved.offset, moved.nbytes)
            slot = TensorSlot(moved.dtype, payload.chunk.sizes)
            write_tensor_payload_headers(moved.fd, payload.offset, slot, crc)
            return crc

        bars = worker_bars(job.progress, worker, group)
        moves = [move for move, _ in mine.values()]
        todo, skipped, log = begin_share(job.tmp_output, job.resume, worker, group, moves, stack, bars)
        job_bytes = sum(_move_job(plan, p, -1, 0).nbytes for _, plan in job.plans for p in plan.payloads) if job.progress else 0
        progress = stack.enter_context(bars.step("write", "write", job_bytes, sum(move.nbytes for move in moves)))
        progress.keep(sum(moved.nbytes for moved, _ in skipped))
        for moved, piece in skipped:  # kept from an interrupted run: their headers are rewritten
            headers(moved, [piece])

        def write_headers(moved: MoveJob, pieces: list[Piece]) -> None:
            crc = headers(moved, pieces)
            if log is not None:
                log.record(moved, crc)  # the CRC-32 the headers hold, combined once

        threads, piece_bytes = mover_buffers(DEFAULT_MEMORY_BUDGET_BYTES)
        move_all(
            job.source.open_reader,
            todo,
            threads=mover_threads(todo, threads),
            piece_bytes=piece_bytes,
            on_done=write_headers,
            on_bytes=progress.advance,
        )
        if log is not None:
            log.flush()  # this share's records are logged before rank 0 writes .metadata
        values: dict[str, list[dict[str, Any]]] = {}
        if worker == 0:
            for p, (sub, plan) in enumerate(job.plans):
                rows = _write_values(job, plan, fds[p, 0]) if (p, 0) in fds else []
                values[sub] = [c.to_json() for c in rows]
        for fd in fds.values():
            os.fsync(fd)
        progress.flush()  # every worker's bytes are counted before the barrier
        if group is not None:
            group.barrier()
        progress.close()  # rank 0: the last frame, of every worker's bytes
        return values if worker == 0 else None
