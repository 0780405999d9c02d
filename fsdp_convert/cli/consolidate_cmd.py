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
from fsdp_convert.cli._run_options import NoSpaceCheckOpt, ResumeOpt
from fsdp_convert.errors import InvalidOptionError

if TYPE_CHECKING:
    from fsdp_convert.ops.consolidate import ConsolidateResult
    from fsdp_convert.transform import TransformOptions

EXAMPLES = """
Examples:

  fsdp-convert consolidate ckpt/step-1000 full.pt

  fsdp-convert consolidate ckpt/step-1000 model.safetensors --nproc 4

  fsdp-convert consolidate ckpt/step-1000 hf-model/ --max-shard-size 2GB

  fsdp-convert consolidate ckpt/step-1000 optim.pt --only optim --overwrite

  fsdp-convert consolidate peft-ckpt/ merged/ --merge-lora --lora-config adapter/adapter_config.json

  fsdp-convert consolidate peft-ckpt/ adapter/ --lora-only --lora-alpha 16

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


MergeLoraOpt = Annotated[
    bool,
    typer.Option(
        "--merge-lora",
        help="Merge a PEFT LoRA adapter into its base weights (W + alpha/r * B @ A, in fp32) under the base names, "
        "as PEFT's merge_and_unload: plain transformers loads OUT. Model weights only.",
        rich_help_panel="LoRA (PEFT)",
    ),
]
LoraOnlyOpt = Annotated[
    bool,
    typer.Option(
        "--lora-only",
        help="Write only the LoRA adapter, as a PEFT folder OUT (adapter_model.safetensors + adapter_config.json) "
        "that PeftModel.from_pretrained(base, OUT) loads.",
        rich_help_panel="LoRA (PEFT)",
    ),
]
LoraConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--lora-config",
        metavar="FILE",
        help="The adapter's adapter_config.json (r, lora_alpha, use_rslora); --lora-only writes it beside the weights.",
        show_default=False,
        rich_help_panel="LoRA (PEFT)",
    ),
]
LoraAlphaOpt = Annotated[
    float | None,
    typer.Option("--lora-alpha", help="lora_alpha, without --lora-config.", show_default=False, rich_help_panel="LoRA (PEFT)"),
]
LoraROpt = Annotated[
    int | None,
    typer.Option(
        "--lora-r",
        min=1,
        help="The LoRA rank r, without --lora-config (default: read from the lora_A shapes).",
        show_default=False,
        rich_help_panel="LoRA (PEFT)",
    ),
]


def _with_lora(
    options: TransformOptions, merge: bool, only: bool, config: str | None, alpha: float | None, r: int | None
) -> TransformOptions:
    """``options`` with the LoRA adapter ``--merge-lora`` or ``--lora-only`` asks for (``lora.LoraAdapter``), if either does.

    Raises:
        InvalidOptionError: both flags, a LoRA flag without either, beside ``--adapter``, or a bad
            config (``lora.lora_options``).
    """
    if merge and only:
        raise InvalidOptionError("--merge-lora and --lora-only exclude each other: merge the adapter, or write it alone")
    if not (merge or only):
        if config is not None or alpha is not None or r is not None:
            raise InvalidOptionError("--lora-config, --lora-alpha and --lora-r go with --merge-lora or --lora-only")
        return options
    if options.adapter is not None:
        raise InvalidOptionError("--merge-lora / --lora-only cannot be combined with --adapter")
    import dataclasses

    from fsdp_convert.lora import LoraAdapter, lora_options

    lora = lora_options("merge" if merge else "only", config_path=config, alpha=alpha, r=r)
    return dataclasses.replace(options, adapter=LoraAdapter(lora))


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
    merge_lora: MergeLoraOpt = False,
    lora_only: LoraOnlyOpt = False,
    lora_config: LoraConfigOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_r: LoraROpt = None,
    overwrite: OverwriteOpt = False,
    resume: ResumeOpt = False,
    memory_budget: MemoryBudgetOpt = "256MiB",
    max_shard_size: MaxShardSizeOpt = "50GB",
    no_crc: NoCrcOpt = False,
    no_space_check: NoSpaceCheckOpt = False,
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
        options = _with_lora(options, merge_lora, lora_only, lora_config, lora_alpha, lora_r)
        cluster = cluster_options(nnodes, node_rank, rdzv_backend, rdzv_endpoint, rdzv_id)
        result = consolidate(
            checkpoint,
            output,
            nproc=nproc,
            only=only.value,
            options=options,
            output_format=output_format.value,
            overwrite=overwrite,
            resume=resume,
            memory_budget_bytes=parse_size(memory_budget),
            max_shard_bytes=parse_size(max_shard_size),
            check_crc=not no_crc,
            space_check=not no_space_check,
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
