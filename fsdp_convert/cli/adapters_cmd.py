"""``fsdp-convert adapters``: the built-in adapters ``--adapter NAME`` takes, from their records."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fsdp_convert.cli._options import JsonOpt
from fsdp_convert.cli._output import command_help, console, print_json
from fsdp_convert.cli._verbosity import DebugOpt, QuietOpt, VerboseOpt, set_verbosity

if TYPE_CHECKING:
    from fsdp_convert.adapters import AdapterRecord

EXAMPLES = """
Examples:

  fsdp-convert adapters
  fsdp-convert adapters --json | jq -r '.adapters[].name'
  fsdp-convert consolidate ckpt hf/ --adapter torchtitan-llama3-to-hf
"""


def adapter_records() -> tuple[AdapterRecord, ...]:
    """``adapters.ADAPTER_RECORDS``, imported on first call, so ``--help`` and the other commands start without them."""
    from fsdp_convert.adapters import ADAPTER_RECORDS

    return ADAPTER_RECORDS


def _render(records: tuple[AdapterRecord, ...], out: Console = console) -> None:
    """A table of ``records`` (name and direction, config fields, implied steps), then what each step means.

    One line per config field, so the table fits 80 columns; a field the adapter needs says so.
    """
    from fsdp_convert.adapters import STEPS
    from fsdp_convert.adapters.tables import fields_text

    table = Table(
        box=box.SIMPLE_HEAD,
        title=f"{len(records)} built-in adapters (your own: --adapter module:function)",
        title_justify="left",
        pad_edge=False,
        leading=1,
    )
    for name in ("adapter, direction", "config fields it reads", "implies"):
        table.add_column(name, no_wrap=True)
    for record in records:
        fields = fields_text(record, code="", sep="\n")
        # Text, not str: a name is never read as markup
        table.add_row(Text(f"{record.name}\n  {record.direction}"), Text(fields), Text(", ".join(record.implies)))
    out.print(table)
    for step, what in STEPS.items():  # wrapped at the terminal's width, as the table is
        out.print(Text(f"{step}: {what.replace('`', '')}."), soft_wrap=False)
    more = "--json adds each one's family, the converter it follows and what it changes besides key names."
    out.print(Text(more), soft_wrap=False)


def adapters_command(
    json_output: JsonOpt = False,
    verbose: VerboseOpt = 0,
    quiet: QuietOpt = 0,
    debug: DebugOpt = False,
) -> None:
    """List the built-in adapters --adapter NAME takes: the direction, config fields and implied steps of each.

    Config fields are the model's config.json names (--model-config, --hf-assets DIR or --adapter-option KEY=VALUE);
    a field marked (needed) has no default. An implied step runs without its flag: dequantize (as --dequantize) or
    unstack (layers split by the adapter).
    """
    set_verbosity(verbose, quiet, debug)
    records = adapter_records()
    if json_output:
        from fsdp_convert.adapters import STEPS

        steps = {step: what.replace("`", "") for step, what in STEPS.items()}
        print_json({"schema_version": 1, "adapters": [record.to_json_dict() for record in records], "steps": steps})
    else:
        _render(records)


adapters_command.__doc__ = command_help(adapters_command.__doc__, EXAMPLES)
