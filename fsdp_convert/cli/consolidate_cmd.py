"""``fsdp-convert consolidate``: one full state dict file from a sharded DCP checkpoint."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fsdp_convert.cli._errors import handle_errors, rank_prefix
from fsdp_convert.cli._options import (
    AdapterOpt,
    AdapterOptionOpt,
    CheckpointArg,
    DtypeOpt,
    ExcludeOpt,
    FormatChoice,
    IncludeOpt,
    JsonOpt,
    KeepWrapperNamesOpt,
    LayoutChoice,
    LayoutOpt,
    MemoryBudgetOpt,
    ModelConfigOpt,
    NnodesOpt,
    NoCrcOpt,
    NodeRankOpt,
    NprocOpt,
    OnlyChoice,
    OptimDtypeOpt,
    OptimKeysChoice,
    OptimKeysOpt,
    OutputArg,
    OverwriteOpt,
    ProgressOpt,
    RdzvBackendChoice,
    RdzvBackendOpt,
    RdzvEndpointOpt,
    RdzvIdOpt,
    RenameOpt,
    choice_option,
    cluster_options,
    parse_size,
    transform_options,
    with_adapter,
)
from fsdp_convert.cli._output import human_bytes, print_result

if TYPE_CHECKING:
    from fsdp_convert.ops.consolidate import ConsolidateResult

EXAMPLES = """
Examples:

  fsdp-convert consolidate ckpt/step-1000 full.pt

  fsdp-convert consolidate ckpt/step-1000 model.safetensors --nproc 4

  fsdp-convert consolidate ckpt/step-1000 hf-model/ --max-shard-size 2GB

  fsdp-convert consolidate ckpt/step-1000 optim.pt --only optim --overwrite

  fsdp-convert consolidate ckpt/step-1000 plain.pt --optim-keys ids --dtype bf16

  fsdp-convert consolidate fabric-ckpt/ full.pt --layout nested

  fsdp-convert consolidate ckpt/step-1000 hf-model/ --rename '^=model.' --exclude 'lm_head.weight'

  fsdp-convert consolidate ckpt/step-1000 hf-model/ --only model --hf-assets base-model/
"""

MaxShardSizeOpt = Annotated[
    str,
    typer.Option(
        "--max-shard-size",
        help="Largest shard of a folder output (decimal GB as in transformers, or GiB); the default is transformers 5's.",
    ),
]
FormatOpt = Annotated[
    FormatChoice,
    choice_option(
        FormatChoice,
        "--format",
        help="auto (by OUT's suffix: .pt/.pth/.bin torch.save, .safetensors, folder = HF shards), torch, or safetensors.",
    ),
]
OnlyOpt = Annotated[
    OnlyChoice,
    choice_option(
        OnlyChoice,
        "--only",
        help="Which part to write (a .safetensors file holds the model only; "
        "a folder holds the model as shards, the optimizer state in optimizer.pt).",
    ),
]
HfAssetsOpt = Annotated[
    str | None,
    typer.Option(
        "--hf-assets",
        metavar="DIR",
        help="Copy config.json, generation_config.json and the tokenizer files of this model folder (local or URL) "
        "beside a folder output's shards, so from_pretrained(OUT) loads it; a tied lm_head.weight is left out.",
    ),
]


def consolidate(*args: Any, **kwargs: Any) -> ConsolidateResult:
    """``ops.consolidate.consolidate``, imported on first call, so ``--help`` and ``--version`` start without torch."""
    from fsdp_convert.ops.consolidate import consolidate as operation

    return operation(*args, **kwargs)


def consolidate_command(
    checkpoint: CheckpointArg,
    output: OutputArg,
    nproc: NprocOpt = None,
    only: OnlyOpt = OnlyChoice.all,
    output_format: FormatOpt = FormatChoice.auto,
    optim_keys: OptimKeysOpt = OptimKeysChoice.names,
    layout: LayoutOpt = LayoutChoice.producer,
    keep_wrapper_names: KeepWrapperNamesOpt = False,
    rename: RenameOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    dtype: DtypeOpt = None,
    optim_dtype: OptimDtypeOpt = None,
    adapter: AdapterOpt = None,
    model_config: ModelConfigOpt = None,
    adapter_option: AdapterOptionOpt = None,
    overwrite: OverwriteOpt = False,
    memory_budget: MemoryBudgetOpt = "256MiB",
    max_shard_size: MaxShardSizeOpt = "50GB",
    no_crc: NoCrcOpt = False,
    verify_output: Annotated[
        bool,
        typer.Option("--verify", help="Read the output back and compare it with the checkpoint before moving it in place."),
    ] = False,
    hf_assets: HfAssetsOpt = None,
    progress: ProgressOpt = None,
    json_output: JsonOpt = False,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    rdzv_backend: RdzvBackendOpt = RdzvBackendChoice.c10d,
    rdzv_endpoint: RdzvEndpointOpt = "",
    rdzv_id: RdzvIdOpt = "",
) -> None:
    """Write the full (unsharded) model and optimizer state of CHECKPOINT_DIR into one file OUT."""
    show_progress = progress if progress is not None else (not json_output and sys.stderr.isatty())
    with handle_errors():
        options = transform_options(optim_keys, keep_wrapper_names, rename, include, exclude, dtype, optim_dtype, layout)
        options = with_adapter(options, adapter, model_config, adapter_option, hf_assets)
        cluster = cluster_options(nnodes, node_rank, rdzv_backend, rdzv_endpoint, rdzv_id)
        result = consolidate(
            checkpoint,
            output,
            nproc=nproc,
            only=only.value,
            options=options,
            output_format=output_format.value,
            overwrite=overwrite,
            memory_budget_bytes=parse_size(memory_budget),
            max_shard_bytes=parse_size(max_shard_size),
            check_crc=not no_crc,
            verify_output=verify_output,
            progress=show_progress,
            cluster=cluster,
            hf_assets=hf_assets,
        )
    print_result(
        result,
        json_output=json_output,
        done=f"wrote {result.output} ({result.output_format}, {result.tensors} tensors, {result.values} values, "
        f"{human_bytes(result.file_bytes)}) in {result.seconds:.1f} s",
        elsewhere=f"this node's share is in place; rank 0 finished {result.output}",
        prefix=rank_prefix(),
    )


consolidate_command.__doc__ = (consolidate_command.__doc__ or "") + "\n\n" + EXAMPLES
