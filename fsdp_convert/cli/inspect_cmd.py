"""``fsdp-convert inspect``: what a checkpoint holds, from its ``.metadata`` alone."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fsdp_convert import producers
from fsdp_convert.cli._errors import handle_errors, torch_ready
from fsdp_convert.cli._options import CheckpointArg, FollowSymlinksOpt, JsonOpt
from fsdp_convert.cli._output import command_help, console, human_bytes, print_json, shorten_middle
from fsdp_convert.cli._precheck import check_checkpoint
from fsdp_convert.cli._terminal import escape_controls
from fsdp_convert.cli._verbosity import DebugOpt, QuietOpt, VerboseOpt, set_verbosity
from fsdp_convert.formats.deepspeed_files import is_deepspeed
from fsdp_convert.held_roots import following_symlinks
from fsdp_convert.output_table import METADATA_FILENAME

if TYPE_CHECKING:
    from fsdp_convert.ops.inspect import EntrySummary, InspectResult

EXAMPLES = """
Examples:

  fsdp-convert inspect ckpt/step-1000
  fsdp-convert inspect ckpt/step-1000 --wide | less -S
  fsdp-convert inspect ckpt/step-1000 --json | jq '.groups.model[].fqn'
"""


_COLUMNS = (("shape", "left"), ("dtype", "left"), ("chunks", "right"), ("bytes", "right"))
_MIN_FQN_WIDTH = 20

WideOpt = Annotated[
    bool,
    typer.Option("--wide", metavar="", help="Whole FQNs, however wide the table (always so when stdout is not a terminal)."),
]


def inspect_checkpoint(checkpoint_id: str) -> InspectResult:
    """``ops.inspect.inspect_checkpoint``, imported on first call, so ``--help`` and ``--version`` start without torch."""
    from fsdp_convert.ops.inspect import inspect_checkpoint as operation

    return operation(checkpoint_id)


def _torch_free(checkpoint: str) -> bool:
    """Whether ``checkpoint`` is indexed without torch: a local folder holding ``.metadata``, or a DeepSpeed save."""
    if "://" in checkpoint:
        return False
    return os.path.isfile(os.path.join(checkpoint, METADATA_FILENAME)) or is_deepspeed(Path(checkpoint))


# torchtitan names a stacked expert weight by its dims' letters, the expert dim first: w1_EFD, mlp1_bias_EG
_EXPERTS_FIRST = re.compile(r"_E[A-Z]*(?:\.|$)")


def _experts(row: EntrySummary) -> int | None:
    """How many experts dim 0 of ``row`` holds when it is an expert dim (torchtitan's ``w1_EFD``), else None."""
    return row.shape[0] if row.shape and _EXPERTS_FIRST.search(row.fqn) else None


def _cut(grid: tuple[int, ...], experts: int | None = None) -> str:
    """``2 x 2 (dim 0, dim 1)``, ``3 (dim 0)``, or ``whole``: the pieces on each dim that is cut.

    ``experts``: dim 0 is an expert dim of that many experts; its cut says how many each piece
    holds, as expert parallelism cuts it: ``4 (dim 0: 1 of 4 experts each)``.
    """
    cut = [d for d, pieces in enumerate(grid) if pieces > 1]
    if not cut:
        return "whole"
    dims = [f"dim {d}" for d in cut]
    if experts is not None and cut[0] == 0:
        share = f"{experts // grid[0]} of {experts} experts each" if experts % grid[0] == 0 else f"{experts} experts"
        dims[0] = f"dim 0: {share}"
    return " x ".join(str(grid[d]) for d in cut) + " (" + ", ".join(dims) + ")"


def chunks_cell(row: EntrySummary) -> str:
    """The chunks column: the count, and how the chunks cut the tensor where that is not dim 0 alone.

    ``3`` (FSDP's cut on dim 0, or whole); ``2 (dim 1)``; ``2 x 2 (dim 0, dim 1)`` (tensor
    parallelism under FSDP); ``4 (dim 0: 1 of 4 experts each)`` (a stacked expert weight, as
    expert parallelism cuts it); ``5 (irregular)`` when the chunks are no grid (``chunks_per_dim`` None).
    """
    grid = row.chunks_per_dim
    if row.kind != "tensor":
        return str(row.chunks)
    if grid is None:
        return f"{row.chunks} (irregular)"
    experts = _experts(row)
    if all(pieces == 1 for pieces in grid[1:]) and (experts is None or grid[0] == 1):
        return str(row.chunks)
    return _cut(grid, experts)


def cuts_lines(result: InspectResult, width: int) -> list[str]:
    """Header lines: how many tensors are cut each way, most common first, wrapped between items at ``width``.

    e.g. ``cuts: 92 tensors 2 (dim 0), 12 tensors 4 (dim 0), 8 tensors 2 x 2 (dim 0, dim 1), 24 tensors whole``.
    """
    counts = Counter(
        "irregular" if r.chunks_per_dim is None else _cut(r.chunks_per_dim, _experts(r))
        for r in result.entries
        if r.kind == "tensor"
    )
    items = [f"{n} {'tensor' if n == 1 else 'tensors'} {cut}" for cut, n in counts.most_common()]
    lines = ["cuts:"]
    for i, item in enumerate(items):
        item += "," if i < len(items) - 1 else ""
        if len(lines[-1]) + 1 + len(item) > width and lines[-1].strip() not in ("cuts:", ""):
            lines.append("     ")
        lines[-1] += " " + item
    return lines


def _stdout_is_terminal() -> bool:
    """Whether stdout is a terminal (rich's view: ``FORCE_COLOR``, ``TTY_COMPATIBLE`` and the like count)."""
    return console.is_terminal


def producer_text(name: str) -> str:
    """The producer as the header prints it: its record's label without Markdown, else its name.

    e.g. ``fsdp (FSDP1 or FSDP2: the same layout)`` for a checkpoint whose layout both write.
    """
    try:
        label = producers.get(name).label
    except KeyError:  # a name no record has (a result built by hand)
        label = ""
    return label.replace("`", "") or name


def _render(result: InspectResult, out: Console = console, *, whole: bool = False) -> None:
    """The header lines and one table per group; ``whole``: FQNs never shortened, the table as wide as they need."""
    out.print(escape_controls(f"checkpoint: {result.checkpoint_id}"), markup=False, highlight=False)
    out.print(
        escape_controls(
            f"producer: {producer_text(result.producer)}   world size: {result.world_size}   "
            f"total: {human_bytes(result.total_bytes)} ({result.total_bytes} bytes) in {len(result.data_files)} data files"
        ),
        markup=False,
        highlight=False,
    )
    if result.payload_formats and result.payload_formats != ("torch_save",):  # FileSystemWriter options that change them
        out.print(escape_controls(f"payloads: {', '.join(result.payload_formats)}"), markup=False, highlight=False)
    if result.details:
        line = "   ".join(f"{label}: {value}" for label, value in result.details)
        out.print(escape_controls(line), markup=False, highlight=False)
    if any(r.kind == "tensor" for r in result.entries):
        for line in cuts_lines(result, out.width):
            out.print(line, highlight=False)
    for group in ("model", "optim", "other"):
        rows = [e for e in result.entries if e.group == group]
        if not rows:
            continue
        fqns = [escape_controls(r.fqn) for r in rows]  # shortened as shown, escapes and all
        cells = [("bytes" if r.shape is None else str(r.shape), r.dtype or "-", chunks_cell(r), str(r.nbytes)) for r in rows]
        widths = [max(len(name), *(len(c[i]) for c in cells)) for i, (name, _) in enumerate(_COLUMNS)]
        # one line per row: the FQN column gets what the others and the borders leave, and long FQNs
        # are shortened in the middle to fit it instead of wrapping mid-word
        borders = 3 * (len(_COLUMNS) + 1) + 1
        fqn_width = max(map(len, fqns)) if whole else max(_MIN_FQN_WIDTH, out.width - sum(widths) - borders)
        table = Table(title=f"{group}: {len(rows)} entries, {human_bytes(sum(r.nbytes for r in rows))}", title_justify="left")
        table.add_column("FQN", no_wrap=True)
        for name, justify in _COLUMNS:
            table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
        # one row of multi-line cells, each a column's Text: drawn as one line per entry (no row
        # separators), measured and rendered once per column instead of once per cell; Text, not
        # str, so a name is never read as markup
        columns = [[shorten_middle(fqn, fqn_width) for fqn in fqns], *map(list, zip(*cells, strict=True))]
        table.add_row(*(Text("\n".join(column)) for column in columns))
        if whole and sum(widths) + borders + fqn_width > out.width:
            # the rows, not the terminal, set a whole table's width (a pipe or a file takes any line length)
            Console(file=out.file, width=sum(widths) + borders + fqn_width, no_color=out.no_color).print(table)
        else:
            out.print(table)


def inspect_command(
    checkpoint: CheckpointArg,
    wide: WideOpt = False,
    json_output: JsonOpt = False,
    follow_symlinks: FollowSymlinksOpt = False,
    verbose: VerboseOpt = 0,
    quiet: QuietOpt = 0,
    debug: DebugOpt = False,
) -> None:
    """Show FQNs, global shapes, dtypes, chunks and bytes of a DCP checkpoint, and who wrote it.

    Chunks cut on dim 0 (FSDP) show as a count; other cuts say how, e.g. 2 x 2 (dim 0, dim 1)
    for tensor parallelism under FSDP (--json: chunks_per_dim).

    In a terminal, FQNs too long for it lose parts from their middle (model.….17.mlp.weight);
    --wide, --json and a pipe or file have them whole.
    """
    set_verbosity(verbose, quiet, debug)
    with handle_errors(), following_symlinks(follow_symlinks):
        check_checkpoint(checkpoint)  # no torch yet (cli._precheck)
        if not _torch_free(checkpoint):  # DCP's .metadata and DeepSpeed's files are read as inert records
            torch_ready()
        result = inspect_checkpoint(checkpoint)
    if json_output:
        print_json(result.to_json_dict())
    else:
        _render(result, whole=wide or not _stdout_is_terminal())


inspect_command.__doc__ = command_help(inspect_command.__doc__, EXAMPLES)
