"""``fsdp-convert adapters``: every built-in adapter from its record, at 80 columns and as ``--json``; a wrong name lists them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from rich.cells import cell_len
from typer.testing import CliRunner

from fsdp_convert.adapters import ADAPTER_RECORDS, STEPS
from fsdp_convert.cli import adapters_cmd, app
from fsdp_convert.cli.app import EXIT_CODES
from tests._cli_probe import cli_probe


def test_json_is_one_document_of_every_record(runner: CliRunner) -> None:
    result = runner.invoke(app, ["adapters", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["schema_version"] == 1
    assert doc["adapters"] == [r.to_json_dict() for r in ADAPTER_RECORDS]
    assert set(doc["steps"]) == set(STEPS)
    megatron = next(a for a in doc["adapters"] if a["name"] == "megatron-gpt-to-hf")
    assert megatron["direction"] == "Megatron-Core → HF" and megatron["implies"] == ["unstack"]
    assert megatron["needs"] == ["num_attention_heads", "num_hidden_layers"]
    assert megatron["function"] == "fsdp_convert.adapters.megatron:to_hf"
    assert next(a for a in doc["adapters"] if a["name"] == "hf-to-torchtitan-qwen3")["implies"] == ["dequantize"]


def test_the_table_names_each_adapter_whole_in_80_columns(runner: CliRunner) -> None:
    result = runner.invoke(app, ["adapters"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(cell_len(line) for line in lines) <= 80, "\n".join(line for line in lines if cell_len(line) > 80)
    assert "…" not in result.stdout
    words = result.stdout.split()
    for record in ADAPTER_RECORDS:
        row = next(i for i, line in enumerate(lines) if re.match(rf"\s*{re.escape(record.name)}\s", line))
        assert record.direction in lines[row + 1], (record.name, lines[row + 1])
        assert (record.reads[0] if record.reads else "none") in lines[row], (record.name, lines[row])  # one field a line
        for step in record.implies:
            assert step in lines[row], (record.name, lines[row])
        assert all(field in words or field + "," in words for field in record.reads)
    assert f"{len(ADAPTER_RECORDS)} built-in adapters" in result.stdout and "module:function" in result.stdout
    for step in STEPS:
        assert re.search(rf"^{step}: ", result.stdout, re.M), step
    assert result.stderr == ""


def test_needed_fields_are_marked(runner: CliRunner) -> None:
    result = runner.invoke(app, ["adapters"], env={"COLUMNS": "120"})
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*megatron-gpt-to-hf\s", line))
    block = "\n".join(lines[start : start + 4])
    assert "num_attention_heads (needed)" in block and "num_hidden_layers (needed)" in block
    assert "num_key_value_heads (needed)" not in block and "tie_word_embeddings (needed)" not in block


def test_help_fits_80_columns_with_its_examples_whole(runner: CliRunner) -> None:
    result = runner.invoke(app, ["adapters", "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert max(cell_len(line) for line in result.stdout.splitlines()) <= 80
    for example in adapters_cmd.EXAMPLES.splitlines():
        if example.strip().startswith("fsdp-convert"):
            assert example.strip() in lines, example
    for line in EXIT_CODES.splitlines():
        assert line.strip() in lines, line
    top = runner.invoke(app, ["--help"], env={"COLUMNS": "80"}).stdout
    assert re.search(r"│ adapters\s+List the built-in adapters", top), top


def test_a_wrong_adapter_name_is_one_line_listing_the_built_ins(runner: CliRunner, tmp_path: Path) -> None:
    dcp.save({"w": torch.zeros(2, 2)}, checkpoint_id=tmp_path / "ck", no_dist=True)  # type: ignore[attr-defined]
    argv = ["consolidate", str(tmp_path / "ck"), str(tmp_path / "out"), "--adapter", "torchtitan-llama4-to-hf"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --adapter 'torchtitan-llama4-to-hf': unknown; use one of "), lines
    assert all(record.name in lines[0] for record in ADAPTER_RECORDS)
    assert "fsdp-convert adapters" in lines[0]
    assert not (tmp_path / "out").exists()


def test_the_command_imports_no_torch() -> None:
    report, stderr = cli_probe(["adapters", "--json"])
    assert report == {"code": 0, "modules": []}, stderr
