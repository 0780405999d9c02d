"""Operation ``verify``, the read stage on both sides: two checkpoints of any formats compared key by key.

Each side is found once (``formats.open_checkpoint``) and read as ``consolidate`` reads its input,
through its items and its ``Source``'s reader (``ops._sources``), as flat keys: DCP's flattened keys
(``model.layers.0.attn.wq.weight``, ``optim.state.<fqn>.exp_avg``, ``optim.param_groups.0.lr``),
whose values are loaded one at a time. With ``dtype``/``optim_dtype`` both sides are compared
after the cast ``consolidate --dtype``/``--optim-dtype`` applies. A tensor both sides store as its
bytes (DCP payloads, a torch.save file's contiguous tensors: ``SideView.located``) is compared as
those bytes (``_compare.same_stored_bytes``), so comparing a DCP checkpoint with its consolidated
file imports no torch, as ``consolidate`` does not; torch comes in for a cast, a tolerance, or a
tensor read otherwise (and to describe a difference found).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdp_convert.formats import Source
from fsdp_convert.formats.index import TensorEntry
from fsdp_convert.held_roots import following_symlinks
from fsdp_convert.launch import WorkerGroup, job_world_size, launched_by_torchrun, run_ranks, worker_bars
from fsdp_convert.ops._compare import ByteBuffers, StoredPieces, cast, compare, same_stored_bytes
from fsdp_convert.ops._sources import Side, SideView, find_source, key_group, open_sides, open_source, open_views
from fsdp_convert.ops.options import VerifyOptions
from fsdp_convert.plan.consolidate import Only, default_nproc
from fsdp_convert.progress import StepProgress
from fsdp_convert.transform import TransformOptions, parse_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["SideView", "open_source", "Difference", "VerifyOptions", "VerifyResult", "verify", "verify_sources"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Difference:
    """One way two checkpoints differ.

    Attributes:
        key: the flat key (``model.layers.0.attn.wq.weight``, ``optim.param_groups.0.lr``).
        kind: ``differs`` (both have it), ``missing`` (only in A) or ``extra`` (only in B).
        detail: what differs (dtype, shape, max abs difference, values).
    """

    key: str
    kind: str
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyResult:
    """Outcome of ``verify``: equal when ``differences`` is empty.

    ``owner`` is False in a process of a multi-process run that does not hold rank 0: its
    ``differences`` then lack the other ranks' (rank 0's process has them all).
    """

    a: str | os.PathLike[str]
    b: str | os.PathLike[str]
    compared: int
    differences: tuple[Difference, ...]
    owner: bool = True
    note: str = ""
    """How the sides were seen, when not as asked (a sharded side seen as ``consolidate`` names its keys); empty otherwise."""

    @property
    def equal(self) -> bool:
        """True when every key is in both and every value matches."""
        return not self.differences

    def to_json_dict(self) -> dict[str, Any]:
        """JSON-ready form with ``schema_version`` 1."""
        return {
            "schema_version": 1,
            "a": str(self.a),
            "b": str(self.b),
            "equal": self.equal,
            "compared": self.compared,
            "differences": [{"key": d.key, "kind": d.kind, "detail": d.detail} for d in self.differences],
        } | ({"note": self.note} if self.note else {})


def _cast_dtype(key: str, views: tuple[SideView, SideView], casts: tuple[torch.dtype | None, ...]) -> torch.dtype | None:
    """What ``consolidate`` casts ``key``'s floating tensor to (``casts``: dtype, optim_dtype), or None.

    Model weights take the dtype, optimizer state (never ``step``) the optim_dtype; the group is the
    first side's that ``consolidate`` classifies (``Side.classified``), else the key's.
    """
    group = next((g for view in views if (g := view.group(key)) is not None), None) or key_group(key)
    parts = key.split(".")
    if group == "optim" and len(parts) > 2 and parts[1] == "state" and parts[-1] != "step":
        return casts[1]
    return casts[0] if group == "model" else None


def verify(
    a: str | os.PathLike[str] | Source,
    b: str | os.PathLike[str],
    options: VerifyOptions | TransformOptions | None = None,
    **kwargs: Any,
) -> VerifyResult:
    """Compare two checkpoints of any formats (DCP, .pt, safetensors, HF folder) key by key.

    Keys are DCP's flattened keys (see ``open_source``); when either side holds model weights only
    (safetensors), only ``model.*`` keys are compared. Tensors must have the same dtype and shape
    and, by default, the same bits; with ``atol``/``rtol`` floating tensors may differ within
    ``torch.allclose``. Plain values must be equal and of the same type. A tensor both sides store
    as its bytes (DCP payloads, a torch.save file's contiguous tensors), with no cast or tolerance
    asked, is compared as those bytes, ``_compare.BLOCK_BYTES`` at a time (no torch imported for
    it); any other is read as a value, and each process holds at most two tensors of each side
    (the next key's are read, A and B each in a thread, while one is compared).

    When one side is a full file and the other sharded, and their keys differ as saved but match
    with the sharded side seen as ``consolidate`` writes it by default (``transform`` not given),
    they are compared that way and ``VerifyResult.note`` says so.

    With ``dtype``/``optim_dtype``, floating tensors of a side not already in that dtype are first
    cast as ``consolidate --dtype``/``--optim-dtype`` casts them, so a ``--dtype bf16`` output equals
    its fp32 checkpoint bit for bit (NaNs of a cast tensor compare as NaNs, whatever their bits).

    Each side is found once (its format decided, its index read: ``formats.open_checkpoint``), then
    compared by ``verify_sources``; ``follow_symlinks`` holds for the whole call, workers included.

    Args:
        a: the reference checkpoint, or its ``Source`` when already found (not read again).
        b: the checkpoint to check against it.
        options: a ``VerifyOptions`` (its fields: ``atol``, ``rtol``, ``only``, ``check_crc``,
            ``transform``, ``nproc``, ``cluster``, ``in_process``, ``dtype``, ``optim_dtype``,
            ``progress``, ``transform_files``, ``follow_symlinks``); or, as before, the
            ``TransformOptions`` a DCP side is seen through (``transform``); None: the defaults.
        **kwargs: fields of ``VerifyOptions`` (they replace those of ``options``).

    Returns:
        The keys compared and every difference (``missing``: only in A; ``extra``: only in B).

    Raises:
        CheckpointNotFoundError, NotADcpCheckpointError, UnsafeContentError, CorruptChunkError,
        MissingDataFileError, CoverageError: a side cannot be read.
        InvalidOptionError: an unknown keyword, or a bad value (``dtype`` naming no dtype, ...) naming its keyword.
    """
    opts = VerifyOptions.from_call(options, kwargs)
    with following_symlinks(opts.follow_symlinks):  # the setting travels in the environment, so workers take it too
        source_a = find_source(a, check_crc=opts.check_crc)
        source_b = find_source(b, check_crc=opts.check_crc)
        result = verify_sources(source_a, source_b, opts)
    return dataclasses.replace(result, a=source_a.checkpoint_id if isinstance(a, Source) else a, b=b)


def verify_sources(a: Source, b: Source, opts: VerifyOptions) -> VerifyResult:
    """``verify`` of two checkpoints already found (their data files checked: ``ops._sources.find_source``).

    Each side is opened once here (``ops._sources.open_sides``: its items built, its reader opened);
    workers take the items as built and open a reader each.
    ``opts.follow_symlinks`` is ``verify``'s to apply: here the process's setting holds.

    Raises:
        As ``verify``, but for a side not found.
    """
    sides, views = open_sides(a, b, opts.transform, files_too=opts.transform_files)  # 1. each side opened once
    note = ""
    try:
        keys_a, keys_b = _compared_keys(views, opts.only)  # 2. the keys of the groups compared
        if set(keys_a) != set(keys_b) and opts.transform is None and a.format.full != b.format.full:
            consolidated = _as_consolidated(a, b, opts)  # a file consolidate wrote from the sharded side
            if consolidated is not None:
                _close(views)
                sides, views, keys_a, keys_b = consolidated
                sharded = b if a.format.full else a
                note = f"{sharded.checkpoint_id} seen as consolidate names its keys (--as-consolidated): as saved, they differ"
        in_b, in_a = set(keys_b), set(keys_a)
        job = _job(opts, sides, tuple(k for k in keys_a if k in in_b), views[0])
        world_size = 1 if opts.in_process else job_world_size(opts.nproc, opts.cluster) or _default_nproc(job, views)
        here = opts.in_process or (world_size == 1 and not launched_by_torchrun())
        if here:  # 3. compare: here, with the sides already open
            owner, differing = True, _verify_rank(job, 0, 1, None, views)
    finally:
        _close(views)
    if not here:  # 3. or in workers, each opening the sides as seen here
        owner, differing = run_ranks(_verify_rank, job, world_size, opts.cluster)
    diffs = [Difference(key=k, kind="missing", detail="only in A") for k in keys_a if k not in in_b]  # 4. the result
    diffs += [Difference(key=k, kind="extra", detail="only in B") for k in keys_b if k not in in_a]
    diffs += [Difference(key=k, kind="differs", detail=d) for k, d in (differing or [])]
    shown_a, shown_b = a.checkpoint_id, b.checkpoint_id
    return VerifyResult(a=shown_a, b=shown_b, compared=len(job.keys), differences=tuple(diffs), owner=owner, note=note)


def _as_consolidated(
    a: Source, b: Source, opts: VerifyOptions
) -> tuple[tuple[Side, Side], tuple[SideView, SideView], list[str], list[str]] | None:
    """Both sides with the sharded one seen as ``consolidate`` writes it by default, when then their keys match; else None.

    Raises:
        As ``ops._sources.open_sides``.
    """
    sides, views = open_sides(a, b, TransformOptions(), files_too=opts.transform_files)
    keys_a, keys_b = _compared_keys(views, opts.only)
    if keys_a and set(keys_a) == set(keys_b):
        return sides, views, keys_a, keys_b
    _close(views)
    return None


def _default_nproc(job: _VerifyJob, views: tuple[SideView, SideView]) -> int:
    """Workers when ``nproc`` is not given: ``plan.consolidate.default_nproc`` of both sides' bytes and data files."""
    total = sum(view.tensor_bytes(key) for view in views for key in job.keys)
    files = sum(len(view.side.source.index.data_files) or 1 for view in views)
    return default_nproc(total, files, len(os.sched_getaffinity(0)))


@dataclass(frozen=True, slots=True, kw_only=True)
class _VerifyJob:
    sides: tuple[Side, Side]  # A and B, as seen, their items built (``ops._sources.Side``)
    keys: tuple[str, ...]
    atol: float | None
    rtol: float | None
    casts: tuple[torch.dtype | None, ...] = (None, None)  # verify's dtype, optim_dtype
    progress: bool = False
    sizes: tuple[int, ...] = ()  # with progress: bytes of A's tensor of each key (``SideView.tensor_bytes``)


def _job(opts: VerifyOptions, sides: tuple[Side, Side], keys: tuple[str, ...], view_a: SideView) -> _VerifyJob:
    """What every worker compares: ``keys`` of both sides as seen; with progress, A's tensor bytes per key."""
    return _VerifyJob(
        sides=sides,
        keys=keys,
        atol=opts.atol,
        rtol=opts.rtol,
        casts=tuple(parse_dtype(d).torch if isinstance(d, str) else d for d in (opts.dtype, opts.optim_dtype)),
        progress=opts.progress,
        sizes=tuple(view_a.tensor_bytes(key) for key in keys) if opts.progress else (),
    )


def _close(views: Sequence[SideView]) -> None:
    """Close every view, B's first."""
    for view in reversed(views):
        view.close()


def _compared_keys(views: tuple[SideView, SideView], only: Only) -> tuple[list[str], list[str]]:
    """Each side's keys of the groups compared: ``only``'s, and ``model`` alone when a side holds weights alone."""
    wanted = [g for g in ("model" if any(v.model_only for v in views) else None, None if only == "all" else only) if g]
    keys_a, keys_b = ([k for k in v.keys() if all(key_group(k) == g for g in wanted)] for v in views)
    return keys_a, keys_b


def _compare_keys(
    job: _VerifyJob, positions: range, progress: StepProgress, views: tuple[SideView, SideView] | None = None
) -> list[tuple[str, str]]:
    """``(key, detail)`` of every differing key of ``job.keys[positions]``, after the casts asked, in key order.

    Keys whose bytes as stored decide are compared first, as those bytes (``_compare_stored``);
    the others are read as values, the next key's while one is compared (``_read_ahead``).
    ``views``: the sides already open (kept open); None: opened from ``job.sides`` here, and closed.
    """
    if views is None:
        opened = open_views(job.sides)
        try:
            return _compare_keys(job, positions, progress, opened)
        finally:
            _close(opened)
    mine: list[tuple[str, str]] = []
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="verify-read") as pool:
        try:
            read = _compare_stored(job, positions, progress, views, pool)  # what needs no value read, first
            for i, (value_a, value_b) in zip(read, _read_ahead(pool, views, [job.keys[i] for i in read])):
                key = job.keys[i]
                target = _cast_dtype(key, views, job.casts)
                value_a, cast_a = cast(value_a, target)
                value_b, cast_b = cast(value_b, target)
                any_nan = cast_a or cast_b or views[0].was_cast(key) or views[1].was_cast(key)
                detail = compare(value_a, value_b, job.atol, job.rtol, any_nan=any_nan)
                if detail is not None:
                    mine.append((key, detail))
                del value_a, value_b
                progress.advance(job.sizes[i] if job.sizes else 0)
        finally:
            pool.shutdown(cancel_futures=True)  # the reads under way end before the views close
    order = {key: i for i, key in enumerate(job.keys)}
    return sorted(mine, key=lambda kd: order[kd[0]])


def _stored_pair(job: _VerifyJob, key: str, views: tuple[SideView, SideView]) -> tuple[StoredPieces, StoredPieces] | None:
    """Both sides' pieces of ``key``'s tensor as stored, when its bytes alone decide (``SideView.located``); else None.

    That is: no tolerance and no cast asked for it, one dtype and shape on both sides, and both
    located as stored.

    Raises:
        As ``SideView.located``.
    """
    if job.atol is not None or job.rtol is not None or _cast_dtype(key, views, job.casts) is not None:
        return None
    entry_a, entry_b = (view.item(key).entry for view in views)
    if not isinstance(entry_a, TensorEntry) or not isinstance(entry_b, TensorEntry):
        return None
    if (entry_a.dtype_name, entry_a.shape) != (entry_b.dtype_name, entry_b.shape):
        return None
    pieces_a = views[0].located(key)
    pieces_b = views[1].located(key) if pieces_a is not None else None
    return None if pieces_a is None or pieces_b is None else (pieces_a, pieces_b)


def _compare_stored(
    job: _VerifyJob, positions: range, progress: StepProgress, views: tuple[SideView, SideView], pool: ThreadPoolExecutor
) -> list[int]:
    """Compare every key of ``positions`` whose bytes as stored decide (``_stored_pair``); the positions left to read.

    Those left: keys read as values (``SideView.get``), and keys whose bytes differ, read again
    for ``compare`` to say how.

    Raises:
        As ``SideView.located`` and ``_compare.same_stored_bytes``.
    """
    left: list[int] = []
    buffers = ByteBuffers()
    for i in positions:
        pair = _stored_pair(job, job.keys[i], views)
        if pair is None or not same_stored_bytes(*pair, pool, buffers):
            left.append(i)
        else:
            progress.advance(job.sizes[i] if job.sizes else 0)
    return left


def _read_ahead(pool: ThreadPoolExecutor, views: tuple[SideView, SideView], keys: list[str]) -> Iterator[tuple[Any, Any]]:
    """Each key's values on both sides, in order; the next key's are read (A and B each in its thread) while this one is compared.

    At most two keys' values of each side are in memory at a time, and each view is read by one
    thread at a time. Reading errors are raised where that key's values are taken.
    """

    def both(key: str) -> tuple[Future[Any], Future[Any]]:
        return pool.submit(views[0].get, key), pool.submit(views[1].get, key)

    ahead = both(keys[0]) if keys else None
    for position in range(len(keys)):
        assert ahead is not None
        value_a, value_b = ahead[0].result(), ahead[1].result()
        ahead = both(keys[position + 1]) if position + 1 < len(keys) else None
        yield value_a, value_b


def _verify_rank(
    job: _VerifyJob,
    rank: int,
    world_size: int,
    group: WorkerGroup | None,
    views: tuple[SideView, SideView] | None = None,
) -> list[tuple[str, str]] | None:
    """Compare keys ``rank, rank + world_size, ...``; rank 0 gathers every rank's differences.

    The differences travel as JSON (``WorkerGroup.gather``), never as pickles. With
    ``job.progress``, rank 0's worker draws the ``verify`` bar, its last frame once gathered.
    ``views``: both sides already open in this process (compared here); None: each worker opens them.

    Returns:
        On rank 0, ``(key, detail)`` of every differing key, in key order; None elsewhere.
    """
    positions = range(rank, len(job.keys), world_size)
    share = sum(job.sizes[i] for i in positions) if job.sizes else 0
    with worker_bars(job.progress, rank, group).step("verify", "verify", sum(job.sizes), share) as progress:
        mine = _compare_keys(job, positions, progress, views)
        progress.flush()  # every rank's bytes are counted before rank 0 gathers
        if group is None:
            return mine
        gathered = group.gather(mine)
    if gathered is None:
        return None
    mine = [(str(k), str(d)) for rows in gathered for k, d in rows]
    order = {key: i for i, key in enumerate(job.keys)}
    return sorted(mine, key=lambda kd: order[kd[0]])
