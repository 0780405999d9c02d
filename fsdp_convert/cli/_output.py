"""Output channels: the result on stdout, everything else on stderr."""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from typing import Any

from rich.cells import cell_len
from rich.console import Console

from fsdp_convert.cli._terminal import escape_controls
from fsdp_convert.progress import human_bytes  # one unit system for results and progress bars (binary, as ls -h)

__all__ = ["console", "err_console", "command_help", "print_json", "human_bytes", "print_result", "shorten_middle"]

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def command_help(doc: str | None, examples: str) -> str:
    """A command's ``--help`` text: its docstring, paragraphs unwrapped, then ``examples`` as they are.

    typer keeps the single line breaks of every paragraph after the first, and rich then wraps
    each line again at the terminal's width: a docstring's 100-column lines would come out ragged.
    The examples (one command a line, indented) keep their breaks.
    """
    paragraphs = inspect.cleandoc(doc or "").split("\n\n")
    unwrapped = [" ".join(line.strip() for line in p.splitlines()) for p in paragraphs]
    # typer dedents what follows the first paragraph by its lines after the first; an empty first
    # line makes "Examples:" one of those, at column 0, so the examples keep their indent
    return "\n\n".join(unwrapped) + "\n\n\n" + examples.strip("\n")


def print_json(doc: dict[str, Any]) -> None:
    """Write exactly one JSON document to stdout (no colour, no wrapping)."""
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()


def shorten_middle(name: str, width: int) -> str:
    """``name`` in at most ``width`` cells, its middle replaced by ``…``.

    The first dotted part (the group: ``model``, ``optim``) and the last (the parameter or state
    name) stay, then indices (``layers.17``: which layer), then as much of the rest as fits, read
    from the end: ``optim.state.model.layers.31.self_attn.q_proj.weight.exp_avg_sq`` in 37 cells is
    ``optim.….31.….q_proj.weight.exp_avg_sq``. When even the first and last parts do not fit,
    characters go from the middle.
    """
    if cell_len(name) <= width:
        return name
    if width <= 1:
        return "…"[:width]
    parts = name.split(".")
    last = len(parts) - 1

    def joined(keep: set[int], fill: str = "") -> str:
        # each run of dropped parts is one "…"; `fill` ends the run just before the kept tail
        out: list[str] = []
        for i in sorted(keep):
            if out and i - 1 not in keep:
                out.append("…" + (fill if i == tail else ""))
            out.append(parts[i])
        return ".".join(out)

    keep, tail = {0, last}, last
    if last < 2 or cell_len(joined(keep)) > width:
        right = (width - 1) // 2
        return name[: width - 1 - right] + "…" + (name[-right:] if right else "")
    for i in range(last - 1, 0, -1):
        if parts[i].isdigit() and cell_len(joined(keep | {i})) <= width:
            keep.add(i)
    for i in range(last - 1, 0, -1):  # the tail, without holes
        if i not in keep and cell_len(joined(keep | {i})) > width:
            break
        keep.add(i)
        tail = i
    room = width - cell_len(joined(keep))
    if tail - 1 not in keep and room >= 4:  # the end of the part that did not fit, where it says something
        return joined(keep, parts[tail - 1][max(0, len(parts[tail - 1]) - room) :])
    return joined(keep)


# JSON names of result fields where they differ from the attribute's
_JSON_NAMES = {"output_format": "format", "target_world_size": "world_size", "owner": "wrote"}


def print_result(result: Any, *, json_output: bool, done: str, elsewhere: str, prefix: str = "") -> None:
    """Report a ``ConsolidateResult`` or ``ReshardResult``.

    ``--json``: one document of all its fields (``schema_version`` 1, seconds rounded to ms).
    Otherwise one line: ``done`` where this process wrote the output, ``prefix + elsewhere``
    where rank 0's process did. The result's ``notes`` (files ``reshard`` left out), where this
    process wrote the output, go to stderr as ``note: ...`` lines in either mode.
    """
    if json_output:
        doc: dict[str, Any] = {"schema_version": 1}
        for field in dataclasses.fields(result):
            value = getattr(result, field.name)
            doc[_JSON_NAMES.get(field.name, field.name)] = (
                round(value, 3) if field.name == "seconds" else (str(value) if field.name == "output" else value)
            )
        print_json(doc)
    elif not result.owner:
        console.print(escape_controls(prefix + elsewhere), markup=False, highlight=False)
    else:
        console.print(escape_controls(done), markup=False, highlight=False)
    if result.owner:
        for note in getattr(result, "notes", ()):
            err_console.print(f"note: {escape_controls(note)}", markup=False, highlight=False)
