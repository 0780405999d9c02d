"""Operation ``consolidate``: index, transform, plan, then every worker moves its tensors into place (launch).

The plan lays every output file out before any data is read, so each worker writes its own
tensors at their offsets in the output files (``move``), on one node or many; rank 0 then gathers
the CRC-32s, reads the plain values and writes the headers, pickles and the folder's index. No
tensor crosses between workers. A progress bar on stderr (``progress``) counts every worker's bytes written.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import get_args

from fsdp_convert.constants import HF_INDEX_FILENAME, HF_SINGLE_FILENAME
from fsdp_convert.errors import InvalidOptionError, VerificationError
from fsdp_convert.formats import check_data_files, read_index
from fsdp_convert.formats.index import Location
from fsdp_convert.items import leave_out_model_keys, prepare_items
from fsdp_convert.launch import Cluster, job_world_size, run_ranks, shared_tag
from fsdp_convert.location import following_symlinks
from fsdp_convert.lora import ADAPTER_WEIGHTS_NAME, lora_only, write_adapter_config
from fsdp_convert.ops._arguments import byte_count, choice, count, transform_options
from fsdp_convert.ops._consolidate_rank import ConsolidateJob, consolidate_rank, write_index
from fsdp_convert.ops._waves import consolidate_in_waves, consolidate_staging_bytes
from fsdp_convert.ops.verify import verify
from fsdp_convert.plan import (
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_MEMORY_BUDGET_BYTES,
    Only,
    RequestedFormat,
    groups_for,
    output_bytes,
    plan_consolidate,
)
from fsdp_convert.plan import output_format as plan_output_format
from fsdp_convert.remote import Url, local_output
from fsdp_convert.resume import consolidate_fingerprint, temporary_output
from fsdp_convert.transform import TransformOptions
from fsdp_convert.writers._atomic import LeaveToOwner, writing
from fsdp_convert.writers._output_check import check_output, check_output_free
from fsdp_convert.writers._space import check_space
from fsdp_convert.writers.hf_assets import open_hf_assets, tied_output_keys, weights_dtype, write_hf_assets
from fsdp_convert.writers.safetensors import safetensors_name

__all__ = ["ConsolidateResult", "consolidate"]

logger = logging.getLogger(__name__)


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
    *,
    nproc: int | None = None,
    only: Only = "all",
    options: TransformOptions | None = None,
    output_format: RequestedFormat = "auto",
    overwrite: bool = False,
    force: bool = False,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    check_crc: bool = True,
    verify_output: bool = False,
    space_check: bool = True,
    progress: bool = False,
    cluster: Cluster | None = None,
    hf_assets: str | os.PathLike[str] | None = None,
    resume: bool = False,
    follow_symlinks: bool | None = None,
) -> ConsolidateResult:
    """Write a DCP checkpoint as one full (unsharded) state dict: a file, or a folder of shards.

    Steps: read the index; classify its entries by producer layout and build the output items
    (wrapper names removed, renames, filters, optimizer re-keying, casts); plan (check coverage,
    lay every output file out, balance tensors over workers by bytes); check the data files
    exist; every worker moves its tensors' bytes into place in a temporary sibling of ``output``;
    rank 0 writes the headers; rename it into place.

    Args:
        checkpoint_id: the DCP checkpoint folder (or accelerate's parent folder of
            ``pytorch_model_fsdp_0/`` and ``optimizer_0/``), per-rank files, or any output of this
            tool: a torch.save file (any name), a safetensors file, a Hugging Face or PEFT folder.
        output: ``.pt``/``.pth``/``.bin`` for torch.save of the nested state dict
            (``{"model": {fqn: tensor}, "optim": {"state": {fqn: {...}}, "param_groups": [...]},
            ...}``, as ``get_model_state_dict``/``get_optimizer_state_dict`` with
            ``full_state_dict=True`` give it; with ``options.layout`` ``producer``, the default,
            the optimizer keeps its saved key, ``optimizer`` for Lightning, accelerate and
            torchtitan, and Lightning's ``meta.pt`` entries are merged at the top level, as
            Lightning's own ``consolidate_checkpoint`` writes it, so ``fabric.load`` reads it);
            ``.safetensors`` for the model weights in one file; a folder (no suffix) for the model
            weights as Hugging Face safetensors shards with ``model.safetensors.index.json``, plus
            ``optimizer.pt`` (the optimizer state dict) and ``extra_state.pt`` (other entries) when
            ``only`` is ``all``.
        nproc: workers; 1 runs in this process, more start workers with torch's elastic
            launcher (gloo on CPU). ``None``: ``plan.default_nproc`` (one per CPU core, at most
            one per data file and 2 GiB).
        only: ``all``, ``model`` or ``optim``: which groups to write.
        options: key and dtype transforms (``TransformOptions``); default: wrapper names removed,
            optimizer state keyed by FQN, dtypes kept, the producer's layout. A ``lora.LoraAdapter``
            of mode ``only`` (``--lora-only``) makes ``output`` a PEFT adapter folder:
            ``adapter_model.safetensors`` (one file) and ``adapter_config.json`` (rank 0, last);
            it refuses a file ``output`` and ``verify_output`` (InvalidOptionError).
        output_format: ``auto`` (by suffix), ``torch`` (torch.save under any name but ``.safetensors``,
            e.g. Lightning's ``.ckpt``) or ``safetensors`` (see ``plan.output_format``).
        overwrite: replace an existing ``output`` (at the final rename only). ``output`` may not be the
            checkpoint, inside it or one of its folders (nor ``hf_assets``), ``overwrite`` or not, and
            a link at ``output`` is refused (``writers._output_check.check_output``, before anything is read).
        force: with ``overwrite``, replace an existing folder that does not look like this tool's
            output too (``writers._output_check.foreign_entry``).
        memory_budget_bytes: buffers each process may hold, in bytes: peak memory per process is
            the interpreter's plus this, whatever the largest tensor, when chunks are read in place
            (local DCP or safetensors sources); a chunk that must be decoded (a remote source, a
            stream-transformed payload) adds its own size.
        max_shard_bytes: largest shard of a folder output, in bytes.
        check_crc: check the CRC-32 of every zip record of every payload read (torch does not).
            Sources without CRC-32s (safetensors shards, per-rank torch.save files, read through
            their storage records) are read as they are.
        verify_output: read the written output back and compare it with the checkpoint (through
            the same transforms), key by key, before moving it into place.
        space_check: before anything is read or created, check that the output's size from the plan
            (``plan.output_bytes``; to a URL, what its local staging folder holds: two waves of a folder's
            files, ``ops._waves``) fits where its temporary is written; ``--no-space-check`` turns it off.
        progress: bars on stderr (``progress``: bytes of every worker, binary units, rate, time left),
            drawn by rank 0's worker: ``write``, ``re-check`` first when resuming, ``verify`` last with
            ``verify_output``.
        cluster: torchrun's multi-node options; every node calls ``consolidate`` with the same
            arguments and ``nproc`` workers per node, and the output (on storage every node
            reaches) is written by rank 0's node. Under the user's own torchrun (``RANK`` and
            ``WORLD_SIZE`` set) this process is one worker and ``nproc`` is ignored.
        hf_assets: a folder (local or an fsspec URL) whose ``config.json``, generation config and
            tokenizer files are copied beside a folder output's shards (``writers.hf_assets``), so
            ``from_pretrained`` loads it; ``lm_head.weight`` is left out when the config ties it,
            and the config's dtype follows the weights written.
        resume: finish the interrupted run's temporary output (``resume``), on one node or many, whatever
            the job id: its manifest must match this plan; records whose bytes read back with their CRC-32
            are kept, the rest written.

        follow_symlinks: read files of the checkpoint that are symbolic links out of its folder
            (a shared store the step folder links into); by default such a link is refused
            (UnsafeContentError). None: the process's setting (``--follow-symlinks``).

    Returns:
        What was written (``owner`` False on the processes that did not write).

    Raises:
        CheckpointNotFoundError, NotADcpCheckpointError, UnsafeContentError: unreadable index.
        InvalidOptionError: ``output`` is the checkpoint (or ``hf_assets``), inside it or one of its folders;
            unknown suffix, optimizer state into a safetensors file, bad ``nproc``,
            two keys renamed to one; ``hf_assets`` for a file output, without a ``config.json``, or
            whose config unties ``lm_head.weight`` which the output would not hold.
        UnsupportedTransformError: ``optim_keys="ids"`` without param groups listing the parameters,
            or a Lightning ``meta.pt`` holding a tensor (``layout="nested"`` leaves it out).
        OutputExistsError: ``output`` exists and ``overwrite`` is false, is a link, or is a folder not
            this tool's and ``force`` is false.
        MissingDataFileError, CorruptChunkError, CoverageError, ShapeMismatchError: bad data files.
        OutputWriteError: the output cannot be written, or (``space_check``) does not fit in the free space.
        WorkerFailedError: a worker died.
        VerificationError: ``verify_output`` found a difference (nothing is left at ``output``).
            ``verify_output`` with a computed tensor (a LoRA merge, whose float rounding depends on
            the row block size) is an InvalidOptionError; an adapter's row maps are recomputed and compared.
    """
    if follow_symlinks is not None:  # the setting travels in the environment, so workers take it too
        with following_symlinks(follow_symlinks):
            return consolidate(**{**locals(), "follow_symlinks": None})
    # a Python caller's bad value is an InvalidOptionError naming the keyword (the CLI checked its flags)
    only, output_format = choice("--only", only, get_args(Only)), choice("--format", output_format, get_args(RequestedFormat))
    options, nproc = transform_options(options), None if nproc is None else count("--nproc", nproc)
    memory_budget_bytes = byte_count("--memory-budget", memory_budget_bytes)
    max_shard_bytes = byte_count("--max-shard-size", max_shard_bytes)
    check_output(output, (checkpoint_id, hf_assets), overwrite=overwrite, force=force)  # not onto an input, first
    tag = shared_tag(cluster)  # the temporary's name every process of a multi-process job shares
    last = (HF_SINGLE_FILENAME, HF_INDEX_FILENAME)
    with local_output(output, overwrite=overwrite, shared=tag is not None, last=last) as (output, shown):
        start = time.monotonic()
        options = options or TransformOptions()
        index = read_index(checkpoint_id, full_files=True)  # a sharded checkpoint, or any output of this tool
        fmt = plan_output_format(output, output_format)
        directory = fmt == "hf_dir"
        lora = lora_only(options)
        if lora is not None and fmt != "hf_dir":
            raise InvalidOptionError(f"{output}: --lora-only writes a PEFT adapter folder; name OUT without a suffix")
        if lora is not None and verify_output:
            raise InvalidOptionError("--verify does not read a PEFT adapter folder back; load it with PeftModel.from_pretrained")
        groups = groups_for(fmt, only)
        assets = open_hf_assets(hf_assets, folder_output=fmt == "hf_dir", model="model" in groups) if hf_assets else None
        check_output_free(output, overwrite=overwrite, force=force, directory=fmt == "hf_dir")
        check_data_files(index)
        items = prepare_items(index, options, groups, check_crc=check_crc)
        # verify recomputes an adapter's row maps exactly (derive.Derived.compute); a combine's float
        # arithmetic (a LoRA merge's B @ A) rounds by row block size, so its result is not compared
        computed = next((i for i in items if i.derived is not None and i.derived.combine is not None), None)
        if verify_output and computed is not None:
            raise InvalidOptionError(
                f"--verify does not recompute computed tensors ({computed.path[-1]}: --merge-lora); run without it"
            )
        if assets is not None:
            tied = tied_output_keys(assets, [safetensors_name(i.path) for i in items if i.group == "model" and i.is_tensor])
            items, options = leave_out_model_keys(index, items, options, tied)
        plan = plan_consolidate(
            index,
            items,
            output,
            fmt=fmt,
            nproc=job_world_size(nproc, cluster),
            memory_budget_bytes=memory_budget_bytes,
            max_shard_bytes=max_shard_bytes if lora is None else sys.maxsize,  # PEFT reads one adapter file
            cpus=len(os.sched_getaffinity(0)),
            ram_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        )
        url = shown if isinstance(shown, Url) and len(plan.shards) > 1 and not verify_output else None  # files go up in waves
        if space_check:
            needed = consolidate_staging_bytes(plan) if url else output_bytes(plan)
            check_space(output, needed, directory=directory, tag=tag, shown=shown)
        if lora is not None:
            files = tuple(dataclasses.replace(f, filename=ADAPTER_WEIGHTS_NAME) for f in plan.files)
            plan = dataclasses.replace(plan, files=files)
        owner = True
        fingerprint = None if isinstance(shown, Url) else consolidate_fingerprint(index, plan)  # a staged upload keeps none
        temporary = temporary_output(
            output, overwrite=overwrite, directory=directory, tag=tag, fingerprint=fingerprint, resume=resume
        )
        with temporary as (tmp, resumable):
            job = ConsolidateJob(
                checkpoint_id=index.checkpoint_id,
                plan=plan,
                tmp_output=tmp,
                progress=progress,
                check_crc=check_crc,
                resume=resumable,
            )
            if url:  # object storage: each wave of files goes up while the next is written, the index last
                file_bytes = consolidate_in_waves(consolidate_rank, job, url, cluster) + write_index(tmp, plan)
            else:
                owner, file_bytes = run_ranks(consolidate_rank, job, plan.nproc, cluster)
            if not owner:
                raise LeaveToOwner
            if lora is not None:
                write_adapter_config(tmp, lora, index, plan.items)
            if assets is not None:
                dtype = weights_dtype(options.dtype, (i.dtype for i in plan.items if i.group == "model" and i.is_tensor))
                with writing(tmp):
                    file_bytes += sum(p.stat().st_size for p in write_hf_assets(assets, tmp, dtype=dtype))
            if verify_output:
                check = verify(
                    index.checkpoint_id,
                    tmp,
                    only=only,
                    check_crc=check_crc,
                    options=options,
                    in_process=True,
                    progress=progress,
                    transform_files=True,  # a file input too is compared as its transforms made it
                )
                if not check.equal:
                    d = check.differences[0]
                    raise VerificationError(
                        f"{output}: read back, {d.key} {d.detail} ({len(check.differences)} difference(s)); nothing was written"
                    )
        tensors = [item for item in plan.items if item.is_tensor]
        result = ConsolidateResult(
            output=output,
            output_format=plan.output_format,
            tensors=len(tensors),
            values=len(plan.items) - len(tensors),
            tensor_bytes=sum(item.nbytes for item in tensors),
            file_bytes=file_bytes if owner else 0,
            nproc=plan.nproc,
            seconds=time.monotonic() - start,
            owner=owner,
        )
        logger.info(
            "Consolidated %d tensors (%.1f MiB) into %s in %.1f s with %d worker(s)",
            result.tensors,
            result.tensor_bytes / 2**20,
            output,
            result.seconds,
            plan.nproc,
        )
    return dataclasses.replace(result, output=shown)
