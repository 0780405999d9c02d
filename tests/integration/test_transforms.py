"""Key and dtype transforms of consolidate and reshard, on the 3-rank FSDP2 sample."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli.app import app
from fsdp_convert.transform import TransformOptions
from tests._compare import same_bits
from tests._samples import Sample


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
        assert same_bits(got["model"][renamed(k)], truth["model"][k].to(torch.bfloat16)), k
    # the optimizer keeps every parameter (filters are for model FQNs), renamed the same way
    assert list(got["optim"]["state"]) == [renamed(k) for k in truth["optim"]["state"]]
    assert got["optim"]["param_groups"][0]["params"] == [renamed(k) for k in truth["optim"]["param_groups"][0]["params"]]
    for k, state in truth["optim"]["state"].items():
        assert same_bits(got["optim"]["state"][renamed(k)]["step"], state["step"])  # step never changes
        for moment in ("exp_avg", "exp_avg_sq"):  # tok_embeddings' hold a NaN and a -0.0
            assert same_bits(got["optim"]["state"][renamed(k)][moment], state[moment].to(torch.float16)), (k, moment)
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
    assert same_bits(got["model"]["lm_head.weight"], truth["model"]["output.weight"].float())
    assert same_bits(got["model"]["tok_embeddings.weight"], truth["model"]["tok_embeddings.weight"].float())  # NaN, -0.0


def _custom_order_checkpoint(root: Path, optim_form: str) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    """One process, no FSDP: an AdamW whose params are listed out of model order, saved with DCP,
    its state as get_optimizer_state_dict gives it (``names``) or as optimizer.state_dict() (``ids``)."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW([model[1].weight, model[0].weight, model[1].bias, model[0].bias], lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    state = get_optimizer_state_dict(model, optim) if optim_form == "names" else optim.state_dict()
    ckpt = root / f"custom-{optim_form}"
    save({"model": model.state_dict(), "optim": state}, checkpoint_id=ckpt, no_dist=True)
    return ckpt, model, optim


@pytest.mark.parametrize("optim_form", ["names", "ids"])
def test_ids_follow_the_optimizers_own_order(tmp_path: Path, optim_form: str) -> None:
    """torch.optim numbers params in param-group order, whatever the model's order: an optimizer
    built the same way loads the re-keyed state with every moment on its own parameter. A DCP
    checkpoint of optimizer.state_dict() (ids saved as "0", "1"... keys) comes out the same."""
    ckpt, model, optim = _custom_order_checkpoint(tmp_path, optim_form)
    out = tmp_path / "plain.pt"
    fsdp_convert.consolidate(ckpt, out, options=TransformOptions(optim_keys="ids"))
    state = torch.load(out, weights_only=True)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fresh.load_state_dict(state["model"])
    again = torch.optim.AdamW([fresh[1].weight, fresh[0].weight, fresh[1].bias, fresh[0].bias])
    again.load_state_dict(state["optim"])
    for p_new, p_old in zip(again.param_groups[0]["params"], optim.param_groups[0]["params"], strict=True):
        assert torch.equal(again.state[p_new]["exp_avg"], optim.state[p_old]["exp_avg"])
    assert state["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3]

    # reshard keeps ids as dict keys: torch's own dcp_to_torch_save reads the state back as a dict
    # (keyed "0", "1"..., as for any DCP save of optimizer.state_dict()), not as a list
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    resharded, full = tmp_path / "ws2", tmp_path / "torch.pt"
    fsdp_convert.reshard(ckpt, resharded, world_size=2, options=TransformOptions(optim_keys="ids"))
    dcp_to_torch_save(resharded, full)
    assert sorted(torch.load(full, weights_only=True)["optim"]["state"]) == ["0", "1", "2", "3"]
    again_full = tmp_path / "again.pt"
    fsdp_convert.consolidate(resharded, again_full)
    assert again_full.read_bytes() == out.read_bytes()  # our reader turns them back into ids
