"""Resume stage: a plan's records and fingerprint, the manifest's life beside the temporary, and the jobs a resume skips.

The output is laid out before any read (``plan``, ``reshard_plan``), so a record (a tensor's data
in a consolidation, a payload's tensor bytes in a reshard) has the same byte range in every run
of the same plan, whatever the number of workers or nodes. An operation enters its temporary with
``temporary_output`` (every process of the job, before any data is read); ``--resume`` first finds
the interrupted run's temporary (``find_temporary``: this job's own, or the one another job id
left) and checks its manifest against the new plan, touching nothing. Every worker then calls
``begin_share``: rank 0 writes a fresh manifest, or (resuming) checks it again and removes every
other file of the temporary (index, ``.metadata``, configs); after a barrier each worker reads back
the logged records of its own share, keeps those whose CRC-32 matches and skips them, and logs each
record it writes once fsynced (``records-<rank>.jsonl``). Rank 0 rewrites every header, pickle,
index and ``.metadata`` from the CRC-32s. The manifest format is in ``writers._manifest``.

The same on one node, many nodes (the temporary on a filesystem every node mounts) or under the
user's torchrun: rank 0's worker starts the manifest and the barrier holds every other worker until
it has. A job with another id (a requeued job, torchrun's random ``--standalone`` id) resumes the
temporary an earlier job left, so the job id need not be stable.

A resumable run (a local output) keeps its temporary and manifest when Ctrl-C, SIGTERM/SIGHUP or a
failed or dead worker stops it once the manifest is written (``keep_note``,
``writers._atomic.KEPT_ON``), so a preemption that sends SIGTERM before SIGKILL leaves it to
``--resume``; any other error removes it, as for every other run.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from fsdp_convert.constants import METADATA_FILENAME
from fsdp_convert.errors import OutputWriteError
from fsdp_convert.formats.index import CheckpointIndex
from fsdp_convert.launch import WorkerGroup
from fsdp_convert.move import MoveJob, Piece, range_crc
from fsdp_convert.plan import WorkPlan
from fsdp_convert.progress import OFF, Bars, human_bytes
from fsdp_convert.reshard_plan import ReshardPlan
from fsdp_convert.transform import OutputItem
from fsdp_convert.writers import atomic_output
from fsdp_convert.writers._atomic import temporaries, temporary_path
from fsdp_convert.writers._lock import check_not_locked
from fsdp_convert.writers._manifest import (
    Record,
    RecordLog,
    Source,
    check_manifest,
    digest,
    has_manifest,
    kept_records,
    remove_manifest,
    start_manifest,
    written_bytes,
)
from fsdp_convert.writers.dcp import rank_filename

__all__ = [
    "Layout",
    "Fingerprint",
    "consolidate_fingerprint",
    "reshard_fingerprint",
    "find_temporary",
    "ResumeState",
    "temporary_output",
    "begin_share",
    "RecordLogger",
    "keep_note",
]

logger = logging.getLogger(__name__)

Kept = dict[tuple[int, int], int]  # (file index, offset in bytes) -> CRC-32 of a record kept from an interrupted run


class Layout:
    """A plan's output files and records, by file index as the movers number them.

    Attributes:
        names: per file index, its name relative to the output (``""``: a file output itself).
        sizes: per file name, the end of its laid-out data, in bytes.
        records: per record, its file index and ``Record``.
    """

    def __init__(self, names: dict[int, str], sizes: dict[str, int], records: list[tuple[int, Record]]) -> None:
        self.names, self.sizes, self.records = names, sizes, records


def consolidate_layout(plan: WorkPlan) -> Layout:
    """Every tensor of a consolidation plan as a record: ``(file, data offset, nbytes)``."""
    names, sizes, records = {}, {}, []
    for f, file in enumerate(plan.files):
        names[f] = name = file.filename or ""
        sizes[name] = 0
        for i, offset in zip(file.item_ids, file.data_offsets, strict=True):
            nbytes = plan.items[i].nbytes
            if offset is not None and plan.items[i].is_tensor:
                sizes[name] = max(sizes[name], offset + nbytes)
                if nbytes:
                    records.append((f, Record(name, offset, nbytes)))
    return Layout(names, sizes, records)


def reshard_layout(plans: tuple[tuple[str, ReshardPlan], ...]) -> Layout:
    """Every payload of a reshard plan as a record: its tensor bytes in its rank file (numbered as ``ops.reshard``)."""
    names, sizes, records = {}, {}, []
    for p, (sub, plan) in enumerate(plans):
        for rank in plan.data_ranks:
            f = p * plan.target_world_size + rank
            names[f] = f"{sub}/{rank_filename(rank)}" if sub else rank_filename(rank)
            sizes[names[f]] = plan.values_offset if rank == 0 else 0
        for payload in plan.payloads:
            f = p * plan.target_world_size + payload.chunk.rank
            item = plan.items[payload.item]
            assert item.dtype is not None
            nbytes = math.prod(payload.chunk.sizes) * item.dtype.itemsize
            sizes[names[f]] = max(sizes[names[f]], payload.offset + payload.layout.size)
            if nbytes:
                records.append((f, Record(names[f], payload.offset + payload.layout.data_offset, nbytes)))
    return Layout(names, sizes, records)


def source_digest(index: CheckpointIndex, items: tuple[OutputItem, ...]) -> Source:
    """Digest of ``.metadata`` (a local DCP folder) and the entries read, and the data files now (``_manifest.Source``)."""
    meta = b""
    root = index.checkpoint_id
    if isinstance(root, Path) and (root / METADATA_FILENAME).is_file():
        meta = hashlib.sha256((root / METADATA_FILENAME).read_bytes()).digest()
    return Source.of(digest(meta, [(item.entry, item.sources) for item in items]), index)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fingerprint:
    """What a manifest says of its plan.

    Attributes:
        layout: the output files and records.
        source: ``source_digest`` of the checkpoint.
        options: digest of everything that changes the output's bytes.
    """

    layout: Layout
    source: Source | str
    options: str

    def check(self, tmp: Path) -> None:
        """Raise unless ``tmp``'s manifest was written for this plan (``writers._manifest.check_manifest``)."""
        records = [r for _, r in self.layout.records]
        check_manifest(tmp, source=self.source, options=self.options, files=self.layout.sizes, records=records)


def find_temporary(output: Path, tag: str | None, *, directory: bool, fingerprint: Fingerprint) -> Path | None:
    """The interrupted run's temporary of ``output`` to resume; read only, before the output is locked.

    This job's own (``writers._atomic.temporary_path`` for ``tag``) if it is there; else the one
    temporary of ``output`` another job left with a manifest (a job id is not always stable:
    torchrun ``--standalone`` draws one, a requeued job may get a new one). Every process of a
    job finds the same one: nothing is written before every worker has started.

    Returns:
        The temporary, its manifest checked against this plan; None when there is none to resume
        (the run starts afresh).

    Raises:
        OutputWriteError: a temporary whose manifest is missing or differs from this plan (the
            message names what differs), or several left with a manifest; nothing is touched.
    """
    own = temporary_path(output, tag, directory=directory)
    if has_manifest(own) or own.is_file() or (own.is_dir() and any(own.iterdir())):
        fingerprint.check(own)
        return own
    left = [t for t in temporaries(output, directory=directory) if t != own and has_manifest(t)]
    if len(left) > 1:
        names = ", ".join(str(t) for t in left)
        raise OutputWriteError(f"cannot resume {output}: {len(left)} interrupted runs left a temporary ({names}); keep one")
    if not left:
        logger.info("--resume: no interrupted run's output at %s; starting afresh", own)
        return None
    fingerprint.check(left[0])
    logger.info("--resume: continuing %s, which a job with another id left", left[0])
    return left[0]


@dataclass(frozen=True, slots=True)
class ResumeState:
    """What every worker of a resumable output needs (``begin_share``).

    Attributes:
        fingerprint: the plan's fingerprint, written to (or checked against) the manifest.
        resume: whether the temporary is an interrupted run's (``find_temporary`` found it).
    """

    fingerprint: Fingerprint
    resume: bool


@contextlib.contextmanager
def temporary_output(
    output: Path, *, overwrite: bool, directory: bool, tag: str | None, fingerprint: Fingerprint | None, resume: bool
) -> Iterator[tuple[Path, ResumeState | None]]:
    """Enter ``output``'s temporary (``writers.atomic_output``), resumable when there is a ``fingerprint``.

    Every process of the job calls it. With ``resume`` the interrupted run's temporary is found and
    checked first (``find_temporary``), before the lock; the block writes into it. A temporary with a
    manifest is kept when a signal or a failed worker stops the block (``keep_note``), and the
    manifest is removed once the temporary is gone (renamed into place or removed).

    Args:
        output: the final output (local).
        overwrite: replace an existing ``output`` (at the final rename).
        directory: a folder output.
        tag: the job's shared tag (``launch.shared_tag``), None on one node.
        fingerprint: the plan's (``consolidate_fingerprint``, ``reshard_fingerprint``); None: an
            output that keeps no manifest (a staged upload to object storage, whose staging folder
            is private).
        resume: ``--resume``; first, another job's live run on ``output`` is refused (``writers._lock.check_not_locked``).

    Yields:
        The temporary, and what the workers need to resume it (None without a fingerprint).

    Raises:
        As ``find_temporary`` and ``writers.atomic_output``.
    """
    found = None
    if fingerprint is None and resume:
        logger.warning("--resume: an output to object storage keeps no manifest (staged in a private folder); writing it afresh")
    if fingerprint is not None and resume:
        check_not_locked(output, tag)  # a live run's temporary is not an interrupted one
        found = find_temporary(output, tag, directory=directory, fingerprint=fingerprint)
        resume = found is not None
    keep = keep_note if fingerprint is not None else None
    temporary = atomic_output(
        output, overwrite=overwrite, directory=directory, tag=tag, resume=resume, keep=keep, temporary=found
    )
    with _follow_temporary(temporary) as tmp:
        yield tmp, (None if fingerprint is None else ResumeState(fingerprint, resume))


def begin_share(
    tmp: Path,
    state: ResumeState | None,
    rank: int,
    group: WorkerGroup | None,
    jobs: list[MoveJob],
    stack: contextlib.ExitStack,
    bars: Bars = OFF,
) -> tuple[list[MoveJob], list[tuple[MoveJob, Piece]], RecordLogger | None]:
    """A worker's start on a resumable output: the manifest, its share's records kept, its record log. Called on every rank.

    Rank 0 writes a fresh manifest, or (resuming) checks it again and removes every file of a folder
    temporary that is not a data file (what rank 0 writes last); a barrier holds the others until it
    has. Resuming, each worker then reads back the logged records of its own jobs (its share of the
    reading, in parallel) and keeps those whose CRC-32 matches.

    Args:
        tmp: the temporary output.
        state: from ``temporary_output``; None: not resumable (returns ``jobs`` as they are).
        rank: this worker's rank.
        group: the job's group (None: one process).
        jobs: this worker's move jobs.
        stack: closes the record log.
        bars: the job's progress bars (``launch.worker_bars``): resuming, a ``re-check`` bar of the
            bytes read back and kept, of every logged byte (rank 0 shows the job's; with it on, the
            workers wait for each other once re-checked, so the bar ends complete).

    Returns:
        The jobs to move; the jobs kept, each with one piece carrying its CRC-32; and the
        ``RecordLogger`` that logs each job moved (None when not resumable): call it from
        ``move.move_all``'s ``on_done``, and ``flush`` it once the share is moved.

    Raises:
        OutputWriteError: the manifest cannot be written, or (resuming) differs.
    """
    if state is None:
        return jobs, [], None
    layout = state.fingerprint.layout
    if rank == 0:
        _start(tmp, state)
    if group is not None:
        group.barrier()
    kept: Kept = {}
    if state.resume:
        mine = {(job.file, job.offset): Record(layout.names[job.file], job.offset, job.nbytes) for job in jobs if job.nbytes}
        crcs = _recheck(tmp, list(mine.values()), bars, group)
        kept = {key: crcs[record] for key, record in mine.items() if record in crcs}
    todo, done = _skip_kept(jobs, kept)
    return todo, done, RecordLogger(tmp, rank, layout.names, stack)


RECHECK_BATCHES = 20  # with a bar, a worker's share is re-checked in this many parts (each reads the logs again)
RECHECK_MIN_BATCH_BYTES = 256 << 20


def _recheck(tmp: Path, records: list[Record], bars: Bars, group: WorkerGroup | None) -> dict[Record, int]:
    """``writers._manifest.kept_records`` of this worker's ``records``, counted on a ``re-check`` bar part by part.

    The bar's total is every logged byte of the job (``written_bytes``), each part's kept bytes
    its progress (a record whose bytes no longer match its CRC-32 is read but not counted); the
    workers wait for each other at the end, so rank 0's last frame counts them all.
    """
    path_of = lambda name: tmp / name if name else tmp  # noqa: E731
    if not bars.enabled:
        return kept_records(tmp, records, path_of)
    share = sum(r.nbytes for r in records)
    batch_bytes = max(RECHECK_MIN_BATCH_BYTES, -(-share // RECHECK_BATCHES))
    batches: list[list[Record]] = [[]]
    filled = 0
    for record in records:
        if filled >= batch_bytes:
            batches.append([])
            filled = 0
        batches[-1].append(record)
        filled += record.nbytes
    crcs: dict[Record, int] = {}
    with bars.step("recheck", "re-check", written_bytes(tmp)[0] if bars.show else 0, share) as progress:
        for batch in batches:
            found = kept_records(tmp, batch, path_of)
            crcs.update(found)
            progress.advance(sum(r.nbytes for r in found))
        progress.flush()
        if group is not None:
            group.barrier()
    return crcs


def _start(tmp: Path, state: ResumeState) -> None:
    """Rank 0, before the other workers go on: a fresh manifest, or (resuming) the manifest checked, the last files removed."""
    fingerprint = state.fingerprint
    if not state.resume:
        layout = fingerprint.layout
        records = [r for _, r in layout.records]
        start_manifest(tmp, source=fingerprint.source, options=fingerprint.options, files=layout.sizes, records=records)
        return
    fingerprint.check(tmp)
    _remove_last_files(tmp, set(fingerprint.layout.sizes))


def _remove_last_files(tmp: Path, data_files: set[str]) -> None:
    """Remove what rank 0 writes last in a folder output (index, ``.metadata``, configs, copies): it is all written again."""
    if not tmp.is_dir():
        return
    for path in sorted(tmp.rglob("*"), reverse=True):  # files before their folders
        if path.is_file() and path.relative_to(tmp).as_posix() not in data_files:
            path.unlink()


@contextlib.contextmanager
def _follow_temporary(temporary: AbstractContextManager[Path]) -> Iterator[Path]:
    """Enter ``temporary`` (``writers.atomic_output``) and remove the manifest beside it once it is gone (renamed or removed).

    A temporary left in place (a SIGKILL, a process leaving it to rank 0's) keeps its manifest; a
    complete one loses it just before its rename (a crash between the two leaves a temporary that
    ``--resume`` refuses, naming it).
    """
    tmp: Path | None = None
    try:
        with temporary as tmp:
            yield tmp
            remove_manifest(tmp)  # complete: the temporary is renamed next
    finally:
        if tmp is not None and not tmp.exists():
            remove_manifest(tmp)


def keep_note(tmp: Path) -> str | None:
    """A ``writers.atomic_output`` ``keep``: a temporary with a manifest is worth keeping; say so, with how much is written.

    Returns:
        ``the temporary PATH (1.1 GiB of 3.2 GiB written) is kept: ...`` (binary units, as the progress
        bars), or None without a manifest (stopped before it was written: nothing to resume; the
        temporary is removed).
    """
    if not has_manifest(tmp):
        return None
    written, total = written_bytes(tmp)
    return (
        f"the temporary {tmp} ({human_bytes(written)} of {human_bytes(total)} written) is kept: "
        "run again with --resume to finish it, or remove it"
    )


def _skip_kept(jobs: list[MoveJob], kept: Kept) -> tuple[list[MoveJob], list[tuple[MoveJob, Piece]]]:
    """Split a worker's jobs into those to move and those kept, each kept job with one piece carrying its CRC-32."""
    todo, done = [], []
    for job in jobs:
        crc = kept.get((job.file, job.offset))
        if crc is None or job.nbytes == 0:
            todo.append(job)
        else:
            done.append((job, Piece(job.file, job.offset, job.nbytes, crc)))
    return todo, done


class RecordLogger:
    """An ``on_done`` for ``move.move_all`` that logs each job moved as a record (``writers._manifest.RecordLog``).

    Called from the mover's threads. ``flush`` once the worker's share is moved logs the batch so
    far; the log is closed (and flushed) with ``stack``.

    Args:
        tmp: the temporary output.
        writer: the worker's rank (``records-<writer>.jsonl``).
        names: each file index's name in the output.
        stack: closes the log.
    """

    def __init__(self, tmp: Path, writer: int, names: dict[int, str], stack: contextlib.ExitStack) -> None:
        self._log = RecordLog(tmp, str(writer))
        self._names = names
        stack.callback(self._log.close)

    def __call__(self, job: MoveJob, pieces: list[Piece]) -> None:
        """Log ``job`` (its bytes written, ``pieces`` their CRC-32s) as a record, with the batch it completes."""
        if job.nbytes:
            self.record(job, range_crc(job.fd, {p.offset: p for p in pieces}, job.offset, job.nbytes))

    def record(self, job: MoveJob, crc32: int) -> None:
        """Log ``job`` as a record whose bytes' CRC-32 the caller has already combined (``move.range_crc``)."""
        if job.nbytes:
            self._log.append(Record(self._names[job.file], job.offset, job.nbytes), crc32, job.fd, job.entry.fqn)  # thread-safe

    def flush(self) -> None:
        """Log every record moved so far (before rank 0 writes what it writes last)."""
        self._log.flush()


def options_of(items: tuple[OutputItem, ...], *extra: object) -> object:
    """What of the items changes the output's bytes (paths, dtypes, shapes, values, derivations), and ``extra``."""
    return (extra, [(i.path, i.group, i.dtype, i.is_tensor and i.shape, i.constant, i.value, i.derived) for i in items])


def consolidate_fingerprint(index: CheckpointIndex, plan: WorkPlan) -> Fingerprint:
    """A consolidation's fingerprint: its layout, and its options (a LoRA merge's rounding depends on the buffer size)."""
    combine = any(i.derived is not None and i.derived.combine is not None for i in plan.items)
    options = options_of(plan.items, plan.output_format, plan.piece_bytes if combine else None)
    return Fingerprint(layout=consolidate_layout(plan), source=source_digest(index, plan.items), options=digest(options))


def reshard_fingerprint(index: CheckpointIndex, plans: tuple[tuple[str, ReshardPlan], ...], compress: str | None) -> Fingerprint:
    """A reshard's fingerprint: its rank files' payloads, and its options (items, target world size, compression)."""
    items = tuple(item for _, plan in plans for item in plan.items)
    options = options_of(items, [(sub, plan.target_world_size) for sub, plan in plans], compress)
    return Fingerprint(layout=reshard_layout(plans), source=source_digest(index, items), options=digest(options))
