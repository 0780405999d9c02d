"""One rank's share of a consolidation (``ops.consolidate``), called on every rank of the job.

Every rank opens the output files, moves its own tensors' bytes into place (``move.move_all``),
logs them for ``--resume`` (``resume.begin_share``) and fsyncs; rank 0 gathers every rank's
pieces (offsets and CRC-32s only), reads the plain values, and writes each file's headers, pickle
and central directory, then the folder's index.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_convert.formats import Reader, Source
from fsdp_convert.formats.index import BytesEntry, TensorEntry
from fsdp_convert.item import OutputItem
from fsdp_convert.launch import WorkerGroup, worker_bars
from fsdp_convert.move import MoveJob, move_all, mover_threads
from fsdp_convert.pieces import Piece, range_crc
from fsdp_convert.plan.consolidate import FilePlan, WorkPlan
from fsdp_convert.resume import ResumeState, begin_share
from fsdp_convert.writers.transaction import writing

__all__ = ["ConsolidateJob", "consolidate_rank"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsolidateJob:
    """What every worker of a consolidation needs: the plan, where to write, and a resumable output's state.

    Attributes:
        source: the checkpoint read (its format and index, decided once; ``Source.open_reader``).
        plan: the placed output (its kind finishes each file and the folder).
        tmp_output: the temporary output written.
        progress: a ``write`` bar of the whole job's tensor bytes on stderr, drawn by rank 0's worker.
        check_crc: check the CRC-32 of every payload read.
        resume: a resumable output's (``resume.begin_share``); None: no manifest (object storage).
        index: write the folder's index (a wave of an output to object storage does not).
    """

    source: Source
    plan: WorkPlan
    tmp_output: Path
    progress: bool
    check_crc: bool
    resume: ResumeState | None = None
    index: bool = True

    def for_rank(self, rank: int) -> ConsolidateJob:
        """The job as worker ``rank`` gets it (``_local_workers.run_local``): chunks only of the tensors it moves.

        Each worker unpickles its share of the index's chunks, not all of them (a 1024-rank
        checkpoint holds millions); every entry keeps its name, shape and dtype, which rank 0
        writes the headers from.
        """
        plan = self.plan
        moved = {
            id(e)
            for item, owner in zip(plan.items, plan.owners, strict=True)
            if owner == rank
            for e in (item.entry, *item.sources)
        }
        trimmed: dict[int, TensorEntry] = {}

        def trim(entry: Any) -> Any:
            if not isinstance(entry, TensorEntry) or id(entry) in moved or not entry.chunks:
                return entry
            if id(entry) not in trimmed:
                trimmed[id(entry)] = dataclasses.replace(entry, chunks=())
            return trimmed[id(entry)]

        items = tuple(dataclasses.replace(i, entry=trim(i.entry), sources=tuple(map(trim, i.sources))) for i in plan.items)
        index = dataclasses.replace(self.source.index, entries=tuple(map(trim, self.source.index.entries)))
        source = dataclasses.replace(self.source, index=index)
        return dataclasses.replace(self, source=source, plan=dataclasses.replace(plan, items=items))


def _tensor_bytes(plan: WorkPlan) -> int:
    """Bytes of every tensor the plan writes (every worker's move jobs), in bytes."""
    return sum(
        plan.items[i].nbytes
        for file in plan.files
        for i, offset in zip(file.item_ids, file.data_offsets, strict=True)
        if plan.items[i].is_tensor and offset is not None
    )


def _file_path(job: ConsolidateJob, file: FilePlan) -> Path:
    return job.tmp_output if file.filename is None else job.tmp_output / file.filename


def _move_jobs(job: ConsolidateJob, rank: int, fds: list[int]) -> list[MoveJob]:
    """This rank's tensors, file by file in file order."""
    plan = job.plan
    jobs = []
    for f, file in enumerate(plan.files):
        for i, offset in zip(file.item_ids, file.data_offsets, strict=True):
            item = plan.items[i]
            if item.is_tensor and plan.owners[i] == rank:
                assert isinstance(item.entry, TensorEntry) and item.dtype is not None and offset is not None
                jobs.append(
                    MoveJob(
                        entry=item.entry,
                        dtype=item.dtype,
                        file=f,
                        fd=fds[f],
                        offset=offset,
                        derived=item.derived,
                        sources=item.sources,
                    )
                )
    return jobs


def _no_log(moved: MoveJob, written: list[Piece]) -> None:
    """``move_all``'s ``on_done`` for an output without a record log."""


def _value(reader: Reader, item: OutputItem) -> Any:
    if item.constant:
        return item.value
    assert isinstance(item.entry, BytesEntry)
    return reader.read_value(item.entry)


def _finish_file(job: ConsolidateJob, f: int, fd: int, pieces: list[Piece], reader: Reader) -> None:
    """Rank 0, once every worker's tensors are in place: the file's kind writes the rest (``FileKind.finish_file``); fsync."""
    file = job.plan.files[f]
    by_offset = {p.offset: p for p in pieces if p.file == f}
    file.kind.finish_file(
        fd,
        file,
        job.plan.items,
        lambda offset, nbytes: range_crc(fd, by_offset, offset, nbytes),
        lambda item: _value(reader, item),
    )
    os.fsync(fd)


def _open_files(job: ConsolidateJob, rank: int, stack: ExitStack) -> list[int]:
    """Open (creating) every output file; rank 0 sizes each to the end of its data."""
    fds = []
    for file in job.plan.files:
        fd = os.open(_file_path(job, file), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        stack.callback(os.close, fd)
        fds.append(fd)
        ends = [o + job.plan.items[i].nbytes for i, o in zip(file.item_ids, file.data_offsets, strict=True) if o is not None]
        if rank == 0 and ends:
            os.ftruncate(fd, max(os.fstat(fd).st_size, max(ends)))
    return fds


def consolidate_rank(job: ConsolidateJob, rank: int, world_size: int, group: WorkerGroup | None) -> int | None:
    """One rank's share of a consolidation. Called on every rank.

    Every rank moves its own tensors into place in the output files (``move.move_all``) and
    fsyncs them; rank 0 gathers every rank's pieces (offsets and CRC-32s only), reads the plain
    values, and has each file's kind finish it (headers, pickle), then the folder's index.
    With ``job.progress``, rank 0's worker draws a ``write`` bar of every rank's bytes, its last
    frame once every rank's pieces are gathered.

    Returns:
        On rank 0, the output's size in bytes; ``None`` elsewhere.
    """
    plan = job.plan
    with writing(job.tmp_output), ExitStack() as stack:
        fds = _open_files(job, rank, stack)
        jobs = _move_jobs(job, rank, fds)
        bars = worker_bars(job.progress, rank, group)
        jobs, skipped, log = begin_share(job.tmp_output, job.resume, rank, group, jobs, stack, bars)  # records kept, the log
        kept_bytes = sum(moved.nbytes for moved, _ in skipped)
        job_bytes = _tensor_bytes(plan) if job.progress else 0
        progress = stack.enter_context(bars.step("write", "write", job_bytes, sum(j.nbytes for j in jobs) + kept_bytes))
        progress.keep(kept_bytes)
        pieces = move_all(
            job.source.open_reader,
            jobs,
            threads=mover_threads(jobs, plan.threads),
            piece_bytes=plan.piece_bytes,
            drop_cache=plan.drop_cache,
            on_done=log if log is not None else _no_log,
            on_bytes=progress.advance,
        )
        pieces += [piece for _, piece in skipped]
        if log is not None:
            log.flush()  # this share's records are logged before rank 0 writes the headers
        for fd in fds:
            os.fsync(fd)
        progress.flush()  # every rank's bytes are counted before rank 0 gathers
        if group is None:  # one rank: its pieces are all of them
            everything = pieces
        else:
            rows = [[p.file, p.offset, p.nbytes, p.crc32] for p in pieces] if rank != 0 else []  # rank 0 keeps its own
            gathered = group.gather(rows)
            if gathered is None:
                return None
            everything = pieces + [Piece(*map(int, row)) for share in gathered[1:] for row in share]
        progress.close()  # rank 0: the last frame, of every rank's bytes
        with job.source.open_reader() as reader:
            for f, fd in enumerate(fds):
                _finish_file(job, f, fd, everything, reader)
        if job.index:
            plan.kind.write_index(job.tmp_output, plan.files, plan.items)
        if not plan.kind.directory:
            return os.fstat(fds[0]).st_size
        return sum(p.stat().st_size for p in job.tmp_output.iterdir())
