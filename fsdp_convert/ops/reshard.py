"""Operation ``reshard``: index, transform, plan (every rank file laid out), workers move the chunks in place; ``.metadata`` last.

The plan gives every tensor chunk's torch.save payload a byte range in its target rank's data
file and a worker, balanced by bytes. Each worker moves its chunks' bytes there (``move``) and
writes each payload's zip headers around them; rank 0 appends the values (bytes entries) to its
own file, and its process writes ``.metadata`` once every worker is done. No tensor crosses
between workers.

The output keeps the source's folders, so the producer's own loader reads it: accelerate's
``pytorch_model_fsdp_0/`` and ``optimizer_0/`` each become a DCP folder for the new world size,
and the files beside them that hold the same at any world size (Lightning's ``meta.pt``,
accelerate's scheduler, sampler, scaler and custom states) are copied byte for byte, never
loaded. Per-rank files (accelerate's ``random_states_<r>.pkl``) and unknown files are left out,
and the result says which.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fsdp_convert.constants import METADATA_FILENAME
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.formats import check_data_files, read_index
from fsdp_convert.formats.dcp import LIGHTNING_META_FILENAME
from fsdp_convert.formats.index import CheckpointIndex, Location, dcp_key
from fsdp_convert.items import prepare_items
from fsdp_convert.launch import Cluster, job_world_size, shared_tag
from fsdp_convert.layout import GROUPS
from fsdp_convert.location import following_symlinks, open_inside
from fsdp_convert.ops._arguments import count, transform_options
from fsdp_convert.ops._reshard_rank import ReshardJob, reshard_rank
from fsdp_convert.ops._waves import reshard_in_waves, reshard_staging_bytes
from fsdp_convert.plan import RECORD_TAIL_BYTES, default_nproc
from fsdp_convert.remote import Url, as_location, local_output
from fsdp_convert.reshard_plan import ReshardPlan, plan_reshard, split_by_folder
from fsdp_convert.resume import reshard_fingerprint, temporary_output
from fsdp_convert.transform import TransformOptions
from fsdp_convert.writers._atomic import LeaveToOwner
from fsdp_convert.writers._output_check import ACCELERATE_SHARED_RE, check_output, check_output_free
from fsdp_convert.writers._space import check_space
from fsdp_convert.writers.dcp import MetadataEntry, StoredChunk, compress_data_files, rank_filename, require_zstd, write_metadata

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


# accelerate's per-rank RNG states: pickles of the old ranks' generators (and accelerator.step)
_ACCELERATE_RNG_RE = re.compile(r"^random_states_\d+\.pkl$")
_DATA_FILE_RE = re.compile(r"^__\d+_\d+\.distcp$")  # a data file, even one .metadata names no payload in
_METADATA_BYTES_PER_CHUNK = 512  # .metadata per chunk (its FQN, offsets, sizes, where it lies): about 250 bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class _Beside:
    """The files beside a source's DCP data: those copied byte for byte, those left out, and why."""

    copied: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def _files_beside(index: CheckpointIndex, folders: tuple[str, ...]) -> _Beside:
    """Sort the entries of a local DCP source folder that are neither ``.metadata`` nor data files.

    Lightning's ``meta.pt`` and accelerate's world-size-independent files are copied; the rest
    (accelerate's per-rank ``random_states_<r>.pkl``, anything unknown) is left out. Nothing is
    opened. A full file, per-rank files or a remote source: nothing beside.
    """
    root = index.checkpoint_id
    accelerate = index.producer == "accelerate"
    if not isinstance(root, Path) or not root.is_dir() or not (accelerate or (root / METADATA_FILENAME).is_file()):
        return _Beside()
    known = {METADATA_FILENAME, *index.data_files, *folders}
    copied, rng, unknown = [], [], []
    for path in sorted(root.iterdir()):
        name = path.name
        if name in known or name.startswith(".") or _DATA_FILE_RE.match(name):
            continue
        if path.is_file() and (
            (name == LIGHTNING_META_FILENAME and index.producer == "lightning")
            or (accelerate and ACCELERATE_SHARED_RE.match(name))  # schedulers, samplers, scaler, custom objects
        ):
            copied.append(name)
        elif accelerate and _ACCELERATE_RNG_RE.match(name):
            rng.append(name)
        else:
            unknown.append(name + ("/" if path.is_dir() else ""))
    notes = []
    if rng:
        notes.append(
            f"left out {', '.join(rng)}: accelerate's per-rank RNG states (pickles, never loaded) belong to the "
            "old ranks; load_state then keeps each rank's current RNG state and accelerator.step, which they also hold"
        )
    if unknown:
        notes.append(f"left out {', '.join(unknown)}: not part of the checkpoint as this tool knows it; copy them if they apply")
    return _Beside(copied=tuple(copied), left_out=tuple(rng + unknown), notes=tuple(notes))


def _copy_beside(root: Path, tmp: Path, names: tuple[str, ...]) -> None:
    """Copy each file byte for byte (never loaded) into the output, fsynced; a link out of ``root`` is refused."""
    for name in names:
        source = open_inside(root, root / name)  # no file followed out of the checkpoint (UnsafeContentError)
        try:
            with open(source, "rb", closefd=False) as src, open(tmp / name, "xb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
        finally:
            os.close(source)


def _write_index(folder: Path, plan: ReshardPlan, values: list[StoredChunk], version: str | None, compress: bool) -> None:
    """Rank 0's process, once every worker is done: write the folder's ``.metadata`` (after compressing the rank files)."""
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
    rows = stored + values
    if compress:  # compressed sizes are known only once compressed: a pass over the laid-out rank files
        rows = compress_data_files(folder, rows, threads=len(os.sched_getaffinity(0)))
    write_metadata(folder, entries, rows, version)


def _output_bytes(plans: tuple[tuple[str, ReshardPlan], ...], root: Location, copied: tuple[str, ...]) -> int:
    """The resharded output's size, in bytes, from its plans (known before any data is read).

    Every rank file as laid out, the values rank 0 appends, ``.metadata`` (``_METADATA_BYTES_PER_CHUNK``
    per chunk, an estimate on the high side) and the files copied beside.
    """
    total = 0
    for _, plan in plans:
        ends = dict.fromkeys(plan.data_ranks, 0)
        for p in plan.payloads:
            ends[p.chunk.rank] = max(ends[p.chunk.rank], p.offset + p.layout.size)
        values = [item for item in plan.items if not item.is_tensor]
        if values:
            ends[0] = plan.values_offset + sum(item.nbytes + RECORD_TAIL_BYTES for item in values)
        total += sum(ends.values()) + _METADATA_BYTES_PER_CHUNK * (sum(len(c) for c in plan.chunks) + 1)
    if isinstance(root, Path):
        total += sum((root / name).stat().st_size for name in copied)
    return total


def reshard(
    checkpoint_id: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    world_size: int,
    nproc: int | None = None,
    options: TransformOptions | None = None,
    overwrite: bool = False,
    force: bool = False,
    space_check: bool = True,
    check_crc: bool = True,
    cluster: Cluster | None = None,
    compress: Literal["zstd"] | None = None,
    resume: bool = False,
    progress: bool = False,
    follow_symlinks: bool | None = None,
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
    ``random_states_<r>.pkl`` and unknown files are left out; ``ReshardResult.notes`` says so.

    Args:
        checkpoint_id: the source: a DCP folder (or accelerate's parent folder), per-rank files, a
            full torch.save or safetensors file, or a Hugging Face or PEFT folder.
        output: the output folder.
        world_size: the target world size.
        nproc: workers, each moving its share of the chunks (balanced by bytes) into any rank
            file; default ``plan.default_nproc`` (one per CPU core, at most one per data file and 2 GiB).
        options: key and dtype transforms, as for ``consolidate``; the output keeps the source's
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

    Raises:
        As ``consolidate``; InvalidOptionError for ``world_size < 1``, or ``compress="zstd"`` without
        the ``zstandard`` package (before anything is read).
    """
    if follow_symlinks is not None:  # the setting travels in the environment, so workers take it too
        with following_symlinks(follow_symlinks):
            return reshard(**{**locals(), "follow_symlinks": None})
    # a Python caller's bad value is an InvalidOptionError naming the keyword (the CLI checked its flags)
    world_size, options = count("--world-size", world_size), transform_options(options)
    nproc = None if nproc is None else count("--nproc", nproc)
    if compress is not None:
        if compress != "zstd":
            raise InvalidOptionError(f"--compress {compress}: only zstd is supported")
        require_zstd()
    check_output(output, (checkpoint_id,), overwrite=overwrite, force=force)  # not onto the input, first
    tag = shared_tag(cluster)
    with local_output(output, overwrite=overwrite, shared=tag is not None, last=(METADATA_FILENAME,)) as (output, shown):
        start = time.monotonic()
        source = as_location(checkpoint_id)
        index = read_index(source, full_files=True)  # a DCP-like folder, or a full file / HF folder
        check_output_free(output, overwrite=overwrite, force=force, directory=True)
        check_data_files(index)
        items = prepare_items(index, options or TransformOptions(), GROUPS, check_crc=check_crc, keep_layout=True)
        workers = job_world_size(nproc, cluster) or default_nproc(
            sum(item.nbytes for item in items), len(index.data_files) or 1, len(os.sched_getaffinity(0))
        )
        parts = split_by_folder(items)
        plans = tuple((sub, plan_reshard(index, part, world_size, nproc=workers)) for sub, part in parts)
        beside = _files_beside(index, tuple(sub for sub, _ in parts if sub))
        url = shown if isinstance(shown, Url) and compress is None else None  # object storage: rank files go up wave by wave
        if space_check:
            needed = reshard_staging_bytes(plans) if url else _output_bytes(plans, index.checkpoint_id, beside.copied)
            check_space(output, needed, directory=True, tag=tag, shown=shown)
        owner, file_bytes = False, 0
        fingerprint = None if isinstance(shown, Url) else reshard_fingerprint(index, plans, compress)  # staged uploads: none
        temporary = temporary_output(output, overwrite=overwrite, directory=True, tag=tag, fingerprint=fingerprint, resume=resume)
        with temporary as (tmp, resumable):
            job = ReshardJob(
                checkpoint_id=index.checkpoint_id,
                plans=plans,
                tmp_output=tmp,
                check_crc=check_crc,
                resume=resumable,
                progress=progress,
            )
            owner, values, uploaded = reshard_in_waves(reshard_rank, job, workers, cluster, url)  # .metadata last
            if not owner:
                raise LeaveToOwner
            for sub, plan in plans:
                stored = [StoredChunk.from_json(row) for row in values[sub]]
                _write_index(tmp / sub, plan, stored, index.version, compress == "zstd")
            if beside.copied:
                assert isinstance(index.checkpoint_id, Path)
                _copy_beside(index.checkpoint_id, tmp, beside.copied)
            file_bytes = uploaded + sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        chunks = sum(len(c) for _, plan in plans for item, c in zip(plan.items, plan.chunks, strict=True) if item.is_tensor)
        result = ReshardResult(
            output=output,
            target_world_size=world_size,
            chunks=chunks,
            file_bytes=file_bytes,
            nproc=workers,
            seconds=time.monotonic() - start,
            owner=owner,
            folders=tuple(sub for sub, _ in plans),
            copied=beside.copied,
            left_out=beside.left_out,
            notes=beside.notes,
        )
        for note in beside.notes:
            logger.info("%s", note)
    return dataclasses.replace(result, output=shown)
