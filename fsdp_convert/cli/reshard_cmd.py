"""``fsdp-convert reshard``: the same checkpoint laid out for a new world size."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from fsdp_convert.cli._errors import handle_errors, rank_prefix
from fsdp_convert.cli._options import (
    AdapterOpt,
    AdapterOptionOpt,
    CheckpointArg,
    Choice,
    DtypeOpt,
    ExcludeOpt,
    IncludeOpt,
    JsonOpt,
    KeepWrapperNamesOpt,
    ModelConfigOpt,
    NnodesOpt,
    NoCrcOpt,
    NodeRankOpt,
    OptimDtypeOpt,
    OptimKeysChoice,
    OptimKeysOpt,
    OverwriteOpt,
    RdzvBackendChoice,
    RdzvBackendOpt,
    RdzvEndpointOpt,
    RdzvIdOpt,
    RenameOpt,
    choice_option,
    cluster_options,
    transform_options,
    with_adapter,
)
from fsdp_convert.cli._output import human_bytes, print_result
from fsdp_convert.cli._run_options import NoSpaceCheckOpt, ResumeOpt

if TYPE_CHECKING:
    from fsdp_convert.ops.reshard import ReshardResult

EXAMPLES = """
Examples:

  fsdp-convert reshard ckpt/step-1000 ckpt/step-1000-ws4 --world-size 4

  fsdp-convert reshard ckpt/step-1000 ckpt/step-1000-ws1 --world-size 1 --overwrite

  fsdp-convert reshard ckpt/step-1000 ckpt/step-1000-ws8 --world-size 8 --compress zstd

  fsdp-convert reshard accelerate-ckpt/ accelerate-ckpt-ws8/ --world-size 8   # both DCP folders; RNG pickles left out
"""

OutDirArg = Annotated[str, typer.Argument(metavar="OUT", help="Output DCP folder (or s3://... via fsspec).", show_default=False)]
WorldSizeOpt = Annotated[int, typer.Option("--world-size", min=1, help="Target world size (ranks of the new layout).")]
WritersOpt = Annotated[
    int | None,
    typer.Option(
        "--nproc",
        "--nproc-per-node",
        min=1,
        help="Workers writing rank files in parallel (torch's elastic launcher, gloo). \\[default: 1]",
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
        help="Write every payload as a zstd stream, as FileSystemWriter(_extensions=[ZStandard()]) does "
        "(needs the zstandard package: pip install 'fsdp-convert[zstd]'). Default: uncompressed, whatever the source.",
        show_default=False,
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
    nproc: WritersOpt = None,
    optim_keys: OptimKeysOpt = OptimKeysChoice.names,
    keep_wrapper_names: KeepWrapperNamesOpt = False,
    rename: RenameOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    dtype: DtypeOpt = None,
    optim_dtype: OptimDtypeOpt = None,
    adapter: AdapterOpt = None,
    model_config: ModelConfigOpt = None,
    adapter_option: AdapterOptionOpt = None,
    compress: CompressOpt = None,
    overwrite: OverwriteOpt = False,
    resume: ResumeOpt = False,
    no_crc: NoCrcOpt = False,
    no_space_check: NoSpaceCheckOpt = False,
    json_output: JsonOpt = False,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    rdzv_backend: RdzvBackendOpt = RdzvBackendChoice.c10d,
    rdzv_endpoint: RdzvEndpointOpt = "",
    rdzv_id: RdzvIdOpt = "",
) -> None:
    """Write CHECKPOINT_DIR as a DCP checkpoint for --world-size ranks, each rank's chunks in its own file."""
    with handle_errors():
        options = transform_options(optim_keys, keep_wrapper_names, rename, include, exclude, dtype, optim_dtype)
        options = with_adapter(options, adapter, model_config, adapter_option)
        cluster = cluster_options(nnodes, node_rank, rdzv_backend, rdzv_endpoint, rdzv_id)
        result = reshard(
            checkpoint,
            output,
            world_size=world_size,
            nproc=nproc,
            options=options,
            overwrite=overwrite,
            resume=resume,
            check_crc=not no_crc,
            space_check=not no_space_check,
            cluster=cluster,
            compress=None if compress is None else compress.value,
        )
    print_result(
        result,
        json_output=json_output,
        done=f"wrote {result.output} (DCP, world size {result.target_world_size}, {result.chunks} chunks, "
        f"{human_bytes(result.file_bytes)}) in {result.seconds:.1f} s",
        elsewhere=f"this node's share of the rank files is in place; rank 0 wrote {result.output}/.metadata",
        prefix=rank_prefix(),
    )


reshard_command.__doc__ = (reshard_command.__doc__ or "") + "\n\n" + EXAMPLES
