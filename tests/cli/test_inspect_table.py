"""inspect's table: one line per entry in an 80-column terminal, long FQNs shortened in the middle."""

from __future__ import annotations

import json
import re

import pytest
from rich.cells import cell_len
from typer.testing import CliRunner

from fsdp_convert.cli import app
from fsdp_convert.cli._output import shorten_middle
from tests._samples import Sample


@pytest.mark.parametrize(
    ("name", "width", "short"),
    [
        ("model.layers.0.mlp.0.weight", 40, "model.layers.0.mlp.0.weight"),  # fits: unchanged
        ("optim.state.layers.0.attn_norm.weight.exp_avg_sq", 37, "optim.….0.attn_norm.weight.exp_avg_sq"),
        ("optim.state.layers.0.attn_norm.weight.step", 37, "optim.…layers.0.attn_norm.weight.step"),  # room left: filled
        ("optim.state.tok_embeddings.weight.exp_avg_sq", 37, "optim.…k_embeddings.weight.exp_avg_sq"),
        # the layer index outlives the names around it
        ("optim.state.model.layers.31.self_attn.q_proj.weight.exp_avg_sq", 37, "optim.….31.….q_proj.weight.exp_avg_sq"),
        ("optim.state.model.layers.31.self_attn.q_proj.weight.exp_avg_sq", 20, "optim.….exp_avg_sq"),
        ("model.a_very_long_parameter_name_without_dots", 20, "model.a_ve…hout_dots"),  # first and last don't fit
        ("abcdefghijklmnopqrstuvwxyz", 10, "abcde…wxyz"),
        ("a.bbbbbbbbbbbbbbb.c", 6, "a.….c"),  # one cell left: not worth a fragment
        ("a.bcdefghijklmnopq.r", 10, "a.…mnopq.r"),
        ("abc", 1, "…"),
        ("abc", 0, ""),
    ],
)
def test_shorten_middle(name: str, width: int, short: str) -> None:
    assert shorten_middle(name, width) == short
    assert cell_len(short) <= width


def _pattern(cell: str) -> re.Pattern[str]:
    """What a shortened FQN stands for: its pieces in order, anything where the ellipses are."""
    return re.compile(".+".join(re.escape(piece) for piece in cell.split("…")))


@pytest.mark.parametrize("columns", [80, 100, 200])
def test_every_row_is_one_line_and_names_its_fqn(runner: CliRunner, ws3_ckpt: Sample, columns: int) -> None:
    doc = json.loads(runner.invoke(app, ["inspect", str(ws3_ckpt.checkpoint), "--json"]).stdout)
    result = runner.invoke(app, ["inspect", str(ws3_ckpt.checkpoint)], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert all(cell_len(line) <= columns for line in lines[2:]), "\n".join(lines)  # the two header lines soft-wrap
    rows = [line for line in lines if line.startswith("│")]
    fqns = [row["fqn"] for group in doc["groups"].values() for row in group]
    assert len(rows) == len(fqns)  # no row continues on a second line
    cells = [row.split("│")[1].strip() for row in rows]
    for cell, fqn in zip(cells, fqns):
        assert cell == fqn or ("…" in cell and _pattern(cell).fullmatch(fqn)), (cell, fqn)
    assert len(set(cells)) == len(cells)  # still tells the rows apart
    shortened = [cell for cell in cells if "…" in cell]
    assert shortened if columns == 80 else not shortened  # a wide terminal shows every FQN whole
