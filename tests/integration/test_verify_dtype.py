"""verify(dtype=, optim_dtype=): a cast consolidation compares equal, bit for bit after the cast, with its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli import app
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.transform import TransformOptions
from tests._samples import Sample

BF16 = TransformOptions(dtype=torch.bfloat16, optim_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_export(ws3_ckpt: Sample, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fp32 sample consolidated with --dtype bf16 --optim-dtype bf16."""
    out = tmp_path_factory.mktemp("bf16") / "bf16.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, out, options=BF16)
    return out


def _kinds(result: fsdp_convert.VerifyResult) -> dict[str, str]:
    return {d.key: d.detail for d in result.differences}


def test_bf16_export_equals_its_fp32_checkpoint_after_the_cast(ws3_ckpt: Sample, bf16_export: Path) -> None:
    state = torch.load(bf16_export, weights_only=True)
    assert state["model"]["output.weight"].dtype == torch.bfloat16
    steps = [s["step"] for s in state["optim"]["state"].values()]
    assert steps and all(s.dtype == torch.float32 for s in steps)  # consolidate never casts step

    result = fsdp_convert.verify(ws3_ckpt.checkpoint, bf16_export, dtype="bf16", optim_dtype=torch.bfloat16)
    assert result.equal, result.differences[:3]
    assert result.compared > 0
    # either side may be the cast one: the side already in bf16 is left as it is
    assert fsdp_convert.verify(bf16_export, ws3_ckpt.checkpoint, dtype="bfloat16", optim_dtype="bf16").equal
    # with two workers (the casts travel in the job)
    assert fsdp_convert.verify(ws3_ckpt.checkpoint, bf16_export, dtype="bf16", optim_dtype="bf16", nproc=2).equal


def test_without_the_cast_the_dtypes_differ(ws3_ckpt: Sample, bf16_export: Path) -> None:
    plain = _kinds(fsdp_convert.verify(ws3_ckpt.checkpoint, bf16_export))
    assert plain["model.output.weight"] == "dtype float32 != bfloat16"
    assert plain["optim.state.output.weight.exp_avg"] == "dtype float32 != bfloat16"
    assert not any(key.endswith(".step") for key in plain)
    # a tolerance alone does not excuse a dtype; with the cast asked, it compares the cast values
    assert _kinds(fsdp_convert.verify(ws3_ckpt.checkpoint, bf16_export, atol=1e-2)) == plain
    assert fsdp_convert.verify(ws3_ckpt.checkpoint, bf16_export, atol=1e-2, dtype="bf16", optim_dtype="bf16").equal
    # each cast covers its own group only
    model_only = _kinds(fsdp_convert.verify(ws3_ckpt.checkpoint, bf16_export, dtype="bf16"))
    assert model_only and all(key.startswith("optim.state.") for key in model_only)
    optim_only = _kinds(fsdp_convert.verify(ws3_ckpt.checkpoint, bf16_export, optim_dtype="bf16"))
    assert optim_only and all(key.startswith("model.") for key in optim_only)


def test_after_the_cast_one_ulp_is_a_difference(ws3_ckpt: Sample, bf16_export: Path, tmp_path: Path) -> None:
    state = torch.load(bf16_export, weights_only=True)
    weight = state["model"]["output.weight"]
    weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float("inf"), dtype=torch.bfloat16))
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)
    result = fsdp_convert.verify(ws3_ckpt.checkpoint, bad, dtype="bf16", optim_dtype="bf16")
    assert [(d.key, d.kind) for d in result.differences] == [("model.output.weight", "differs")]
    assert result.differences[0].detail.startswith("values differ (max abs difference ")


def test_full_files_compare_after_the_cast(ws3_ckpt: Sample, tmp_path: Path) -> None:
    pt, st = tmp_path / "fp32.pt", tmp_path / "bf16.safetensors"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, pt)
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, st, options=TransformOptions(dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in load_file(st).values() if t.is_floating_point())
    assert fsdp_convert.verify(pt, st, dtype="bf16").equal
    differs = fsdp_convert.verify(pt, st)
    assert differs.differences and all(d.detail == "dtype float32 != bfloat16" for d in differs.differences)


def test_an_upcast_export_equals_its_bf16_checkpoint(ws3_bf16_ckpt: Sample, tmp_path: Path) -> None:
    out = tmp_path / "fp32.pt"
    fsdp_convert.consolidate(ws3_bf16_ckpt.checkpoint, out, options=TransformOptions(dtype=torch.float32))
    assert not fsdp_convert.verify(ws3_bf16_ckpt.checkpoint, out).equal
    assert fsdp_convert.verify(ws3_bf16_ckpt.checkpoint, out, dtype=torch.float32).equal


def test_a_bad_dtype_is_refused(ws3_ckpt: Sample, bf16_export: Path) -> None:
    with pytest.raises(InvalidOptionError, match="'int8' is not a dtype"):
        fsdp_convert.verify(ws3_ckpt.checkpoint, bf16_export, dtype="int8")


def test_verify_cli_dtype(runner: CliRunner, ws3_ckpt: Sample, bf16_export: Path) -> None:
    args = ["verify", str(ws3_ckpt.checkpoint), str(bf16_export), "--json"]
    equal = runner.invoke(app, [*args, "--dtype", "bf16", "--optim-dtype", "bf16"])
    assert equal.exit_code == 0, (equal.stdout, equal.stderr)
    assert json.loads(equal.stdout)["equal"] is True
    differs = runner.invoke(app, args)
    assert differs.exit_code == 1
    assert json.loads(differs.stdout)["differences"][0]["detail"].startswith("dtype float32 != bfloat16")
