"""Adding an output kind is one class and one entry of ``outputs.OUTPUT_KINDS``: two kinds that exist only here.

The worked example of issue 24's "Done when" for output kinds: a new kind touches ``outputs/``
(its class, its table entry) and, for a new file format, its writer in ``writers/``; nothing in
``plan.py`` or ``ops/``. Each stub is registered as the docs say (one table entry, here by
monkeypatch), then ``consolidate`` writes a real FSDP2 checkpoint through it, and the output is
loaded with torch / safetensors and compared with the run's own full state dict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fsdp_convert
from fsdp_convert import outputs
from fsdp_convert.formats.index import CheckpointIndex
from fsdp_convert.outputs import FilePlan, Only, RequestedFormat, SafetensorsFile, TorchSaveFile
from fsdp_convert.roles import Group
from fsdp_convert.transform import OutputItem, TransformOptions
from fsdp_convert.writers.hf_assets import HfAssets
from tests._samples import Sample


@dataclass(frozen=True, slots=True)
class Pt2File(TorchSaveFile):
    """A torch.save file under its own suffix, ``.pt2``: the torch.save writer, another name and result."""

    name = "pt2"
    suffixes = (".pt2",)


@dataclass(frozen=True, slots=True)
class ConsolidatedFolder:
    """A folder holding the weights in one ``consolidated.safetensors`` (Mistral's name), nothing else."""

    name = "consolidated"
    directory = True
    last = ()
    suffixes = (".consolidated",)

    def claims(self, output: Path, requested: RequestedFormat) -> bool:
        return requested == "auto" and output.suffix == ".consolidated"

    def groups(self, only: Only) -> tuple[Group, ...]:
        return ("model",)

    def plan_files(self, items: Sequence[OutputItem], *, max_shard_bytes: int) -> tuple[FilePlan, ...]:
        return (SafetensorsFile().place(items, tuple(range(len(items))), "consolidated.safetensors", 0),)

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


def _register(monkeypatch: pytest.MonkeyPatch, kind: outputs.OutputKind) -> None:
    """The one table entry a new kind needs (first, so it is asked before the built-in kinds)."""
    monkeypatch.setattr(outputs, "OUTPUT_KINDS", (kind, *outputs.OUTPUT_KINDS))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_torch_save_kind_under_its_own_suffix(ws3_ckpt: Sample, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "model.pt2"
    with pytest.raises(fsdp_convert.InvalidOptionError, match=r"unknown output suffix '\.pt2'"):
        fsdp_convert.consolidate(ws3_ckpt.checkpoint, out, nproc=1)
    _register(monkeypatch, Pt2File())
    result = fsdp_convert.consolidate(ws3_ckpt.checkpoint, out, nproc=1, verify_output=True)  # read back too
    assert result.output_format == "pt2" and result.file_bytes == out.stat().st_size
    got, want = torch.load(out, weights_only=True), ws3_ckpt.truth()
    assert sorted(got["model"]) == sorted(want["model"])
    for fqn, tensor in want["model"].items():
        assert _same_bits(got["model"][fqn], tensor), fqn
    assert sorted(got["optim"]["state"]) == sorted(want["optim"]["state"])


def test_a_folder_kind_with_its_own_file_name(ws3_ckpt: Sample, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _register(monkeypatch, ConsolidatedFolder())
    out = tmp_path / "out.consolidated"
    result = fsdp_convert.consolidate(ws3_ckpt.checkpoint, out, nproc=1)
    assert result.output_format == "consolidated" and sorted(p.name for p in out.iterdir()) == ["consolidated.safetensors"]
    got, want = load_file(out / "consolidated.safetensors"), ws3_ckpt.truth()["model"]
    assert sorted(got) == sorted(want)
    for fqn, tensor in want.items():
        assert _same_bits(got[fqn], tensor), fqn
