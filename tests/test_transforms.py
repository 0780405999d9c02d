"""Key and dtype transforms of consolidate and reshard, on the 3-rank FSDP2 sample."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli.app import app
from fsdp_convert.transform import clean_fqn
from tests.conftest import Sample


def test_rename_filter_and_cast_apply_to_model_and_optimizer(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    out = tmp_path / "t.pt"
    args = ["consolidate", str(ws3_ckpt.checkpoint), str(out), "--nproc", "1"]
    args += ["--rename", r"^layers\.(\d+)\.=blocks.\1.", "--rename", "attn=attention"]
    args += ["--include", "layers.*", "--include", "norm.*", "--exclude", "*.bias"]
    args += ["--dtype", "bf16", "--optim-dtype", "fp16"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    got, truth = torch.load(out, weights_only=True), ws3_ckpt.truth()

    def renamed(fqn: str) -> str:
        import re

        return re.sub(r"^layers\.(\d+)\.", r"blocks.\1.", fqn).replace("attn", "attention")

    kept = [k for k in truth["model"] if (k.startswith(("layers.", "norm."))) and not k.endswith(".bias")]
    assert list(got["model"]) == [renamed(k) for k in kept]
    for k in kept:
        assert got["model"][renamed(k)].dtype == torch.bfloat16
        assert torch.equal(got["model"][renamed(k)], truth["model"][k].to(torch.bfloat16)), k
    # the optimizer keeps every parameter (filters are for model FQNs), renamed the same way
    assert list(got["optim"]["state"]) == [renamed(k) for k in truth["optim"]["state"]]
    assert got["optim"]["param_groups"][0]["params"] == [renamed(k) for k in truth["optim"]["param_groups"][0]["params"]]
    for k, state in truth["optim"]["state"].items():
        assert got["optim"]["state"][renamed(k)]["step"].dtype == torch.float32  # step never changes
        assert torch.equal(got["optim"]["state"][renamed(k)]["step"], state["step"])
        assert torch.equal(got["optim"]["state"][renamed(k)]["exp_avg"], state["exp_avg"].to(torch.float16))
    assert got["train_state"] == truth["train_state"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            ["--rename", r"^layers\.\d+\.=layer."],
            "model.layers.0.attn_norm.weight and model.layers.1.attn_norm.weight would both",
        ),
        (["--rename", "(unclosed=x"], "bad regex"),
        (["--rename", "no-equals-sign"], "expected REGEX=REPLACEMENT"),
        (["--dtype", "fp8"], "'fp8' is not a dtype"),
        (["--optim-keys", "numbers"], "use names or ids"),
        (["--include", "nothing.matches"], "nothing to write"),
    ],
)
def test_bad_transforms_are_usage_errors(
    runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path, extra: list[str], needle: str
) -> None:
    out = tmp_path / "t.pt"
    result = runner.invoke(app, ["consolidate", str(ws3_ckpt.checkpoint), str(out), "--only", "model", *extra])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_reshard_casts_and_renames(ws3_bf16_ckpt: Sample, tmp_path: Path) -> None:
    """reshard --dtype fp32 --rename: the new DCP checkpoint says so in .metadata, and its data agrees."""
    from fsdp_convert.transform import TransformOptions

    out = tmp_path / "ws2"
    options = TransformOptions(dtype=torch.float32, renames=((r"^output\.", "lm_head."),))
    fsdp_convert.reshard(ws3_bf16_ckpt.checkpoint, out, world_size=2, options=options)
    entries = {e.fqn: e for e in fsdp_convert.inspect_checkpoint(out).entries}
    assert entries["model.lm_head.weight"].dtype == "float32" and "model.output.weight" not in entries
    assert entries["optim.state.lm_head.weight.exp_avg"].dtype == "bfloat16"  # optimizer state keeps its dtype
    full = tmp_path / "full.pt"
    fsdp_convert.consolidate(out, full)
    got, truth = torch.load(full, weights_only=True), ws3_bf16_ckpt.truth()
    assert torch.equal(got["model"]["lm_head.weight"], truth["model"]["output.weight"].float())


@pytest.mark.parametrize(
    ("fqn", "clean"),
    [
        ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.attn.wq.weight", "layers.0.attn.wq.weight"),
        ("layers.0._checkpoint_wrapped_module.mlp.0.weight", "layers.0.mlp.0.weight"),
        ("_orig_mod.output.weight", "output.weight"),
        ("module._orig_mod.output.weight", "output.weight"),
        ("encoder.module.weight", "encoder.module.weight"),  # only a leading module. is DDP's
        ("module", "module"),
    ],
)
def test_clean_fqn(fqn: str, clean: str) -> None:
    assert clean_fqn(fqn) == clean
    assert clean_fqn(fqn, keep_wrapper_names=True) == fqn
