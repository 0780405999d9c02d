"""inspect's table: one line per entry in an 80-column terminal, long FQNs shortened in the middle; how chunks cut tensors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from rich.cells import cell_len
from typer.testing import CliRunner

from fsdp_convert.cli import app, inspect_cmd
from fsdp_convert.cli._output import shorten_middle
from fsdp_convert.cli.inspect_cmd import chunks_cell, cuts_lines
from fsdp_convert.ops.inspect import EntrySummary, InspectResult
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
def test_every_row_is_one_line_and_names_its_fqn(
    runner: CliRunner, ws3_ckpt: Sample, columns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = json.loads(runner.invoke(app, ["inspect", str(ws3_ckpt.checkpoint), "--json"]).stdout)
    monkeypatch.setattr(inspect_cmd, "_stdout_is_terminal", lambda: True)  # CliRunner's stdout is no terminal
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


def _row(shape: tuple[int, ...] | None, chunks: int, grid: tuple[int, ...] | None) -> EntrySummary:
    return EntrySummary(
        fqn="model.w", group="model", kind="bytes" if shape is None else "tensor", shape=shape,
        dtype=None if shape is None else "float32", chunks=chunks, chunks_per_dim=grid, nbytes=4,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("shape", "chunks", "grid", "cell"),
    [
        ((101, 16), 3, (3, 1), "3"),  # FSDP: dim 0 alone stays a count
        ((1,), 2, (1,), "2"),  # an empty chunk beside the whole tensor
        ((), 1, (), "1"),
        ((16, 64), 4, (2, 2), "2 x 2 (dim 0, dim 1)"),  # FSDP over tensor parallelism
        ((16, 64), 2, (1, 2), "2 (dim 1)"),
        ((4, 4, 4), 8, (2, 1, 4), "2 x 4 (dim 0, dim 2)"),
        ((16, 64), 3, None, "3 (irregular)"),
        (None, 1, None, "1"),  # bytes
    ],
)
def test_chunks_cell_says_how_a_tensor_is_cut(
    shape: tuple[int, ...] | None, chunks: int, grid: tuple[int, ...] | None, cell: str
) -> None:
    assert chunks_cell(_row(shape, chunks, grid)) == cell


def test_cuts_lines_count_tensors_and_wrap_between_items() -> None:
    rows = [_row((8, 8), 2, (2, 1))] * 3 + [_row((8, 8), 4, (2, 2))] + [_row((), 1, ())] * 2 + [_row(None, 1, None)]
    result = InspectResult(
        checkpoint_id=Path("ck"), producer="fsdp2", world_size=4, total_bytes=28, data_files=(), version=None, entries=tuple(rows)
    )
    assert cuts_lines(result, 200) == ["cuts: 3 tensors 2 (dim 0), 2 tensors whole, 1 tensor 2 x 2 (dim 0, dim 1)"]
    assert cuts_lines(result, 30) == [
        "cuts: 3 tensors 2 (dim 0),",
        "      2 tensors whole,",
        "      1 tensor 2 x 2 (dim 0, dim 1)",
    ]


@pytest.mark.parametrize("args", [[], ["--wide"]])
def test_whole_fqns_in_a_pipe_and_with_wide(
    runner: CliRunner, ws3_ckpt: Sample, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    """Not a terminal (CliRunner, a pipe, a file), or --wide in one: every FQN whole, each row one line."""
    if args:
        monkeypatch.setattr(inspect_cmd, "_stdout_is_terminal", lambda: True)
    doc = json.loads(runner.invoke(app, ["inspect", str(ws3_ckpt.checkpoint), "--json"]).stdout)
    fqns = [row["fqn"] for group in doc["groups"].values() for row in group]
    longest = max(fqns, key=len)
    assert len(longest) > 40  # too long for the FQN column of an 80-column table: the case that gets shortened
    result = runner.invoke(app, ["inspect", str(ws3_ckpt.checkpoint), *args], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == fqns
    assert "…" not in result.stdout
