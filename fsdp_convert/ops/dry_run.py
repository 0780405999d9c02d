"""``--dry-run``: the plan of a ``consolidate`` or ``reshard`` run, made by the run's own stages, with nothing created.

``dry_run_consolidate`` and ``dry_run_reshard`` check OUT (``writers.transaction.check_output``,
``check_output_free``), open the checkpoint's index, choose the output kind, prepare the items
and plan as the operations do, then stop where the run would take its lock: no lock, no
temporary, no OUT, no folder is created. What they add is read off the plan:

- the output files and their sizes as the plan places them (the space check's figures);
- the workers and the bytes each moves;
- peak resident memory per process and for the whole process tree: a baseline (this process's
  resident memory once the index is read and the plan made, plus torch's import when the run's
  workers compute tensors and torch is not loaded here), the mover buffers the memory budget
  allows (``plan.consolidate.mover_buffers``) and ``SLACK_BYTES``;
- the free space where the temporary is written, against what the run needs there;
- an estimated time: up to ``PROBE_BYTES`` of the source's data files are read and timed, and
  the bytes to move are divided by that rate.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.formats import Source, open_checkpoint
from fsdp_convert.held_roots import following_symlinks
from fsdp_convert.launch import shared_tag
from fsdp_convert.lora import lora_only
from fsdp_convert.ops._deepspeed_reshard import writes_zero, zero_files
from fsdp_convert.ops._run_plan import SLACK_BYTES, PlannedFile, RunPlan
from fsdp_convert.ops.consolidate import open_assets, output_items, plan_for
from fsdp_convert.ops.options import ConsolidateOptions, ReshardOptions
from fsdp_convert.ops.reshard import METADATA_BYTES_PER_CHUNK, adapter_files, files_beside, folder_plans, space_needed_bytes
from fsdp_convert.output_table import METADATA_FILENAME
from fsdp_convert.outputs import output_kind, own_files, reshard_kind
from fsdp_convert.plan.consolidate import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    file_bytes,
    mover_buffers,
    output_bytes,
)
from fsdp_convert.plan.items import prepare_items
from fsdp_convert.plan.reshard import rank_file_bytes
from fsdp_convert.producers import detect_producer
from fsdp_convert.progress import human_bytes
from fsdp_convert.remote import Url, as_location
from fsdp_convert.transform import TransformOptions
from fsdp_convert.writers.dcp import rank_filename
from fsdp_convert.writers.transaction import check_output, check_output_free, free_bytes, temporary_path

__all__ = ["PROBE_BYTES", "SLACK_BYTES", "TORCH_IMPORT_BYTES", "RunPlan", "dry_run_consolidate", "dry_run_reshard"]

PROBE_BYTES = 64 << 20  # the most the read-speed probe reads of the source's data files
TORCH_IMPORT_BYTES = 256 << 20  # resident memory torch's import adds (about 200 MiB measured with torch 2.x), rounded up
START_SECONDS = 0.5  # a run's start-up (forkserver, workers), added to the estimate when it starts workers


def _existing(folder: Path) -> Path:
    """``folder``, or its nearest ancestor that exists: the filesystem whose free space the run's space check reads."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _resident_bytes() -> int:
    """This process's resident memory now (``VmRSS``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _computes(transform: TransformOptions) -> bool:
    """Whether the run computes tensors (a cast, an adapter, --dequantize, --quantize): its workers then import torch."""
    return bool(transform.dtype or transform.optim_dtype or transform.adapter or transform.dequantize or transform.quantize)


def _baseline(transform: TransformOptions) -> tuple[int, str]:
    """One process's resident memory before it moves anything, in bytes, and how it was measured."""
    rss = _resident_bytes()
    note = f"this process's resident memory after planning (VmRSS, {human_bytes(rss)})"
    if _computes(transform) and "torch" not in sys.modules:
        return rss + TORCH_IMPORT_BYTES, note + f" + torch's import ({human_bytes(TORCH_IMPORT_BYTES)})"
    return rss, note


def _probe(source: Source) -> tuple[int, float]:
    """Read up to ``PROBE_BYTES`` of the source's local data files, in order; the bytes read and the seconds taken.

    Links are not followed (``O_NOFOLLOW``); a file that cannot be opened is skipped. A remote
    source is not probed (0 bytes). Pages already in the page cache read faster than the disk.
    """
    root = source.index.checkpoint_id
    if isinstance(root, Url):
        return 0, 0.0
    paths = [root / name for name in source.index.data_files] if root.is_dir() else [root]
    buf = bytearray(8 << 20)
    done, start = 0, time.perf_counter()
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        with os.fdopen(fd, "rb", buffering=0) as f:
            while done < PROBE_BYTES and (n := f.readinto(memoryview(buf)[: PROBE_BYTES - done])):
                done += n
        if done >= PROBE_BYTES:
            break
    return done, time.perf_counter() - start


def _estimate(source: Source, read_bytes: int, workers: int) -> tuple[int, float, float | None, str]:
    """The probe's bytes and seconds, the estimated run time in seconds, and how it was estimated."""
    probed, seconds = _probe(source)
    if probed == 0 or seconds <= 0:
        return probed, seconds, None, "no local data file to probe: the read speed is unknown"
    rate = probed / seconds
    start = START_SECONDS if workers > 1 else 0.0
    note = (
        f"read {human_bytes(probed)} of the source in {seconds:.3f} s ({human_bytes(rate)}/s; cached pages read "
        f"faster than the disk); time = {human_bytes(read_bytes)} to move at that rate, as one reader"
        + (f", + {start:.1f} s to start the workers" if start else "")
        + "; parallel workers may be faster"
    )
    return probed, seconds, read_bytes / rate + start, note


def _local_output(output: str | os.PathLike[str]) -> Path:
    """OUT as a local path.

    Raises:
        InvalidOptionError: OUT is a URL (its local staging copy is made only by a run).
    """
    location = as_location(output)
    if isinstance(location, Url):
        raise InvalidOptionError(f"--dry-run plans a local OUT; {output} is a URL: run without --dry-run")
    return location


def _memory(transform: TransformOptions, workers: int, buffers: int, in_process: bool) -> tuple[int, str, int, int, int]:
    """Baseline, its note, processes, peak per process and for the tree, in bytes (``RunPlan``'s fields)."""
    baseline, note = _baseline(transform)
    mover = baseline + buffers + SLACK_BYTES
    if in_process:  # one process moves everything
        return baseline, note, 1, mover, mover
    helpers = 2  # the forkserver and its resource tracker, each at most a baseline
    return baseline, note, workers + 1 + helpers, mover, workers * mover + (baseline + SLACK_BYTES) + helpers * baseline


def _run_plan(
    command: str,
    checkpoint_id: str | os.PathLike[str],
    output: str | os.PathLike[str],
    source: Source,
    producer: str,
    output_kind: str,
    files: tuple[PlannedFile, ...],
    total_bytes: int,
    loads: tuple[int, ...],
    opts: ConsolidateOptions | ReshardOptions,
    *,
    budget_bytes: int,
    temporary: Path,
) -> RunPlan:
    """The plan both commands print: their files and per-worker loads (bytes), with memory, space and time added."""
    workers = len(loads)
    threads, piece = mover_buffers(budget_bytes)
    in_process = workers == 1 and (opts.cluster is None or not opts.cluster.multi_node)
    local = opts.nproc if opts.cluster is not None and opts.cluster.multi_node and opts.nproc else workers
    baseline, note, processes, peak, tree = _memory(opts.transform, local, threads * 2 * piece, in_process)
    probed, probe_seconds, seconds, how = _estimate(source, sum(loads), workers)
    folder = temporary.parent
    return RunPlan(
        command=command,
        checkpoint=os.fspath(checkpoint_id),
        output=os.fspath(output),
        producer=producer,
        output_kind=output_kind,
        files=files,
        output_bytes=total_bytes,
        workers=workers,
        worker_bytes=loads,
        processes=processes,
        baseline_bytes=baseline,
        baseline_note=note,
        buffer_bytes=threads * 2 * piece,
        peak_process_bytes=peak,
        peak_tree_bytes=tree,
        temporary=str(temporary),
        space_folder=os.path.abspath(_existing(folder)),
        needed_bytes=total_bytes,
        free_bytes=free_bytes(folder),
        read_bytes=sum(loads),
        probe_bytes=probed,
        probe_seconds=probe_seconds,
        seconds=seconds,
        estimate_note=how,
    )


def dry_run_consolidate(
    checkpoint_id: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: ConsolidateOptions | TransformOptions | None = None,
    **kwargs: Any,
) -> RunPlan:
    """The plan of ``ops.consolidate.consolidate`` with the same arguments, creating nothing.

    The run's stages, in its order: OUT checked, the checkpoint opened, the output kind chosen,
    ``--hf-assets`` opened, the items prepared and the plan made. Nothing is locked or written;
    up to ``PROBE_BYTES`` of the data files are read to time the source.

    Raises:
        As ``consolidate`` before its lock: what the run would refuse before it writes anything.
        InvalidOptionError: OUT is a URL.
    """
    opts = ConsolidateOptions.from_call(options, kwargs)
    with following_symlinks(opts.follow_symlinks):
        check_output(output, (checkpoint_id, opts.hf_assets), overwrite=opts.overwrite, force=opts.force)
        out = _local_output(output)
        source = open_checkpoint(as_location(checkpoint_id), full_files=True, check_crc=opts.check_crc, weights=opts.weights)
        kind = output_kind(out, opts.output_format, lora=lora_only(opts.transform))
        groups = kind.groups(opts.only)
        assets = open_assets(opts, kind, groups)
        check_output_free(out, overwrite=opts.overwrite, force=opts.force, directory=kind.directory)
        source.check_data_files()
        items, _ = output_items(source, opts, groups, assets)
        plan = plan_for(source, items, out, kind, opts)  # the run's own stage 6
        files = tuple(PlannedFile(name=f.filename or "", nbytes=file_bytes(plan, f)) for f in plan.files)
        return _run_plan(
            "consolidate", checkpoint_id, output, source, detect_producer(source.index).name, kind.name,
            files, output_bytes(plan), tuple(plan.bytes_per_rank()), opts, budget_bytes=opts.memory_budget_bytes,
            temporary=temporary_path(out, shared_tag(opts.cluster), directory=kind.directory),
        )  # fmt: skip


def dry_run_reshard(
    checkpoint_id: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: ReshardOptions | TransformOptions | None = None,
    **kwargs: Any,
) -> RunPlan:
    """The plan of ``ops.reshard.reshard`` with the same arguments, creating nothing.

    The run's stages, in its order: OUT checked, the checkpoint opened and its producer detected,
    the items prepared and checked, a plan per DCP folder, the files beside sorted (the adapter's
    own too: ``AdapterRecord.files``). Nothing is locked or written; up to ``PROBE_BYTES`` of the
    data files are read to time the source.

    Raises:
        As ``reshard`` before its lock. InvalidOptionError: OUT is a URL.
    """
    opts = ReshardOptions.from_call(options, kwargs)
    with following_symlinks(opts.follow_symlinks):
        names = own_files()
        check_output(output, (checkpoint_id,), overwrite=opts.overwrite, force=opts.force, own_files=names)
        out = _local_output(output)
        source = open_checkpoint(as_location(checkpoint_id), full_files=True, check_crc=opts.check_crc)
        index, producer = source.index, detect_producer(source.index)
        if writes_zero(opts, producer.name):  # a DeepSpeed save for M ranks (ops._deepspeed_reshard), as the run writes it
            check_output_free(out, overwrite=opts.overwrite, force=opts.force, directory=True, own_files=names)
            zero = tuple(PlannedFile(name=name, nbytes=nbytes) for name, nbytes in zero_files(source, opts.world_size))
            total = sum(f.nbytes for f in zero)
            return _run_plan(
                "reshard", checkpoint_id, output, source, producer.name, "deepspeed", zero, total, (total,), opts,
                budget_bytes=DEFAULT_MEMORY_BUDGET_BYTES, temporary=temporary_path(out, shared_tag(opts.cluster), directory=True),
            )  # fmt: skip
        kind = reshard_kind()
        check_output_free(out, overwrite=opts.overwrite, force=opts.force, directory=kind.directory, own_files=names)
        source.check_data_files()
        items = prepare_items(source, opts.transform, kind.groups(), keep_layout=True)
        kind.check_keys(item.path for item in items)
        plans, workers = folder_plans(index, items, opts)
        beside = files_beside(index, producer, plans)
        added = adapter_files(opts.transform, beside)
        needed = space_needed_bytes(plans, index, beside, None, added)
        files = []
        loads = [0] * workers
        for sub, plan in plans:
            for rank, nbytes in sorted(rank_file_bytes(plan).items()):
                files.append(PlannedFile(name=(Path(sub) / rank_filename(rank)).as_posix(), nbytes=nbytes))
            files.append(
                PlannedFile(
                    name=(Path(sub) / METADATA_FILENAME).as_posix(),
                    nbytes=METADATA_BYTES_PER_CHUNK * (sum(len(c) for c in plan.chunks) + 1),
                )
            )
            for p in plan.payloads:
                loads[p.owner] += p.placement.size
            loads[0] += sum(item.nbytes for item in plan.items if not item.is_tensor)
        if isinstance(index.checkpoint_id, Path):
            files += [PlannedFile(name=name, nbytes=(index.checkpoint_id / name).stat().st_size) for name in beside.copied]
        files += [PlannedFile(name=name, nbytes=len(data)) for name, data in added.items()]
        return _run_plan(
            "reshard", checkpoint_id, output, source, producer.name, kind.name, tuple(files), needed, tuple(loads), opts,
            budget_bytes=DEFAULT_MEMORY_BUDGET_BYTES,  # reshard's workers move with the default budget
            temporary=temporary_path(out, shared_tag(opts.cluster), directory=kind.directory),
        )  # fmt: skip
