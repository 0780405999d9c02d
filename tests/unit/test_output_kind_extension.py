"""Adding an output kind is two files of ``fsdp_convert/``: its row in ``output_table.py``, its class in ``outputs``.

The worked example of docs/architecture.md's "An output kind": each kind here is added as the docs
say and by nothing else, one row of ``output_table.OUTPUT_ROWS`` and its class's entry in
``outputs.OUTPUT_KINDS`` (both by monkeypatch), then written from a real FSDP2 checkpoint:

- a torch.save file under its own suffix, ``.pt2``, written by the library and read back by ``--verify``;
- a folder kind with its own ``--format`` name, ``consolidated``, holding the weights in one
  ``consolidated.safetensors`` (Mistral's name), the optimizer state in ``optim_state.pt`` and
  the rest in ``train_state.pt``:
  the CLI takes ``--format consolidated`` (and lists it), ``consolidate`` writes it, ``verify``
  reads it back equal to the checkpoint, ``reshard`` takes it as its input, and the names the
  output check takes as this tool's own (``output_table.own_files``) hold its files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert import output_table, outputs
from fsdp_convert.cli.app import app
from fsdp_convert.formats.index import CheckpointIndex
from fsdp_convert.item import OutputItem
from fsdp_convert.output_table import FolderFile, OutputRow
from fsdp_convert.outputs import FilePlan, Only, RowKind, SafetensorsFile, TorchSaveFile
from fsdp_convert.outputs.files import check_tensors
from fsdp_convert.roles import GROUPS, Group
from fsdp_convert.transform import TransformOptions
from fsdp_convert.writers.hf_assets import HfAssets
from tests._compare import assert_same_state
from tests._samples import Sample

# --- a torch.save file under its own suffix: the row (output_table.py) and the class (outputs) ---

PT2_ROW = OutputRow(name="pt2", suffixes=(".pt2",), content="torch_save")


@dataclass(frozen=True, slots=True)
class Pt2File(TorchSaveFile):
    """A torch.save file under its own suffix, ``.pt2``: the torch.save writer, another row."""

    row = PT2_ROW


# --- a folder kind with its own --format name: the row (output_table.py) and the class (outputs) ---

CONSOLIDATED_ROW = OutputRow(
    name="consolidated",
    format="consolidated",
    suffixes=(".consolidated",),
    folder=True,
    any_name=True,
    folder_files=(
        FolderFile("consolidated.safetensors", "safetensors", "model", ("model",)),
        FolderFile("optim_state.pt", "torch_save", "optim", ("optim",)),
        FolderFile("train_state.pt", "torch_save", "other"),
    ),
)


@dataclass(frozen=True, slots=True)
class ConsolidatedFolder(RowKind):
    """One file per group, as its row names them: the weights in safetensors, the rest in torch.save files."""

    row = CONSOLIDATED_ROW

    def groups(self, only: Only) -> tuple[Group, ...]:
        return GROUPS if only == "all" else (only,)

    def plan_files(self, items: Sequence[OutputItem], *, max_shard_bytes: int) -> tuple[FilePlan, ...]:
        check_tensors(items)
        files = []
        for f in self.row.folder_files:  # each holds its group's items, their paths without its nest
            ids = tuple(i for i, item in enumerate(items) if item.group == f.group)
            kind = SafetensorsFile() if f.content == "safetensors" else TorchSaveFile()
            if ids:
                files.append(kind.place(items, ids, f.name, len(f.nest) if f.content == "torch_save" else 0))
        return tuple(files)

    def shards(self, files: Sequence[FilePlan]) -> tuple[FilePlan, ...]:
        return ()

    def write_index(self, folder: Path, files: Sequence[FilePlan], items: Sequence[OutputItem]) -> int:
        return 0

    def finish(
        self,
        folder: Path,
        *,
        index: CheckpointIndex,
        items: Sequence[OutputItem],
        options: TransformOptions,
        assets: HfAssets | None,
    ) -> int:
        return 0


def _register(monkeypatch: pytest.MonkeyPatch, row: OutputRow, kind: outputs.OutputKind) -> None:
    """The two things a new kind adds: its row in the outputs table, its class in ``OUTPUT_KINDS``."""
    monkeypatch.setattr(output_table, "OUTPUT_ROWS", (row, *output_table.OUTPUT_ROWS))
    monkeypatch.setattr(outputs, "OUTPUT_KINDS", (kind, *outputs.OUTPUT_KINDS))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_torch_save_kind_under_its_own_suffix(ws3_ckpt: Sample, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "model.pt2"
    with pytest.raises(fsdp_convert.InvalidOptionError, match=r"unknown output suffix '\.pt2'"):
        fsdp_convert.consolidate(ws3_ckpt.checkpoint, out, nproc=1)
    _register(monkeypatch, PT2_ROW, Pt2File())
    result = fsdp_convert.consolidate(ws3_ckpt.checkpoint, out, nproc=1, verify_output=True)  # read back too
    assert result.output_format == "pt2" and result.file_bytes == out.stat().st_size
    got, want = torch.load(out, weights_only=True), ws3_ckpt.truth()
    assert sorted(got["model"]) == sorted(want["model"])
    for fqn, tensor in want["model"].items():
        assert _same_bits(got["model"][fqn], tensor), fqn
    assert sorted(got["optim"]["state"]) == sorted(want["optim"]["state"])


def test_a_folder_kind_with_its_own_format_name(
    ws3_ckpt: Sample, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runner: CliRunner
) -> None:
    ck, out, resharded = str(ws3_ckpt.checkpoint), tmp_path / "out", tmp_path / "resharded"
    consolidate = ["consolidate", ck, str(out), "--format", "consolidated", "--nproc", "1"]
    refused = runner.invoke(app, consolidate)
    assert refused.exit_code == 2 and "--format 'consolidated': use auto, torch or safetensors" in refused.stderr
    _register(monkeypatch, CONSOLIDATED_ROW, ConsolidatedFolder())

    # the CLI takes the new --format name, checked against the table when the command runs
    done = runner.invoke(app, [*consolidate, "--json"])
    assert done.exit_code == 0, done.output
    assert sorted(p.name for p in out.iterdir()) == ["consolidated.safetensors", "optim_state.pt", "train_state.pt"]
    truth = ws3_ckpt.truth()
    got = load_file(out / "consolidated.safetensors")
    assert sorted(got) == sorted(truth["model"])
    for fqn, tensor in truth["model"].items():
        assert _same_bits(got[fqn], tensor), fqn
    assert assert_same_state(torch.load(out / "optim_state.pt", weights_only=True), truth["optim"]) > 0

    # read back: verify compares it with the checkpoint, both ways
    for a, b in ((ck, str(out)), (str(out), ck)):
        checked = runner.invoke(app, ["verify", a, b, "--json"])
        assert checked.exit_code == 0, checked.output
        assert json.loads(checked.stdout)["equal"], checked.stdout

    # the folder as reshard's input: a DCP folder holding what consolidate wrote
    done = runner.invoke(app, ["reshard", str(out), str(resharded), "--world-size", "2", "--nproc", "1"])
    assert done.exit_code == 0, done.output
    checked = runner.invoke(app, ["verify", str(out), str(resharded)])
    assert checked.exit_code == 0, checked.output

    # the names the output check takes as this tool's own (output_table.own_files) hold the folder's files
    own = output_table.own_files()
    assert all(own.file(p.name) for p in out.iterdir()) and not own.file("notes.txt")
