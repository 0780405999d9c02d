"""``fsdp-convert verify``: are two checkpoints the same, tensor by tensor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from fsdp_convert.cli._errors import handle_errors, rank_prefix
from fsdp_convert.cli._options import (
    JsonOpt,
    NnodesOpt,
    NoCrcOpt,
    NodeRankOpt,
    RdzvBackendChoice,
    RdzvBackendOpt,
    RdzvEndpointOpt,
    RdzvIdOpt,
    cluster_options,
)
from fsdp_convert.cli._output import console, print_json

if TYPE_CHECKING:
    from fsdp_convert.ops.verify import VerifyResult

EXAMPLES = """
Examples:

  fsdp-convert verify ckpt/step-1000 full.pt

  fsdp-convert verify full.pt hf-model/ --json

  fsdp-convert verify model-a.safetensors model-b.safetensors --atol 1e-3
"""

SourceArg = Annotated[
    str,
    typer.Argument(help="A DCP folder, a .pt/.pth/.bin file, a .safetensors file or a Hugging Face folder.", show_default=False),
]
AtolOpt = Annotated[float | None, typer.Option("--atol", help="Absolute tolerance for floating tensors (default: bitwise).")]
RtolOpt = Annotated[float | None, typer.Option("--rtol", help="Relative tolerance for floating tensors (default: bitwise).")]


def verify(*args: Any, **kwargs: Any) -> VerifyResult:
    """``ops.verify.verify``, imported on first call, so ``--help`` and ``--version`` start without torch."""
    from fsdp_convert.ops.verify import verify as operation

    return operation(*args, **kwargs)


def _render(result: VerifyResult) -> None:
    if result.equal:
        console.print(f"equal: {result.compared} entries match ({result.a} vs {result.b})", highlight=False)
        return
    table = Table(
        title=f"{len(result.differences)} difference(s) between {result.a} (A) and {result.b} (B)", title_justify="left"
    )
    table.add_column("key", overflow="fold")
    table.add_column("kind")
    table.add_column("detail", overflow="fold")
    for d in result.differences:
        table.add_row(d.key, d.kind, d.detail)
    console.print(table)


def verify_command(
    a: SourceArg,
    b: SourceArg,
    atol: AtolOpt = None,
    rtol: RtolOpt = None,
    no_crc: NoCrcOpt = False,
    as_consolidated: Annotated[
        bool,
        typer.Option(
            "--as-consolidated",
            help="See a DCP side as consolidate writes it by default (wrapper names removed, optimizer as optim, "
            "a flattened optimizer state nested), not with its keys as saved.",
        ),
    ] = False,
    json_output: JsonOpt = False,
    nproc: Annotated[
        int | None,
        typer.Option("--nproc", "--nproc-per-node", min=1, help="Workers comparing keys in parallel. \\[default: 1]"),
    ] = None,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    rdzv_backend: RdzvBackendOpt = RdzvBackendChoice.c10d,
    rdzv_endpoint: RdzvEndpointOpt = "",
    rdzv_id: RdzvIdOpt = "",
) -> None:
    """Compare two checkpoints of any formats; exit 0 when equal, 1 with a table of differences."""
    with handle_errors():
        from fsdp_convert.transform import TransformOptions

        options = TransformOptions() if as_consolidated else None
        cluster = cluster_options(nnodes, node_rank, rdzv_backend, rdzv_endpoint, rdzv_id)
        result = verify(a, b, atol=atol, rtol=rtol, check_crc=not no_crc, options=options, nproc=nproc, cluster=cluster)
    if not result.owner:
        console.print(f"{rank_prefix()}compared this node's share; rank 0 reports the result", markup=False, highlight=False)
        return
    if json_output:
        print_json(result.to_json_dict())
    else:
        _render(result)
        kinds = {d.kind for d in result.differences}
        if {"missing", "extra"} <= kinds and not as_consolidated:
            console.print(
                "hint: the two sides name keys differently; --as-consolidated compares a DCP side as consolidate writes it"
            )
    if not result.equal:
        raise typer.Exit(1)


verify_command.__doc__ = (verify_command.__doc__ or "") + "\n\n" + EXAMPLES
