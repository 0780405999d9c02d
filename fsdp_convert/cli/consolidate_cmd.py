"""``fsdp-convert consolidate``: one full state dict file from a sharded DCP checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from fsdp_convert.cli._errors import handle_errors, rank_prefix
from fsdp_convert.cli._options import (
    FOLDER_OUTPUT,
    LORA,
    OUTPUT,
    SAFETY,
    SELECTION,
    AdapterOpt,
    AdapterOptionOpt,
    CheckpointArg,
    Choice,
    DequantizeOpt,
    DtypeOpt,
    ExcludeOpt,
    FollowSymlinksOpt,
    IncludeOpt,
    JsonOpt,
    KeepWrapperNamesOpt,
    LayoutChoice,
    LayoutOpt,
    MemoryBudgetOpt,
    ModelConfigOpt,
    NoCrcOpt,
    OnlyChoice,
    OptimDtypeOpt,
    OptimKeysChoice,
    OptimKeysOpt,
    OutputArg,
    ProgressOpt,
    QuantizeOpt,
    RenameOpt,
    UnstackLayersOpt,
    choice_option,
    parse_size,
    transform_options,
    with_adapter,
)
from fsdp_convert.cli._output import command_help, console, human_bytes, print_json, print_result
from fsdp_convert.cli._precheck import check_consolidate, check_lora_flags, check_nodes, check_rename, check_unstack
from fsdp_convert.cli._run_options import (
    NPROC_DEFAULT,
    ForceOpt,
    NnodesOpt,
    NodeRankOpt,
    NoSpaceCheckOpt,
    NprocPerNodeOpt,
    OverwriteOpt,
    RdzvBackendChoice,
    RdzvBackendOpt,
    RdzvEndpointOpt,
    RdzvIdOpt,
    ResumeOpt,
    cluster_options,
    nproc_option,
    start_workers_early,
    workers,
)
from fsdp_convert.cli._terminal import escape_controls
from fsdp_convert.cli._verbosity import DebugOpt, QuietOpt, VerboseOpt, set_verbosity, show_progress
from fsdp_convert.held_roots import following_symlinks
from fsdp_convert.output_table import check_format, format_names

if TYPE_CHECKING:
    from fsdp_convert.ops.consolidate import ConsolidateResult
    from fsdp_convert.ops.dry_run import RunPlan
    from fsdp_convert.transform import TransformOptions

# one line each, under 78 columns, so --help never breaks a command in two
EXAMPLES = """
Examples:

  fsdp-convert consolidate ckpt/step-1000 full.pt
  fsdp-convert consolidate ckpt/step-1000 model.safetensors --nproc 4
  fsdp-convert consolidate ckpt/step-1000 hf-model/ --hf-assets base-model/
  fsdp-convert consolidate ckpt/step-1000 optim.pt --only optim --overwrite
  fsdp-convert consolidate ckpt/step-1000 plain.pt --optim-keys ids
  fsdp-convert consolidate ckpt/step-1000 hf-model/ --rename '^=model.'
  fsdp-convert consolidate fabric-ckpt/ full.pt --layout nested --dtype bf16
  fsdp-convert consolidate peft-ckpt/ merged/ --merge-lora --lora-alpha 16
  fsdp-convert consolidate peft-ckpt/ adapter/ --lora-only --lora-alpha 16
"""

NprocOpt = Annotated[
    int | None,
    nproc_option(f"Worker processes (alias: --nproc-per-node); 1 runs in-process. \\[default: {NPROC_DEFAULT}]"),
]
MaxShardSizeOpt = Annotated[
    str,
    typer.Option(
        "--max-shard-size",
        metavar="SIZE",
        help="Largest shard of a folder OUT (GB as in transformers, or GiB).",
        rich_help_panel=FOLDER_OUTPUT,
    ),
]


def _format_option() -> Any:
    """``--format``: a name of the outputs table (``output_table.format_names``), checked when the command runs.

    ``--help`` lists the names the table holds when this module is imported; the value is checked
    against the table at each call (``output_table.check_format``), so a row added since is taken.
    A bad value is one line, ``error: --format 'x': use auto, torch or safetensors``, exit code 2.
    """

    def parse(value: str) -> str:
        with handle_errors():
            return check_format(value)

    def complete(incomplete: str) -> list[str]:
        return [name for name in format_names() if name.startswith(incomplete)]

    return typer.Option(
        "--format",
        metavar="[" + "|".join(format_names()) + "]",
        parser=parse,
        autocompletion=complete,
        help="auto: by OUT's suffix. torch or safetensors override the suffix (e.g. Lightning's .ckpt).",
        rich_help_panel=OUTPUT,
    )


FormatOpt = Annotated[str, _format_option()]
OnlyOpt = Annotated[
    OnlyChoice,
    choice_option(
        OnlyChoice,
        "--only",
        help="What to write (a .safetensors file holds the model only).",
        rich_help_panel=OUTPUT,
    ),
]


class WeightsChoice(Choice):
    """``consolidate --weights``: which copy of a DeepSpeed save's weights is the model."""

    master = "master"
    module = "module"


WeightsOpt = Annotated[
    WeightsChoice,
    choice_option(
        WeightsChoice,
        "--weights",
        help="A DeepSpeed save's model: master, its fp32 master weights (as zero_to_fp32); module, the module's own "
        "weights in its dtype (ZeRO-1/2).",
        rich_help_panel=SELECTION,
    ),
]
HfAssetsOpt = Annotated[
    str | None,
    typer.Option(
        "--hf-assets",
        metavar="DIR",
        help="Copy this model folder's config and tokenizer files beside a folder OUT's shards, so "
        "from_pretrained(OUT) loads it.",
        rich_help_panel=FOLDER_OUTPUT,
    ),
]
VerifyOutputOpt = Annotated[
    bool,
    typer.Option(
        "--verify",
        metavar="",
        help="Read OUT back and compare it with the checkpoint before moving it in place.",
        rich_help_panel=SAFETY,
    ),
]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        metavar="",
        help="Print the plan (files and sizes, workers, peak memory, free space, time) and exit; nothing is written.",
        rich_help_panel=SAFETY,
    ),
]


MergeLoraOpt = Annotated[
    bool,
    typer.Option(
        "--merge-lora",
        metavar="",
        help="Merge a PEFT LoRA adapter into its base weights (W + alpha/r * B @ A, in fp32), as merge_and_unload.",
        rich_help_panel=LORA,
    ),
]
LoraOnlyOpt = Annotated[
    bool,
    typer.Option(
        "--lora-only",
        metavar="",
        help="Write only the adapter, as a folder OUT that PeftModel.from_pretrained(base, OUT) loads.",
        rich_help_panel=LORA,
    ),
]
LoraConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--lora-config",
        metavar="FILE",
        help="adapter_config.json (r, lora_alpha, use_rslora); --lora-only writes it to OUT.",
        show_default=False,
        rich_help_panel=LORA,
    ),
]
LoraAlphaOpt = Annotated[
    float | None,
    typer.Option(
        "--lora-alpha", metavar="FLOAT", help="lora_alpha, without --lora-config.", show_default=False, rich_help_panel=LORA
    ),
]
LoraROpt = Annotated[
    int | None,
    typer.Option(
        "--lora-r",
        metavar="N",
        min=1,
        help="LoRA rank r, without --lora-config. \\[default: from lora_A's shape]",
        show_default=False,
        rich_help_panel=LORA,
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
    from fsdp_convert.errors import InvalidOptionError

    check_lora_flags(merge, only, config, alpha, r)
    if not (merge or only):
        return options
    if options.adapter is not None:
        raise InvalidOptionError("--merge-lora / --lora-only cannot be combined with --adapter")
    import dataclasses

    from fsdp_convert.lora import LoraAdapter, lora_options

    lora = lora_options("merge" if merge else "only", config_path=config, alpha=alpha, r=r)
    return dataclasses.replace(options, adapter=LoraAdapter(lora))


def print_plan(plan: RunPlan, *, json_output: bool) -> None:
    """``--dry-run``'s plan on stdout (``consolidate`` and ``reshard``): one JSON document with ``--json``, else its lines."""
    if json_output:
        print_json(plan.to_json_dict())
        return
    for line in plan.lines():
        console.print(escape_controls(line), markup=False, highlight=False)


def consolidate(*args: Any, **kwargs: Any) -> ConsolidateResult:
    """``ops.consolidate.consolidate``, imported on first call, so ``--help`` and ``--version`` start without torch."""
    from fsdp_convert.ops.consolidate import consolidate as operation

    return operation(*args, **kwargs)


def consolidate_command(
    checkpoint: CheckpointArg,
    output: OutputArg,
    only: OnlyOpt = OnlyChoice.all,
    weights: WeightsOpt = WeightsChoice.master,
    output_format: FormatOpt = "auto",
    layout: LayoutOpt = LayoutChoice.producer,
    optim_keys: OptimKeysOpt = OptimKeysChoice.names,
    max_shard_size: MaxShardSizeOpt = "50GB",
    hf_assets: HfAssetsOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    rename: RenameOpt = None,
    keep_wrapper_names: KeepWrapperNamesOpt = False,
    unstack_layers: UnstackLayersOpt = False,
    dequantize: DequantizeOpt = False,
    quantize: QuantizeOpt = None,
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
    nproc: NprocOpt = None,
    nproc_per_node: NprocPerNodeOpt = None,
    memory_budget: MemoryBudgetOpt = "256MiB",
    no_crc: NoCrcOpt = False,
    follow_symlinks: FollowSymlinksOpt = False,
    progress: ProgressOpt = None,
    overwrite: OverwriteOpt = False,
    force: ForceOpt = False,
    resume: ResumeOpt = False,
    verify_output: VerifyOutputOpt = False,
    no_space_check: NoSpaceCheckOpt = False,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    rdzv_backend: RdzvBackendOpt = RdzvBackendChoice.c10d,
    rdzv_endpoint: RdzvEndpointOpt = "",
    rdzv_id: RdzvIdOpt = "",
    dry_run: DryRunOpt = False,
    json_output: JsonOpt = False,
    verbose: VerboseOpt = 0,
    quiet: QuietOpt = 0,
    debug: DebugOpt = False,
) -> None:
    """Write the full (unsharded) model and optimizer state of CHECKPOINT_DIR into OUT."""
    set_verbosity(verbose, quiet, debug)
    with handle_errors(), following_symlinks(follow_symlinks):
        # what needs no torch first (cli._precheck), so a usage mistake is told at once
        memory_budget_bytes, max_shard_bytes = parse_size(memory_budget), parse_size(max_shard_size)
        for rule in rename or ():
            check_rename(rule)
        check_lora_flags(merge_lora, lora_only, lora_config, lora_alpha, lora_r)
        check_unstack(unstack_layers, optim_keys.value, adapter)
        check_nodes(nnodes, node_rank)
        nproc = workers(nproc, nproc_per_node)
        check_consolidate(
            checkpoint,
            output,
            output_format=output_format,
            only=only.value,
            lora_only=lora_only,
            verify_output=verify_output,
            overwrite=overwrite,
            resume=resume,
            force=force,
            hf_assets=hf_assets,
        )
        # its imports overlap ours from here on; no torch_ready(): a plain conversion never imports torch
        computes = bool(dtype or optim_dtype or adapter or merge_lora or dequantize or quantize)
        start_workers_early(None if dry_run else nproc, "fsdp_convert.ops._consolidate_rank", torch=computes)
        transform = transform_options(
            optim_keys=optim_keys,
            keep_wrapper_names=keep_wrapper_names,
            rename=rename,
            include=include,
            exclude=exclude,
            dtype=dtype,
            optim_dtype=optim_dtype,
            layout=layout,
            unstack_layers=unstack_layers,
            dequantize=dequantize,
            quantize=quantize,
        )
        transform = with_adapter(transform, adapter, model_config, adapter_option, hf_assets)
        transform = _with_lora(transform, merge_lora, lora_only, lora_config, lora_alpha, lora_r)
        from fsdp_convert.ops.options import ConsolidateOptions

        options = ConsolidateOptions(
            nproc=nproc,
            only=only.value,
            transform=transform,
            output_format=output_format,
            overwrite=overwrite,
            force=force,
            resume=resume,
            memory_budget_bytes=memory_budget_bytes,
            max_shard_bytes=max_shard_bytes,
            check_crc=not no_crc,
            space_check=not no_space_check,
            verify_output=verify_output,
            progress=show_progress(progress, json_output),
            cluster=cluster_options(nnodes, node_rank, rdzv_backend, rdzv_endpoint, rdzv_id),
            hf_assets=hf_assets,
            weights=weights.value,
        )
        if dry_run:  # the run's own stages up to its lock (ops.dry_run): nothing is created
            from fsdp_convert.ops.dry_run import dry_run_consolidate

            print_plan(dry_run_consolidate(checkpoint, output, options), json_output=json_output)
            return
        result = consolidate(checkpoint, output, options)
    print_result(
        result,
        json_output=json_output,
        done=f"wrote {result.output} ({result.output_format}, {result.tensors} tensors, {result.values} values, "
        f"{human_bytes(result.file_bytes)}) in {result.seconds:.1f} s",
        elsewhere=f"this node's share is in place; rank 0 finished {result.output}",
        prefix=rank_prefix(),
    )


consolidate_command.__doc__ = command_help(consolidate_command.__doc__, EXAMPLES)
