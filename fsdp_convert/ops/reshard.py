"""Operation ``reshard``: source, items, plan (every rank file laid out), workers move the chunks in place; ``.metadata`` last.

The plan gives every tensor chunk's torch.save payload a byte range in its target rank's data
file and a worker, balanced by bytes. Each worker moves its chunks' bytes there (``move``) and
writes each payload's zip headers around them; rank 0 appends the values (bytes entries) to its
own file, and its process writes ``.metadata`` once every worker is done (``outputs.DcpFolder``,
the output kind). No tensor crosses between workers.

The output keeps the source's folders, so the producer's own loader reads it: accelerate's
``pytorch_model_fsdp_0/`` and ``optimizer_0/`` each become a DCP folder for the new world size,
and the files beside them are sorted by the producer's record (``producers.Producer.side_files``):
those that hold the same at any world size (Lightning's ``meta.pt``, accelerate's scheduler,
sampler, scaler and custom states) are copied byte for byte, never loaded; per-rank files
(accelerate's ``random_states_<r>.pkl``) and unknown files are left out, and the result says which.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.formats import open_checkpoint
from fsdp_convert.formats.dcp import DCP_FILE_RE
from fsdp_convert.formats.index import CheckpointIndex, Location, Url, dcp_key
from fsdp_convert.held_roots import following_symlinks
from fsdp_convert.item import OutputItem
from fsdp_convert.launch import job_world_size, shared_tag
from fsdp_convert.ops._deepspeed_reshard import reshard_zero, writes_zero
from fsdp_convert.ops._reshard_rank import ReshardJob, reshard_rank
from fsdp_convert.ops._waves import reshard_in_waves, reshard_staging_bytes
from fsdp_convert.ops.options import ReshardOptions
from fsdp_convert.output_table import METADATA_FILENAME
from fsdp_convert.outputs import RECORD_TAIL_BYTES, last_files, own_files, reshard_kind
from fsdp_convert.plan.consolidate import default_nproc
from fsdp_convert.plan.items import prepare_items
from fsdp_convert.plan.reshard import ReshardPlan, plan_reshard, split_by_folder
from fsdp_convert.producers import Beside, Producer, detect_producer, sort_beside
from fsdp_convert.remote import as_location
from fsdp_convert.resume import reshard_fingerprint
from fsdp_convert.transform import TransformOptions
from fsdp_convert.writers.dcp import MetadataEntry, StoredChunk, rank_filename
from fsdp_convert.writers.transaction import LeaveToOwner, OutputTransaction, is_plain, value_payload

__all__ = ["ReshardResult", "reshard"]

logger = logging.getLogger(__name__)


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
        folders: the DCP folders written, relative to ``output`` (``""``: ``output`` itself;
            accelerate: ``optimizer_0``, ``pytorch_model_fsdp_0``).
        copied: files beside the source's DCP data copied byte for byte (``meta.pt``...).
        left_out: files beside the source's DCP data not carried over (``random_states_0.pkl``...).
        notes: one line per kind of file left out, saying why (also printed on stderr by the CLI).
        kind: what was written: ``DCP``, or ``DeepSpeed ZeRO-<stage>`` (``chunks``: its partition tensors).
        added: files the adapter writes beside the DCP data (``AdapterRecord.files``: Megatron's
            ``common.pt`` and ``metadata.json``).
    """

    output: Location
    target_world_size: int
    chunks: int
    file_bytes: int
    nproc: int
    seconds: float
    owner: bool = True
    folders: tuple[str, ...] = ("",)
    copied: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    kind: str = "DCP"
    added: tuple[str, ...] = ()


METADATA_BYTES_PER_CHUNK = 512  # .metadata per chunk (its FQN, offsets, sizes, where it lies): about 250 bytes
Plans = tuple[tuple[str, ReshardPlan], ...]


def files_beside(index: CheckpointIndex, producer: Producer, plans: Plans) -> Beside:
    """Sort the entries of a local DCP source folder that are neither ``.metadata`` nor data files (``producers.sort_beside``).

    Nothing is opened. A full file, per-rank files or a remote source: nothing beside.
    """
    root = index.checkpoint_id
    if not isinstance(root, Path) or not root.is_dir():
        return Beside()
    if producer.folders is None and not (root / METADATA_FILENAME).is_file():
        return Beside()
    known = {METADATA_FILENAME, *index.data_files, *(sub for sub, _ in plans if sub)}
    entries = [
        (path.name, path.is_file(), path.is_dir())
        for path in sorted(root.iterdir())
        if not (path.name in known or DCP_FILE_RE.fullmatch(path.name))  # a data file, even one .metadata names no payload in
        # hidden files are not the checkpoint's (locks, temporaries) unless the producer names them (.metadata.json)
        and not (path.name.startswith(".") and producer.side_file(path.name) is None)
    ]
    return sort_beside(producer, entries)


def _metadata_rows(plan: ReshardPlan) -> tuple[list[MetadataEntry], list[StoredChunk]]:
    """A folder's ``.metadata`` entries, and the rows of its tensor payloads as laid out (rank 0 adds its values')."""
    stored = [
        StoredChunk(dcp_key(plan.items[p.item].path), p.chunk.offsets, rank_filename(p.chunk.rank), p.offset, p.placement.size)
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
    return entries, stored


def _value_bytes(item: OutputItem) -> int:
    """A value's payload size, in bytes: a constant's (a plain one, as written: an adapter's ``_extra_state``) too."""
    return len(value_payload(item.value)) if item.constant and is_plain(item.value) else item.nbytes


def _output_bytes(plans: Plans, root: Location, copied: tuple[str, ...]) -> int:
    """The resharded output's size, in bytes, from its plans (known before any data is read).

    Every rank file as laid out, the values rank 0 appends, ``.metadata`` (``METADATA_BYTES_PER_CHUNK``
    per chunk, an estimate on the high side) and the files copied beside.
    """
    total = 0
    for _, plan in plans:
        ends = dict.fromkeys(plan.data_ranks, 0)
        for p in plan.payloads:
            ends[p.chunk.rank] = max(ends[p.chunk.rank], p.offset + p.placement.size)
        values = [item for item in plan.items if not item.is_tensor]
        if values:
            ends[0] = plan.values_offset + sum(_value_bytes(item) + RECORD_TAIL_BYTES for item in values)
        total += sum(ends.values()) + METADATA_BYTES_PER_CHUNK * (sum(len(c) for c in plan.chunks) + 1)
    if isinstance(root, Path):
        total += sum((root / name).stat().st_size for name in copied)
    return total


def space_needed_bytes(
    plans: Plans, index: CheckpointIndex, beside: Beside, waves: Url | None, added: Mapping[str, bytes] | None = None
) -> int:
    """What the space check asks for, in bytes: the whole output, or to a URL two waves of rank files (``ops._waves``).

    Either way with the files the adapter adds (``added``: ``adapter_files``).
    """
    extra = sum(len(data) for data in (added or {}).values())
    return extra + (reshard_staging_bytes(plans) if waves else _output_bytes(plans, index.checkpoint_id, beside.copied))


def adapter_files(transform: TransformOptions, beside: Beside) -> dict[str, bytes]:
    """The files the adapter writes beside the output's DCP data (``AdapterRecord.files``), by name; ``{}``: none.

    Raises:
        InvalidOptionError: a name that is not a plain file name, or one the source's files beside
            its data would be copied to too.
    """
    files = getattr(transform.adapter, "files", None)
    added: dict[str, bytes] = files() if files is not None else {}
    for name in added:
        if name in (".", "..", METADATA_FILENAME) or Path(name).name != name or DCP_FILE_RE.fullmatch(name):
            raise InvalidOptionError(f"the adapter's file {name!r}: not a file name reshard writes beside DCP data")
        if name in beside.copied:
            raise InvalidOptionError(f"the adapter writes {name}, which the checkpoint holds beside its data too")
    return added


def _write_added(folder: Path, added: Mapping[str, bytes]) -> None:
    """Write the adapter's files into the output's temporary ``folder``, each fsynced (rank 0's process)."""
    for name, data in added.items():
        with open(folder / name, "wb") as f:  # a resumed run's temporary may hold one already: the same bytes
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def folder_plans(index: CheckpointIndex, items: tuple[OutputItem, ...], opts: ReshardOptions) -> tuple[Plans, int]:
    """The workers, and a plan per DCP folder of the output (one, or accelerate's two), keyed by subfolder.

    Raises:
        As ``plan.reshard.plan_reshard`` (CoverageError: a tensor's chunks do not tile it; InvalidOptionError).
    """
    workers = job_world_size(opts.nproc, opts.cluster) or default_nproc(
        sum(item.nbytes for item in items), len(index.data_files) or 1, len(os.sched_getaffinity(0))
    )
    parts = split_by_folder(items, index.folders)
    return tuple((sub, plan_reshard(index, part, opts.world_size, nproc=workers)) for sub, part in parts), workers


def _result(
    opts: ReshardOptions,
    output: Location,
    plans: Plans,
    beside: Beside,
    *,
    file_bytes: int,
    nproc: int,
    seconds: float,
    owner: bool,
    added: Mapping[str, bytes],
) -> ReshardResult:
    """What ``reshard`` wrote (see ``ReshardResult``)."""
    return ReshardResult(
        output=output,
        target_world_size=opts.world_size,
        chunks=sum(len(c) for _, plan in plans for item, c in zip(plan.items, plan.chunks, strict=True) if item.is_tensor),
        file_bytes=file_bytes,
        nproc=nproc,
        seconds=seconds,
        owner=owner,
        folders=tuple(sub for sub, _ in plans),
        copied=beside.copied,
        left_out=beside.left_out,
        notes=beside.notes,
        added=tuple(added),
    )


def _source_bytes(index: CheckpointIndex) -> int:
    """The source's data files' size, in bytes: what a DeepSpeed save for another world size needs, about."""
    assert isinstance(index.checkpoint_id, Path)
    return sum((index.checkpoint_id / name).stat().st_size for name in index.data_files)


def reshard(
    checkpoint_id: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: ReshardOptions | TransformOptions | None = None,
    **kwargs: Any,
) -> ReshardResult:
    """Lay a checkpoint out for ``world_size`` ranks: a new DCP folder any DCP loader reads.

    The source is a DCP folder (any world size), or a full checkpoint (any output of
    ``consolidate``): a torch.save file under any name (read with ``weights_only=True``,
    memory-mapped), whose nesting the output keeps; safetensors weights alone (a file, a Hugging
    Face or PEFT folder), whose flat names it keeps, as ``model.state_dict()`` has them; a
    Hugging Face folder with ``optimizer.pt``, as ``{"model", "optim"}`` plus ``extra_state.pt``'s entries.

    Every tensor is split on dim 0 in ``torch.chunk(world_size)`` order, rank r's chunks in
    ``__r_0.distcp`` (the layout of FSDP2's ``Shard(0)``), so at that world size each rank reads
    only its own file; 0-dim and replicated tensors stay whole and bytes entries are carried over
    unchanged, both in rank 0's file. ``.metadata`` is written last.

    The source's folders are kept: accelerate's ``save_state`` folder gives the same
    ``pytorch_model_fsdp_0/`` and ``optimizer_0/``, each a DCP folder for ``world_size``, which
    accelerate's ``load_state`` reads. Files beside the DCP data that hold the same at any world
    size are copied byte for byte, never loaded: Lightning's ``meta.pt`` (``fabric.load``
    refuses a folder without it), accelerate's ``scheduler*.bin``, ``sampler*.bin``,
    ``scaler.pt`` and ``custom_checkpoint_<n>.pkl``. accelerate's per-rank
    ``random_states_<r>.pkl`` and unknown files are left out; ``ReshardResult.notes`` says so. An
    adapter whose target's loader wants more than its tensors adds its values and files
    (``adapters.AdapterRecord``: ``hf-to-megatron-gpt``'s ``_extra_state`` entries, ``common.pt``
    and ``metadata.json``), so an HF folder becomes a checkpoint Megatron-Core loads.

    The stages are docs/architecture.md's, each marked in the body (``# N. stage:``).

    Args:
        checkpoint_id: the source: a DCP folder (or accelerate's parent folder), per-rank files, a
            full torch.save or safetensors file, or a Hugging Face or PEFT folder.
        output: the output folder.
        options: a ``ReshardOptions``; or, as before it, a ``TransformOptions`` (meaning
            ``transform=``); None: the keywords alone.
        **kwargs: ``ReshardOptions``'s fields as keywords, each replacing ``options``' own:
            world_size: the target world size.
            nproc: workers, each moving its share of the chunks (balanced by bytes) into any rank
                file; default ``plan.consolidate.default_nproc`` (one per CPU core, at most one per data file and 2 GiB).
            transform: key and dtype transforms, as for ``consolidate``; the output keeps the source's
                nesting (``{"model": ..., "optim": ...}``, torchtitan's top-level weights...), so the
                producer's own loader reads it.
            overwrite: replace an existing ``output`` (at the final rename only); as for ``consolidate``, not
                the checkpoint, inside it or one of its folders.
            force: with ``overwrite``, replace a folder that does not look like this tool's output too.
            space_check: check the output's size from the plan (every rank file, ``.metadata``, the files
                copied beside) against the free space where its temporary is written, before anything
                is read or created (to a URL: two waves of rank files, ``ops._waves``); an output compressed with
                ``compress`` is counted uncompressed (as it is laid out), and to a URL is staged whole.
            check_crc: check CRC-32s of the source payloads.
            cluster: torchrun's multi-node options, as for ``consolidate``; rank 0's node writes ``.metadata``.
            compress: ``"zstd"``: every payload a zstd stream (``stream.zstd/1``), as
                ``FileSystemWriter(_extensions=[ZStandard()])`` writes them; rank 0 rewrites the laid-out
                rank files payload by payload before ``.metadata`` (``writers.dcp.compress_data_files``;
                with several nodes the output's filesystem must be shared). None (default): uncompressed,
                whatever the source.
            resume: finish the interrupted run's temporary output, as for ``consolidate``.
            progress: a bar on stderr (``progress``: bytes of every worker, binary units, rate, time left),
                drawn by rank 0's worker; ``re-check`` first when resuming.
            follow_symlinks: read files of the checkpoint that are symbolic links out of its folder
                (a shared store the step folder links into); by default such a link is refused
                (UnsafeContentError). None: the process's setting (``--follow-symlinks``).
            output_format: ``"dcp"``, ``"deepspeed"`` (a DeepSpeed ZeRO save of the same stage for
                ``world_size`` ranks, which ``engine.load_checkpoint`` reads; a DeepSpeed source only) or
                ``"auto"`` (default: DeepSpeed for a DeepSpeed save, else DCP).

    Raises:
        As ``consolidate``; InvalidOptionError for ``world_size < 1``, ``compress="zstd"`` without
        the ``zstandard`` package, or an unknown keyword (``ReshardOptions.from_call``; before
        anything is read).
    """
    opts = ReshardOptions.from_call(options, kwargs)  # 1. options: a bad value names its keyword
    owner, file_bytes, start = False, 0, time.monotonic()
    # the symlink setting travels in the environment, so workers take it too
    # 2. output check: OUT checked before anything is read (not the input), a URL staged locally
    with (
        following_symlinks(opts.follow_symlinks),
        OutputTransaction(
            output,
            inputs=(checkpoint_id,),
            overwrite=opts.overwrite,
            force=opts.force,
            tag=shared_tag(opts.cluster),
            last=last_files(),
            own_files=own_files(),  # the tables' names: a DCP folder, the producers' files beside
        ) as tx,
    ):
        # 3. source: a DCP-like folder, or a full file / HF folder, its format decided once; its producer
        source = open_checkpoint(as_location(checkpoint_id), full_files=True, check_crc=opts.check_crc)
        index, producer = source.index, detect_producer(source.index)
        if writes_zero(opts, producer.name):  # stages 4 to 9 of a DeepSpeed save written as DeepSpeed's loader reads it
            tmp, _ = tx.begin(
                directory=True, needed_bytes=_source_bytes(index) if opts.space_check else None, fingerprint=None, resume=False
            )
            workers = opts.nproc or default_nproc(index.total_bytes, len(index.data_files), os.cpu_count() or 1)
            chunks, file_bytes = reshard_zero(source, tmp, opts.world_size, workers)
            seconds = time.monotonic() - start
            return ReshardResult(
                output=tx.shown,
                target_world_size=opts.world_size,
                chunks=chunks,
                file_bytes=file_bytes,
                nproc=workers,
                seconds=seconds,
                kind=f"DeepSpeed {index.details[0][1]}" if index.details else "DeepSpeed",
            )
        # 4. output kind: a DCP folder (a folder of them for accelerate's), the outputs table's reshard row
        kind = reshard_kind()
        tx.check_free(directory=kind.directory)
        source.check_data_files()
        # 5. items: the producer's nesting kept, so that its own loader reads the output
        items = prepare_items(source, opts.transform, kind.groups(), keep_layout=True)
        kind.check_keys(item.path for item in items)  # what its own reader would refuse, before anything is written
        # 6. plan: one per DCP folder; the files beside, by the producer's record
        plans, workers = folder_plans(index, items, opts)
        beside = files_beside(index, producer, plans)
        added = adapter_files(opts.transform, beside)  # what the target's loader wants beside the data (Megatron's)
        waves = tx.url if opts.compress is None else None  # object storage: rank files go up wave by wave
        # 7. transaction: space, lock, temporary (resumable: a manifest; a staged upload keeps none)
        tmp, resumable = tx.begin(
            directory=kind.directory,
            needed_bytes=space_needed_bytes(plans, index, beside, waves, added) if opts.space_check else None,
            fingerprint=None if tx.url else reshard_fingerprint(index, plans, opts.compress),
            resume=opts.resume,
        )
        # 8. move: the workers move every chunk into its rank file
        job = ReshardJob(
            source=source, plans=plans, tmp_output=tmp, check_crc=opts.check_crc, resume=resumable, progress=opts.progress
        )
        owner, values, uploaded = reshard_in_waves(reshard_rank, job, workers, opts.cluster, waves)
        if not owner:
            raise LeaveToOwner  # rank 0's process finishes the shared temporary
        # 9. finish: rank 0's process writes each folder's .metadata, last; then the files beside, the adapter's
        for sub, plan in plans:
            entries, stored = _metadata_rows(plan)
            rows = stored + [StoredChunk.from_json(row) for row in values[sub]]
            kind.finish_metadata(tmp / sub, entries, rows, index.version, compress=opts.compress == "zstd")
        if beside.copied:
            assert isinstance(index.checkpoint_id, Path)  # files_beside: a local folder
            kind.finish_folder(tmp, source=index.checkpoint_id, beside=beside.copied)
        _write_added(tmp, added)
        file_bytes = uploaded + sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
    # 10. result: what was written (another node's process, or a non-zero rank of the user's torchrun, wrote nothing)
    for note in beside.notes:
        logger.info("%s", note)
    seconds = time.monotonic() - start
    return _result(opts, tx.shown, plans, beside, file_bytes=file_bytes, nproc=workers, seconds=seconds, owner=owner, added=added)
