"""``fsdp-convert reshard``: the same checkpoint laid out for a new world size."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from fsdp_convert.cli._errors import handle_errors, rank_prefix
from fsdp_convert.cli._options import (
    OUTPUT,
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
    ModelConfigOpt,
    NoCrcOpt,
    OptimDtypeOpt,
    OptimKeysChoice,
    OptimKeysOpt,
    ProgressOpt,
    RenameOpt,
    UnstackLayersOpt,
    choice_option,
    transform_options,
    with_adapter,
)
from fsdp_convert.cli._output import command_help, human_bytes, print_result
from fsdp_convert.cli._precheck import check_nodes, check_rename, check_reshard, check_unstack
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
from fsdp_convert.cli._verbosity import DebugOpt, QuietOpt, VerboseOpt, set_verbosity, show_progress
from fsdp_convert.cli.consolidate_cmd import DryRunOpt, print_plan  # --dry-run: one option, one printer for both commands
from fsdp_convert.held_roots import following_symlinks

if TYPE_CHECKING:
    from fsdp_convert.ops.reshard import ReshardResult

# one line each, under 78 columns, so --help never breaks a command in two
EXAMPLES = """
Examples:

  fsdp-convert reshard ckpt/step-1000 ckpt/step-1000-ws4 --world-size 4
  fsdp-convert reshard ckpt/step-1000 ckpt/ws1 --world-size 1 --overwrite
  fsdp-convert reshard ckpt/step-1000 ckpt/ws8 --world-size 8 --compress zstd
  fsdp-convert reshard accelerate-ckpt/ accelerate-ws8/ --world-size 8
  fsdp-convert reshard ds-ckpt/ ds-ws8/ --world-size 8
  fsdp-convert reshard ds-ckpt/ fsdp2-ws8/ --world-size 8 --format dcp

An accelerate checkpoint's folders are both resharded; its RNG pickles are left out.
A DeepSpeed save becomes a DeepSpeed save for N ranks (engine.load_checkpoint);
--format dcp makes it a DCP checkpoint for FSDP2 (dcp.load + set_state_dict).
"""

OutDirArg = Annotated[str, typer.Argument(metavar="OUT", help="The output DCP folder (or an fsspec URL).", show_default=False)]
WorldSizeOpt = Annotated[
    int, typer.Option("--world-size", metavar="N", min=1, help="Ranks of the new layout.", rich_help_panel=OUTPUT)
]
NprocOpt = Annotated[
    int | None,
    nproc_option(f"Worker processes writing rank files (alias: --nproc-per-node). \\[default: {NPROC_DEFAULT}]"),
]


class ReshardFormatChoice(Choice):
    """``reshard --format``: the kind of checkpoint written."""

    auto = "auto"
    dcp = "dcp"
    deepspeed = "deepspeed"


ReshardFormatOpt = Annotated[
    ReshardFormatChoice,
    choice_option(
        ReshardFormatChoice,
        "--format",
        help="dcp: a DCP folder (dcp.load; FSDP2 via set_state_dict); deepspeed: a DeepSpeed ZeRO save of the same "
        "stage that engine.load_checkpoint reads at N ranks (a DeepSpeed source only); auto: the source's own kind.",
        rich_help_panel="Output kind",
    ),
]


class CompressChoice(Choice):
    """``reshard --compress``: the stream transform every payload is written through."""

    zstd = "zstd"


CompressOpt = Annotated[
    CompressChoice | None,
    choice_option(
        CompressChoice,
        "--compress",
        help="Write every payload as a zstd stream, as torch's FileSystemWriter with ZStandard() does; needs "
        "pip install 'fsdp-convert\\[zstd]'. \\[default: uncompressed, whatever the source]",
        show_default=False,
        rich_help_panel=OUTPUT,
    ),
]


def reshard(*args: Any, **kwargs: Any) -> ReshardResult:
    """``ops.reshard.reshard``, imported on first call, so ``--help`` and ``--version`` start without torch."""
    from fsdp_convert.ops.reshard import reshard as operation

    return operation(*args, **kwargs)


def reshard_command(
    checkpoint: CheckpointArg,
    output: OutDirArg,
    world_size: WorldSizeOpt,
    output_format: ReshardFormatOpt = ReshardFormatChoice.auto,
    compress: CompressOpt = None,
    optim_keys: OptimKeysOpt = OptimKeysChoice.names,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    rename: RenameOpt = None,
    keep_wrapper_names: KeepWrapperNamesOpt = False,
    unstack_layers: UnstackLayersOpt = False,
    dequantize: DequantizeOpt = False,
    dtype: DtypeOpt = None,
    optim_dtype: OptimDtypeOpt = None,
    adapter: AdapterOpt = None,
    model_config: ModelConfigOpt = None,
    adapter_option: AdapterOptionOpt = None,
    nproc: NprocOpt = None,
    nproc_per_node: NprocPerNodeOpt = None,
    no_crc: NoCrcOpt = False,
    follow_symlinks: FollowSymlinksOpt = False,
    progress: ProgressOpt = None,
    overwrite: OverwriteOpt = False,
    force: ForceOpt = False,
    resume: ResumeOpt = False,
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
    """Write CHECKPOINT_DIR for --world-size ranks: DCP, each rank's chunks in its own file (DeepSpeed: a DeepSpeed save)."""
    set_verbosity(verbose, quiet, debug)
    with handle_errors(), following_symlinks(follow_symlinks):
        # what needs no torch first (cli._precheck), so a usage mistake is told at once
        for rule in rename or ():
            check_rename(rule)
        check_unstack(unstack_layers, optim_keys.value, adapter)
        check_nodes(nnodes, node_rank)
        nproc = workers(nproc, nproc_per_node)
        check_reshard(checkpoint, output, overwrite=overwrite, resume=resume, force=force)
        # its imports overlap ours from here on; no torch_ready(): .metadata and plain values are
        # pickled without torch (writers._dcp_pickle), and what does import torch probes its features at first use
        computes = bool(dtype or optim_dtype or adapter or dequantize)
        start_workers_early(None if dry_run else nproc, "fsdp_convert.ops._reshard_rank", torch=computes)
        options = transform_options(
            optim_keys,
            keep_wrapper_names,
            rename,
            include,
            exclude,
            dtype,
            optim_dtype,
            unstack_layers=unstack_layers,
            dequantize=dequantize,
        )
        options = with_adapter(options, adapter, model_config, adapter_option)
        from fsdp_convert.ops.options import ReshardOptions  # not at start-up: --help and --version import less

        opts = ReshardOptions(
            world_size=world_size,
            nproc=nproc,
            transform=options,
            overwrite=overwrite,
            force=force,
            resume=resume,
            check_crc=not no_crc,
            space_check=not no_space_check,
            cluster=cluster_options(nnodes, node_rank, rdzv_backend, rdzv_endpoint, rdzv_id),
            compress=None if compress is None else compress.value,
            progress=show_progress(progress, json_output),
            output_format=output_format.value,
        )
        if dry_run:  # the run's own stages up to its lock (ops.dry_run): nothing is created
            from fsdp_convert.ops.dry_run import dry_run_reshard

            print_plan(dry_run_reshard(checkpoint, output, opts), json_output=json_output)
            return
        result = reshard(checkpoint, output, opts)
    print_result(
        result,
        json_output=json_output,
        done=f"wrote {result.output} ({result.kind}, world size {result.target_world_size}, {result.chunks} chunks, "
        f"{human_bytes(result.file_bytes)}) in {result.seconds:.1f} s",
        elsewhere=f"this node's share of the rank files is in place; rank 0 wrote {result.output}/.metadata",
        prefix=rank_prefix(),
    )


reshard_command.__doc__ = command_help(reshard_command.__doc__, EXAMPLES)
