"""``fsdp-convert verify``: are two checkpoints the same, tensor by tensor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from fsdp_convert.cli._errors import handle_errors, rank_prefix, torch_ready
from fsdp_convert.cli._options import (
    CASTING,
    DtypeChoice,
    FollowSymlinksOpt,
    JsonOpt,
    NoCrcOpt,
    ProgressOpt,
    choice_option,
)
from fsdp_convert.cli._output import command_help, console, err_console, print_json
from fsdp_convert.cli._precheck import check_nodes, check_verify
from fsdp_convert.cli._run_options import (
    NPROC_DEFAULT,
    NnodesOpt,
    NodeRankOpt,
    NprocPerNodeOpt,
    RdzvBackendChoice,
    RdzvBackendOpt,
    RdzvEndpointOpt,
    RdzvIdOpt,
    cluster_options,
    nproc_option,
    start_workers_early,
    workers,
)
from fsdp_convert.cli._terminal import escape_controls
from fsdp_convert.cli._verbosity import DebugOpt, QuietOpt, VerboseOpt, set_verbosity, show_progress
from fsdp_convert.held_roots import following_symlinks

if TYPE_CHECKING:
    from fsdp_convert.ops.verify import VerifyOptions, VerifyResult

# one line each, under 78 columns, so --help never breaks a command in two
EXAMPLES = """
Examples:

  fsdp-convert verify ckpt/step-1000 full.pt
  fsdp-convert verify ckpt/step-1000 bf16.pt --dtype bf16
  fsdp-convert verify full.pt hf-model/ --json
  fsdp-convert verify model-a.safetensors model-b.safetensors --atol 1e-3
"""

# verify's own: 2 is any trouble, as for cmp and diff (scripts tell "different" from "could not compare")
EXIT_CODES = """Exit codes, as cmp and diff:
  0    the two are equal
  1    they differ (a table of the differences on stdout)
  2    trouble: an input missing or unreadable, or a usage error
  70   internal error: a bug, please report it
  130  interrupted (143: SIGTERM, 129: SIGHUP)
Errors are one line on stderr; --debug adds the traceback."""

_COMPARISON = "Comparison"
SourceAArg = Annotated[
    str,
    typer.Argument(
        metavar="A",
        help="The reference: a DCP folder, a .pt/.pth/.bin or .safetensors file, or a Hugging Face folder.",
        show_default=False,
    ),
]
SourceBArg = Annotated[
    str, typer.Argument(metavar="B", help="The checkpoint to compare with A, of any of the same kinds.", show_default=False)
]
AtolOpt = Annotated[
    float | None,
    typer.Option(
        "--atol",
        metavar="FLOAT",
        help="Absolute tolerance for floating tensors. \\[default: bitwise]",
        rich_help_panel=_COMPARISON,
    ),
]
RtolOpt = Annotated[
    float | None,
    typer.Option(
        "--rtol",
        metavar="FLOAT",
        help="Relative tolerance for floating tensors. \\[default: bitwise]",
        rich_help_panel=_COMPARISON,
    ),
]
AsConsolidatedOpt = Annotated[
    bool,
    typer.Option(
        "--as-consolidated",
        metavar="",
        help="See a DCP side as consolidate writes it by default (wrapper names removed, optimizer as optim, "
        "a flattened optimizer state nested), not with its keys as saved.",
        rich_help_panel=_COMPARISON,
    ),
]
DtypeOpt = Annotated[
    DtypeChoice | None,
    choice_option(
        DtypeChoice,
        "--dtype",
        help="See a DCP side's floating-point model tensors cast, as consolidate --dtype writes them. \\[default: keep]",
        show_default=False,
        rich_help_panel=CASTING,
    ),
]
OptimDtypeOpt = Annotated[
    DtypeChoice | None,
    choice_option(
        DtypeChoice,
        "--optim-dtype",
        help="See a DCP side's floating-point optimizer state cast, as consolidate --optim-dtype writes it. \\[default: keep]",
        show_default=False,
        rich_help_panel=CASTING,
    ),
]
NprocOpt = Annotated[
    int | None, nproc_option(f"Worker processes comparing keys (alias: --nproc-per-node). \\[default: {NPROC_DEFAULT}]")
]


def verify(a: str, b: str, options: VerifyOptions) -> VerifyResult:
    """``ops.verify.verify``, imported on first call, so ``--help`` and ``--version`` start without torch."""
    from fsdp_convert.ops.verify import verify as operation

    return operation(a, b, options)


TABLE_ROWS = 20  # differences shown in the table; --json gives them all


def _render(result: VerifyResult) -> None:
    if result.equal:
        console.print(
            escape_controls(f"equal: {result.compared} entries match ({result.a} vs {result.b})"), markup=False, highlight=False
        )
        return
    title = escape_controls(f"{len(result.differences)} difference(s) between {result.a} (A) and {result.b} (B)")
    table = Table(title=Text(title), title_justify="left")
    table.add_column("key", overflow="fold")
    table.add_column("kind")
    table.add_column("detail", overflow="fold")
    for d in result.differences[:TABLE_ROWS]:
        table.add_row(*(Text(escape_controls(cell)) for cell in (d.key, d.kind, d.detail)))  # Text: never read as markup
    console.print(table)
    if len(result.differences) > TABLE_ROWS:
        console.print(
            f"... and {len(result.differences) - TABLE_ROWS} more (--json lists them all)", markup=False, highlight=False
        )


def verify_command(
    a: SourceAArg,
    b: SourceBArg,
    atol: AtolOpt = None,
    rtol: RtolOpt = None,
    as_consolidated: AsConsolidatedOpt = False,
    dtype: DtypeOpt = None,
    optim_dtype: OptimDtypeOpt = None,
    nproc: NprocOpt = None,
    nproc_per_node: NprocPerNodeOpt = None,
    no_crc: NoCrcOpt = False,
    follow_symlinks: FollowSymlinksOpt = False,
    progress: ProgressOpt = None,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    rdzv_backend: RdzvBackendOpt = RdzvBackendChoice.c10d,
    rdzv_endpoint: RdzvEndpointOpt = "",
    rdzv_id: RdzvIdOpt = "",
    json_output: JsonOpt = False,
    verbose: VerboseOpt = 0,
    quiet: QuietOpt = 0,
    debug: DebugOpt = False,
) -> None:
    """Compare two checkpoints of any formats, key by key; tensors bit for bit unless --atol/--rtol."""
    set_verbosity(verbose, quiet, debug)
    with handle_errors(trouble=2), following_symlinks(follow_symlinks):
        check_nodes(nnodes, node_rank)  # what needs no torch first (cli._precheck)
        nproc = workers(nproc, nproc_per_node)
        check_verify(a, b)
        # its imports overlap ours from here on; torch only for a cast or a tolerance: tensors both sides
        # store as bytes are compared as those bytes, without torch (ops.verify), as consolidate moves them
        computes = dtype is not None or optim_dtype is not None or atol is not None or rtol is not None
        start_workers_early(nproc, "fsdp_convert.ops.verify", torch=computes)
        if computes:
            torch_ready()
        from fsdp_convert.ops.options import VerifyOptions
        from fsdp_convert.transform import TransformOptions

        options = VerifyOptions(
            atol=atol,
            rtol=rtol,
            check_crc=not no_crc,
            transform=TransformOptions() if as_consolidated else None,
            nproc=nproc,
            cluster=cluster_options(nnodes, node_rank, rdzv_backend, rdzv_endpoint, rdzv_id),
            dtype=None if dtype is None else dtype.value,  # a name; VerifyOptions makes it the torch.dtype
            optim_dtype=None if optim_dtype is None else optim_dtype.value,
            progress=show_progress(progress, json_output),
        )
        result = verify(a, b, options)
    if not result.owner:
        console.print(f"{rank_prefix()}compared this node's share; rank 0 reports the result", markup=False, highlight=False)
        return
    if result.note:
        err_console.print(f"note: {escape_controls(result.note)}", markup=False, highlight=False)  # not the result: stderr
    if json_output:
        print_json(result.to_json_dict())
    else:
        _render(result)
        kinds = {d.kind for d in result.differences}
        if {"missing", "extra"} <= kinds and not as_consolidated:
            err_console.print(  # a hint is not the result: stderr
                "hint: the two sides name keys differently; --as-consolidated compares a DCP side as consolidate writes it",
                markup=False,
                highlight=False,
            )
    if not result.equal:
        raise typer.Exit(1)


verify_command.__doc__ = command_help(verify_command.__doc__, EXAMPLES)
