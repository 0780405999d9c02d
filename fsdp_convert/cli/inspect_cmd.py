"""``fsdp-convert inspect``: what a checkpoint holds, from its ``.metadata`` alone."""

from __future__ import annotations

from rich.table import Table

from fsdp_convert.cli._errors import handle_errors
from fsdp_convert.cli._options import CheckpointArg, JsonOpt
from fsdp_convert.cli._output import console, human_bytes, print_json
from fsdp_convert.convert import InspectResult, inspect_checkpoint

EXAMPLES = """
Examples:

  fsdp-convert inspect ckpt/step-1000

  fsdp-convert inspect ckpt/step-1000 --json | jq '.groups.model[].fqn'
"""


def _render(result: InspectResult) -> None:
    console.print(f"checkpoint: {result.checkpoint_id}", highlight=False)
    console.print(
        f"producer: {result.producer}   world size: {result.world_size}   "
        f"total: {human_bytes(result.total_bytes)} ({result.total_bytes} bytes) in {len(result.data_files)} data files",
        highlight=False,
    )
    for group in ("model", "optim", "other"):
        rows = [e for e in result.entries if e.group == group]
        if not rows:
            continue
        table = Table(title=f"{group}: {len(rows)} entries, {human_bytes(sum(r.nbytes for r in rows))}", title_justify="left")
        for col, justify in (("FQN", "left"), ("shape", "left"), ("dtype", "left"), ("chunks", "right"), ("bytes", "right")):
            table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
        for r in rows:
            shape = "bytes" if r.shape is None else str(r.shape)
            table.add_row(r.fqn, shape, r.dtype or "-", str(r.chunks), str(r.nbytes))
        console.print(table)


def inspect_command(checkpoint: CheckpointArg, json_output: JsonOpt = False) -> None:
    """Show FQNs, global shapes, dtypes, chunks and bytes of a DCP checkpoint, and who wrote it."""
    with handle_errors():
        result = inspect_checkpoint(checkpoint)
    if json_output:
        print_json(result.to_json_dict())
    else:
        _render(result)


inspect_command.__doc__ = (inspect_command.__doc__ or "") + "\n\n" + EXAMPLES
