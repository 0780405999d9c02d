"""Resume stage: a plan's record map and fingerprint, and what every worker does on a resumable output.

The output is laid out before any read (``plan``, ``plan.reshard``), so a record (a tensor's data
in a consolidation, a payload's tensor bytes in a reshard) has the same byte range in every run
of the same plan, whatever the number of workers or nodes: ``consolidate_record_map`` and
``reshard_record_map`` list them (``writers.transaction.RecordMap``), and the fingerprints say
what the plan is. The operation enters its temporary through ``writers.transaction.OutputTransaction``
(``--resume`` finds and checks the interrupted run's temporary there, touching nothing; a
resumable run's temporary is kept on Ctrl-C, SIGTERM/SIGHUP or a failed worker). Every worker then
calls ``begin_share``: rank 0 writes a fresh manifest, or (resuming) checks it again and removes every
other file of the temporary (index, ``.metadata``, configs); after a barrier each worker reads back
the logged records of its own share, keeps those whose CRC-32 matches and skips them, and logs each
record it writes once fsynced (``records-<rank>.jsonl``). Rank 0 rewrites every header, pickle,
index and ``.metadata`` from the CRC-32s. The manifest format is in ``writers._manifest``.

The same on one node, many nodes (the temporary on a filesystem every node mounts) or under the
user's torchrun: rank 0's worker starts the manifest and the barrier holds every other worker until
it has. A job with another id (a requeued job, torchrun's random ``--standalone`` id) resumes the
temporary an earlier job left, so the job id need not be stable.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from collections.abc import Sequence
from pathlib import Path

from fsdp_convert.errors import CheckpointNotFoundError
from fsdp_convert.formats.index import CheckpointIndex
from fsdp_convert.held_roots import open_inside
from fsdp_convert.item import OutputItem
from fsdp_convert.launch import WorkerGroup
from fsdp_convert.move import MoveJob
from fsdp_convert.output_table import METADATA_FILENAME
from fsdp_convert.pieces import Piece, range_crc
from fsdp_convert.plan.consolidate import WorkPlan
from fsdp_convert.plan.reshard import ReshardPlan
from fsdp_convert.progress import OFF, Bars
from fsdp_convert.writers.dcp import rank_filename
from fsdp_convert.writers.transaction import (
    Fingerprint,
    NamedOptions,
    Record,
    RecordLog,
    RecordMap,
    ResumeState,
    SourceDigest,
    digest,
    kept_records,
    start_manifest,
    written_bytes,
)

__all__ = [
    "consolidate_record_map",
    "reshard_record_map",
    "source_digest",
    "consolidate_fingerprint",
    "reshard_fingerprint",
    "named_options",
    "ResumeState",
    "begin_share",
    "RecordLogger",
]

logger = logging.getLogger(__name__)

Kept = dict[tuple[int, int], int]  # (file index, offset in bytes) -> CRC-32 of a record kept from an interrupted run


def consolidate_record_map(plan: WorkPlan) -> RecordMap:
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
    return RecordMap(names, sizes, records)


def reshard_record_map(plans: tuple[tuple[str, ReshardPlan], ...]) -> RecordMap:
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
            sizes[names[f]] = max(sizes[names[f]], payload.offset + payload.placement.size)
            if nbytes:
                records.append((f, Record(names[f], payload.offset + payload.placement.data_offset, nbytes)))
    return RecordMap(names, sizes, records)


def _selection(items: Sequence[OutputItem]) -> list[tuple[str, tuple[str, ...]]]:
    """Which entries ``items`` read: each one's FQN and its sources' (their contents are the checkpoint digest's).

    Names, not the entries' reprs: a checkpoint of a million chunks would repr each of them, twice
    (seconds, and a string of over 100 MB).
    """
    return [(i.entry.fqn, tuple(s.fqn for s in i.sources)) for i in items]


def source_digest(index: CheckpointIndex, items: tuple[OutputItem, ...]) -> SourceDigest:
    """Digest of ``.metadata`` (a local DCP folder) and the entries read, and the data files now (``SourceDigest``)."""
    meta = b""
    root = index.checkpoint_id
    if isinstance(root, Path) and root.is_dir():
        try:  # read as the index was, from the folder this run first opened (held_roots.open_inside)
            fd = open_inside(root, root / METADATA_FILENAME)
        except FileNotFoundError:
            fd = -1  # a format without .metadata
        except OSError as e:
            raise CheckpointNotFoundError(f"cannot read {root / METADATA_FILENAME}: {e.strerror}") from e
        if fd >= 0:
            sha = hashlib.sha256()
            with open(fd, "rb") as f:
                while block := f.read(1 << 20):
                    sha.update(block)
            meta = sha.digest()
    checkpoint = digest(meta) if meta else digest(list(index.entries))  # the .metadata lists every entry
    read = SourceDigest.of(digest(meta, _selection(items)), index)
    return SourceDigest(read.digest, read.files, read.root, checkpoint)


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
        state: from ``OutputTransaction.begin``; None: not resumable (returns ``jobs`` as they are).
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
    record_map = state.fingerprint.record_map
    if rank == 0:
        _start(tmp, state)
    if group is not None:
        group.barrier()
    kept: Kept = {}
    if state.resume:
        mine = {(job.file, job.offset): Record(record_map.names[job.file], job.offset, job.nbytes) for job in jobs if job.nbytes}
        crcs = _recheck(tmp, list(mine.values()), bars, group)
        kept = {key: crcs[record] for key, record in mine.items() if record in crcs}
    todo, done = _skip_kept(jobs, kept)
    return todo, done, RecordLogger(tmp, rank, record_map.names, stack)


RECHECK_BATCHES = 20  # with a bar, a worker's share is re-checked in this many parts (each reads the logs again)
RECHECK_MIN_BATCH_BYTES = 256 << 20


def _recheck(tmp: Path, records: list[Record], bars: Bars, group: WorkerGroup | None) -> dict[Record, int]:
    """``writers.transaction.kept_records`` of this worker's ``records``, counted on a ``re-check`` bar part by part.

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
        record_map = fingerprint.record_map
        records = [r for _, r in record_map.records]
        start_manifest(
            tmp,
            source=fingerprint.source,
            options=fingerprint.options,
            files=record_map.sizes,
            records=records,
            named=fingerprint.named,
        )
        return
    fingerprint.check(tmp)
    _remove_last_files(tmp, set(fingerprint.record_map.sizes))


def _remove_last_files(tmp: Path, data_files: set[str]) -> None:
    """Remove what rank 0 writes last in a folder output (index, ``.metadata``, configs, copies): it is all written again."""
    if not tmp.is_dir():
        return
    for path in sorted(tmp.rglob("*"), reverse=True):  # files before their folders
        if path.is_file() and path.relative_to(tmp).as_posix() not in data_files:
            path.unlink()


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
    """An ``on_done`` for ``move.move_all`` that logs each job moved as a record (``writers.transaction.RecordLog``).

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
        """Log ``job`` as a record whose bytes' CRC-32 the caller has already combined (``pieces.range_crc``)."""
        if job.nbytes:
            self._log.append(Record(self._names[job.file], job.offset, job.nbytes), crc32, job.fd, job.entry.fqn)  # thread-safe

    def flush(self) -> None:
        """Log every record moved so far (before rank 0 writes what it writes last)."""
        self._log.flush()


def options_of(items: tuple[OutputItem, ...], *extra: object) -> object:
    """What of the items changes the output's bytes (paths, dtypes, shapes, values, derivations), and ``extra``."""
    return (extra, [(i.path, i.group, i.dtype, i.is_tensor and i.shape, i.constant, i.value, i.derived) for i in items])


# the options each field of an item comes from, as a resume names them when it differs
SELECTED = "--include/--exclude"
DTYPE = {"model": "--dtype", "optim": "--optim-dtype", "other": "--dtype"}
NAMES = "--rename/--adapter/--layout/--optim-keys/--keep-wrapper-names"
VALUES = "--merge-lora/--dequantize/--quantize/--unstack-layers/--adapter/--optim-keys"


def named_options(items: tuple[OutputItem, ...], **whole: object) -> NamedOptions:
    """``options_of`` by option: per group of the items, the entries it reads and each field; ``whole`` by option name.

    Args:
        items: the plan's items.
        whole: per option (``--format``), what it sets for the whole output.
    """
    groups: dict[str, dict[str, str]] = {}
    for group in sorted({i.group for i in items}):
        mine = [i for i in items if i.group == group]
        groups[group] = {  # the selection first: the other fields are compared only where it is the same
            SELECTED: digest(_selection(mine)),
            DTYPE[group]: digest([i.dtype for i in mine]),
            NAMES: digest([i.path for i in mine]),
            VALUES: digest([(i.is_tensor and i.shape, i.constant, i.value, i.derived) for i in mine]),
        }
    return NamedOptions({name: digest(value) for name, value in whole.items()}, groups)


def consolidate_fingerprint(index: CheckpointIndex, plan: WorkPlan) -> Fingerprint:
    """A consolidation's fingerprint: its record map, and its options (a LoRA merge's rounding depends on the buffer size)."""
    combine = any(i.derived is not None and i.derived.combine is not None for i in plan.items)
    piece_bytes = plan.piece_bytes if combine else None
    options = options_of(plan.items, plan.output_format, piece_bytes)
    named = named_options(plan.items, **{"--format/--lora-only": plan.output_format, "--memory-budget": piece_bytes})
    source = source_digest(index, plan.items)
    return Fingerprint(record_map=consolidate_record_map(plan), source=source, options=digest(options), named=named)


def reshard_fingerprint(index: CheckpointIndex, plans: tuple[tuple[str, ReshardPlan], ...], compress: str | None) -> Fingerprint:
    """A reshard's fingerprint: its rank files' payloads, and its options (items, target world size, compression)."""
    items = tuple(item for _, plan in plans for item in plan.items)
    sizes = [(sub, plan.target_world_size) for sub, plan in plans]
    options = options_of(items, sizes, compress)
    named = named_options(items, **{"--world-size": sizes, "--compress": compress})
    source = source_digest(index, items)
    return Fingerprint(record_map=reshard_record_map(plans), source=source, options=digest(options), named=named)
