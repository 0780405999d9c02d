"""Operation ``consolidate``: open the source, choose the output kind, plan, then every worker moves its tensors (launch).

The plan places every output file before any data is read, so each worker writes its own
tensors at their offsets in the output files (``move``), on one node or many; rank 0 then gathers
the CRC-32s, reads the plain values and has the output's kind (``outputs``) write the headers,
pickles and the folder's index. No tensor crosses between workers. A progress bar on stderr
(``progress``) counts every worker's bytes written.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_convert.errors import InvalidOptionError, VerificationError
from fsdp_convert.formats import Source, open_checkpoint
from fsdp_convert.formats.index import Location
from fsdp_convert.held_roots import following_symlinks
from fsdp_convert.item import OutputItem
from fsdp_convert.launch import job_world_size, run_ranks, shared_tag
from fsdp_convert.lora import lora_only
from fsdp_convert.ops._consolidate_rank import ConsolidateJob, consolidate_rank
from fsdp_convert.ops._waves import consolidate_in_waves, consolidate_staging_bytes
from fsdp_convert.ops.options import ConsolidateOptions
from fsdp_convert.outputs import OutputKind, last_files, output_kind
from fsdp_convert.plan.consolidate import WorkPlan, output_bytes, plan_consolidate
from fsdp_convert.plan.items import leave_out_model_keys, prepare_items
from fsdp_convert.remote import as_location
from fsdp_convert.resume import consolidate_fingerprint
from fsdp_convert.roles import Group
from fsdp_convert.transform import TransformOptions
from fsdp_convert.writers.hf_assets import HfAssets, open_hf_assets, tied_output_keys
from fsdp_convert.writers.safetensors import safetensors_name
from fsdp_convert.writers.transaction import LeaveToOwner, OutputTransaction

__all__ = ["ConsolidateResult", "consolidate"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsolidateResult:
    """What ``consolidate`` wrote.

    Attributes:
        output: the output file.
        output_format: ``torch_save``, ``safetensors`` or ``hf_dir`` (the output kind's name).
        tensors: number of tensors written.
        values: number of plain values written (param group fields, train state).
        tensor_bytes: tensor data written, in bytes.
        file_bytes: size of the output file, in bytes.
        nproc: number of reading workers (all nodes).
        seconds: wall time, in seconds.
        owner: False in a process whose workers do not hold rank 0 (another node of a multi-node
            run, or a non-zero rank under the user's torchrun): it read and sent its share, and
            rank 0's process wrote the output (``file_bytes`` is then 0).
    """

    output: Location
    output_format: str
    tensors: int
    values: int
    tensor_bytes: int
    file_bytes: int
    nproc: int
    seconds: float
    owner: bool = True


def consolidate(
    checkpoint_id: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: ConsolidateOptions | TransformOptions | None = None,
    **kwargs: Any,
) -> ConsolidateResult:
    """Write a DCP checkpoint as one full (unsharded) state dict: a file, or a folder of shards.

    The stages are docs/architecture.md's, each marked in the body (``# N. stage:``).

    Args:
        checkpoint_id: the DCP checkpoint folder (or accelerate's parent folder of
            ``pytorch_model_fsdp_0/`` and ``optimizer_0/``), per-rank files, or any output of this
            tool: a torch.save file (any name), a safetensors file, a Hugging Face or PEFT folder.
        output: the output kind is chosen by its suffix (``output_table``): ``.pt``/``.pth``/``.bin``
            for torch.save of the nested state dict (``{"model": {fqn: tensor}, "optim": {"state":
            {fqn: {...}}, "param_groups": [...]}, ...}``, as ``get_model_state_dict`` /
            ``get_optimizer_state_dict`` with ``full_state_dict=True`` give it; in the producer's
            layout, the default, the optimizer keeps its saved key and a producer's merged file,
            Lightning's ``meta.pt`` or Megatron-Core's ``common.pt``, is merged as its own loader
            does); ``.safetensors`` for the model weights in one file; a folder (no suffix) for
            Hugging Face safetensors shards with ``model.safetensors.index.json``, plus
            ``optimizer.pt`` and ``extra_state.pt`` when ``only`` is ``all``.
        options: a ``ConsolidateOptions`` (``ops.options``: each field's docstring is its reference,
            with units and defaults), or, as before it, a ``TransformOptions`` (its ``transform``).
        **kwargs: ``ConsolidateOptions`` fields; they replace those of ``options`` (an unknown one
            is an InvalidOptionError).

    Returns:
        What was written (``owner`` False on the processes that did not write).

    Raises:
        CheckpointNotFoundError, NotADcpCheckpointError, UnsafeContentError: unreadable index.
        InvalidOptionError: ``output`` is the checkpoint (or ``hf_assets``), inside it or one of its folders;
            unknown suffix, optimizer state into a safetensors file, bad ``nproc``,
            two keys renamed to one; ``hf_assets`` for a file output, without a ``config.json``, or
            whose config unties ``lm_head.weight`` which the output would not hold.
        UnsupportedTransformError: ``optim_keys="ids"`` without param groups listing the parameters,
            or a merged file (Lightning's ``meta.pt``, Megatron's ``common.pt``) holding a tensor
            larger than 1 MiB, sparse or quantized, or inside a tuple or set (``layout="nested"``
            leaves the file out).
        OutputExistsError: ``output`` exists and ``overwrite`` is false, is a link, or is a folder not
            this tool's and ``force`` is false.
        MissingDataFileError, CorruptChunkError, CoverageError, ShapeMismatchError: bad data files.
        OutputWriteError: the output cannot be written, or (``space_check``) does not fit in the free space.
        WorkerFailedError: a worker died.
        VerificationError: ``verify_output`` found a difference (nothing is left at ``output``).
            ``verify_output`` with a computed tensor (a LoRA merge, whose float rounding depends on
            the row block size) is an InvalidOptionError; an adapter's row maps are recomputed and compared.
    """
    opts = ConsolidateOptions.from_call(options, kwargs)  # 1. options: a bad value names its keyword
    with following_symlinks(opts.follow_symlinks):  # the setting travels in the environment: workers take it too
        # 2. output check: OUT checked before anything is read (not onto an input); a URL staged locally
        tx = OutputTransaction(
            output,
            inputs=(checkpoint_id, opts.hf_assets),
            overwrite=opts.overwrite,
            force=opts.force,
            tag=shared_tag(opts.cluster),
            last=last_files(),
        )
        owner, file_bytes, start = False, 0, time.monotonic()
        with tx:
            # 3. source: its format decided once: a sharded checkpoint, or any output of this tool
            source = open_checkpoint(as_location(checkpoint_id), full_files=True, check_crc=opts.check_crc, weights=opts.weights)
            # 4. output kind: chosen once from OUT, --format and --lora-only; what it holds
            kind = output_kind(tx.output, opts.output_format, lora=lora_only(opts.transform))
            groups = kind.groups(opts.only)
            assets = open_assets(opts, kind, groups)
            tx.check_free(directory=kind.directory)
            source.check_data_files()
            # 5. items: names, filters, re-keying, casts; a tied lm_head left out for --hf-assets
            items, transform = output_items(source, opts, groups, assets)
            # 6. plan: every file placed, tensors striped over the workers
            plan = plan_for(source, items, tx.output, kind, opts)
            waves = tx.url is not None and len(plan.shards) > 1 and not opts.verify_output  # files go up in waves
            needed = (consolidate_staging_bytes(plan) if waves else output_bytes(plan)) if opts.space_check else None
            fingerprint = None if tx.url else consolidate_fingerprint(source.index, plan)  # a staged upload keeps none
            # 7. transaction: space, lock, temporary (+ manifest)
            tmp, resumable = tx.begin(directory=kind.directory, needed_bytes=needed, fingerprint=fingerprint, resume=opts.resume)
            # 8. move: every worker moves its tensors into place; rank 0 finishes each file and the index
            job = ConsolidateJob(
                source=source, plan=plan, tmp_output=tmp, progress=opts.progress, check_crc=opts.check_crc, resume=resumable
            )
            owner, file_bytes = _move(job, tx, waves, opts)
            if not owner:
                raise LeaveToOwner
            # 9. finish: the writing process finishes the folder (adapter config, assets), and reads it back
            file_bytes += kind.finish(tmp, index=source.index, items=plan.items, options=transform, assets=assets)
            if opts.verify_output:
                _verify(source, tmp, Path(tx.output), opts, transform)
    # 10. result: what was written (another node's process, or a non-zero rank of the user's torchrun, wrote nothing)
    return _result(plan, tx.shown, file_bytes if owner else 0, owner, time.monotonic() - start)


def plan_for(source: Source, items: tuple[OutputItem, ...], output: Path, kind: OutputKind, opts: ConsolidateOptions) -> WorkPlan:
    """Stage 6: ``plan.consolidate.plan_consolidate`` of the items for OUT, sized to this machine (CPUs, RAM)."""
    return plan_consolidate(
        source.index,
        items,
        output,
        kind=kind,
        nproc=job_world_size(opts.nproc, opts.cluster),
        memory_budget_bytes=opts.memory_budget_bytes,
        max_shard_bytes=opts.max_shard_bytes,
        cpus=len(os.sched_getaffinity(0)),
        ram_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    )


def open_assets(opts: ConsolidateOptions, kind: OutputKind, groups: tuple[Group, ...]) -> HfAssets | None:
    """``--hf-assets``, opened before anything is written (``writers.hf_assets.open_hf_assets``; its Raises)."""
    if opts.hf_assets is None:
        return None
    return open_hf_assets(opts.hf_assets, folder_output=kind.directory, model="model" in groups)


def output_items(
    source: Source, opts: ConsolidateOptions, groups: tuple[Group, ...], assets: HfAssets | None
) -> tuple[tuple[OutputItem, ...], TransformOptions]:
    """The output items, and the transforms ``--verify`` reads the checkpoint through.

    Raises:
        InvalidOptionError: ``--verify`` with a computed tensor; as ``plan.items.prepare_items``.
    """
    items = prepare_items(source, opts.transform, groups)  # read with the source's reader and its check_crc
    # verify recomputes an adapter's row maps exactly (derive.Derived.compute); a combine's float
    # arithmetic (a LoRA merge's B @ A) rounds by row block size, so its result is not compared
    computed = next((i for i in items if i.derived is not None and i.derived.combine is not None), None)
    if opts.verify_output and computed is not None:
        raise InvalidOptionError(
            f"--verify does not recompute computed tensors ({computed.path[-1]}: computed by --merge-lora, --dequantize, "
            "--quantize or the adapter); run without it"
        )
    if assets is None:
        return items, opts.transform
    tied = tied_output_keys(assets, [safetensors_name(i.path) for i in items if i.group == "model" and i.is_tensor])
    return leave_out_model_keys(source.index, items, opts.transform, tied)


def _move(job: ConsolidateJob, tx: OutputTransaction, waves: bool, opts: ConsolidateOptions) -> tuple[bool, int]:
    """Run the workers: whether this process holds rank 0, and the bytes written (uploaded, for waves)."""
    if waves and tx.url is not None:  # object storage: each wave of files goes up while the next is written, the index last
        uploaded = consolidate_in_waves(consolidate_rank, job, tx.url, opts.cluster)
        return True, uploaded + job.plan.kind.write_index(job.tmp_output, job.plan.files, job.plan.items)
    owner, file_bytes = run_ranks(consolidate_rank, job, job.plan.nproc, opts.cluster)
    return owner, file_bytes


def _verify(source: Source, tmp: Path, output: Path, opts: ConsolidateOptions, transform: TransformOptions) -> None:
    """Read the temporary output back and compare it with the checkpoint (``ops.verify``).

    Raises:
        VerificationError: naming the first difference; nothing is moved into place.
    """
    from fsdp_convert.ops._sources import find_source  # torch: only when asked
    from fsdp_convert.ops.options import VerifyOptions
    from fsdp_convert.ops.verify import verify_sources

    options = VerifyOptions(
        transform=transform,
        only=opts.only,
        check_crc=opts.check_crc,
        in_process=True,
        progress=opts.progress,
        transform_files=True,  # a file input too is compared as its transforms made it
    )
    # the checkpoint as already found, OUT found once
    check = verify_sources(source, find_source(tmp, check_crc=opts.check_crc), options)
    if not check.equal:
        d = check.differences[0]
        raise VerificationError(
            f"{output}: read back, {d.key} {d.detail} ({len(check.differences)} difference(s)); nothing was written"
        )


def _result(plan: WorkPlan, shown: Location, file_bytes: int, owner: bool, seconds: float) -> ConsolidateResult:
    """What was written, logged at INFO."""
    tensors = [item for item in plan.items if item.is_tensor]
    result = ConsolidateResult(
        output=shown,
        output_format=plan.kind.name,
        tensors=len(tensors),
        values=len(plan.items) - len(tensors),
        tensor_bytes=sum(item.nbytes for item in tensors),
        file_bytes=file_bytes,
        nproc=plan.nproc,
        seconds=seconds,
        owner=owner,
    )
    logger.info(
        "Consolidated %d tensors (%.1f MiB) into %s in %.1f s with %d worker(s)",
        result.tensors,
        result.tensor_bytes / 2**20,
        shown,
        result.seconds,
        plan.nproc,
    )
    return result
