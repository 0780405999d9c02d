"""Every producer's layout consolidates to its own run's ground truth, and the result loads anywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert._sample import Transformer
from fsdp_convert.cli.app import app
from fsdp_convert.transform import TransformOptions
from tests._compare import assert_same_state
from tests._producers import CFG, TRUTH, train_step

# (fixture, checkpoint path inside it, truth.pt inside it, producer inspect names, other top-level keys)
PRODUCERS = {
    "torchtitan": ("fsdp2_layouts", "torchtitan/step-2", TRUTH, "torchtitan", {"lr_scheduler", "train_state", "dataloader"}),
    "accelerate": ("fsdp2_layouts", "accelerate", TRUTH, "accelerate", set()),
    "lightning": ("fsdp2_layouts", "lightning", TRUTH, "lightning", set()),
    "fsdp2-wrapper-names": ("fsdp2_layouts", "wrapped", TRUTH, "fsdp2", set()),
    "fsdp1-orig-params": ("fsdp1_layouts", "orig_params_true/checkpoint", "orig_params_true/truth.pt", "fsdp1", set()),
    "fsdp1-flat-params": ("fsdp1_layouts", "orig_params_false/checkpoint", "orig_params_false/truth.pt", "fsdp1", set()),
}


def _layout(request: pytest.FixtureRequest, name: str) -> tuple[Path, dict[str, Any], str, set[str]]:
    fixture, ckpt, truth, producer, others = PRODUCERS[name]
    root: Path = request.getfixturevalue(fixture)
    return root / ckpt, torch.load(root / truth, weights_only=True), producer, others


@pytest.mark.parametrize("name", sorted(PRODUCERS))
def test_each_producer_consolidates_to_its_ground_truth(request: pytest.FixtureRequest, name: str, tmp_path: Path) -> None:
    """Bitwise equal to get_model_state_dict/get_optimizer_state_dict(full_state_dict=True) of the
    same run, after the documented cleaning: wrapper names removed, ``optimizer`` as ``optim``,
    torchtitan's flattened optimizer state nested again with its param groups rebuilt."""
    ckpt, truth, producer, others = _layout(request, name)
    info = fsdp_convert.inspect_checkpoint(ckpt)
    assert info.producer == producer and info.world_size == 2
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(ckpt, out, nproc=1, verify_output=True)
    got = torch.load(out, weights_only=True)
    assert set(got) == {"model", "optim"} | others
    assert assert_same_state({"model": got["model"], "optim": got["optim"]}, {"model": truth["model"], "optim": truth["optim"]}) > 100
    assert list(got["model"]) == list(truth["model"])


def test_wrapper_names_are_removed_unless_kept(fsdp2_layouts: Path, tmp_path: Path) -> None:
    ckpt = fsdp2_layouts / "wrapped"
    assert all(e.fqn.startswith("model._orig_mod.") for e in fsdp_convert.inspect_checkpoint(ckpt).entries if e.group == "model")
    kept = tmp_path / "kept.pt"
    fsdp_convert.consolidate(ckpt, kept, only="model", options=TransformOptions(keep_wrapper_names=True))
    keys = list(torch.load(kept, weights_only=True)["model"])
    assert "_orig_mod.layers.0.mlp.0.weight" in keys and "layers.0.mlp.0.weight" not in keys


def _plain_step(model_state: dict[str, Any], optim_state: dict[str, Any], batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """The usual single-process resume: build, load_state_dict both, one step; the new parameters."""
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    model = Transformer(CFG)
    model.load_state_dict(model_state)
    optim = torch.optim.AdamW(model.parameters())
    optim.load_state_dict(optim_state)
    train_step(model, optim, batch, CFG.vocab_size)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["torchtitan", "accelerate", "fsdp2-wrapper-names"])
def test_resume_on_one_process_matches_the_fsdp_next_step(
    request: pytest.FixtureRequest, runner: CliRunner, name: str, tmp_path: Path
) -> None:
    """--optim-keys ids gives what torch.optim.Optimizer.state_dict() gives: a plain AdamW over a
    plain model loads it, and one step lands where the FSDP2 run's next step did (rel 1e-6)."""
    ckpt, truth, _, _ = _layout(request, name)
    out = tmp_path / "plain.pt"
    result = runner.invoke(app, ["consolidate", str(ckpt), str(out), "--optim-keys", "ids", "--nproc", "1"])
    assert result.exit_code == 0, result.stderr
    state = torch.load(out, weights_only=True)
    assert sorted(state["optim"]["state"]) == list(range(len(truth["model"])))
    assert state["optim"]["param_groups"][0]["params"] == list(range(len(truth["model"])))
    stepped = _plain_step(state["model"], state["optim"], truth["batch"])
    for fqn, want in truth["next_model"].items():
        torch.testing.assert_close(stepped[fqn], want, rtol=1e-6, atol=1e-7, msg=fqn)
    # and the step moved the weights: a stale optimizer state would not land there
    assert not torch.equal(stepped["output.weight"], truth["model"]["output.weight"])


def test_ids_follow_model_order_for_fsdp1_flat_params(fsdp1_layouts: Path, tmp_path: Path) -> None:
    """FSDP1 with use_orig_params=False lists params in flat-parameter order; ids must follow the
    model's own parameter order, or load_state_dict would pair states with the wrong parameters."""
    out = tmp_path / "plain.pt"
    fsdp_convert.consolidate(fsdp1_layouts / "orig_params_false/checkpoint", out, options=TransformOptions(optim_keys="ids"))
    truth = torch.load(fsdp1_layouts / "orig_params_false/truth.pt", weights_only=True)
    state = torch.load(out, weights_only=True)
    torch.manual_seed(0)
    model = Transformer(CFG)
    model.load_state_dict(state["model"])
    optim = torch.optim.AdamW(model.parameters())
    optim.load_state_dict(state["optim"])
    for name, param in model.named_parameters():
        assert torch.equal(optim.state[param]["exp_avg"], truth["optim"]["state"][name]["exp_avg"]), name


def test_parent_folder_errors_name_the_folder_to_pass(runner: CliRunner, fsdp2_layouts: Path, tmp_path: Path) -> None:
    parent = fsdp2_layouts / "torchtitan"
    result = runner.invoke(app, ["consolidate", str(parent), str(tmp_path / "x.pt")])
    assert result.exit_code == 3
    assert result.stderr.strip() == f"error: {parent} has no .metadata, but {parent / 'step-2'} has: pass that folder"
    assert not (tmp_path / "x.pt").exists()


def test_reshard_keeps_the_producer_layout(fsdp2_layouts: Path, tmp_path: Path) -> None:
    """A torchtitan checkpoint resharded to 3 keeps weights at the top level and the flattened
    optimizer state, so torchtitan's own loader reads it; consolidating it gives the same state."""
    ckpt = fsdp2_layouts / "torchtitan/step-2"
    out = tmp_path / "ws3"
    fsdp_convert.reshard(ckpt, out, world_size=3)
    keys = {e.fqn for e in fsdp_convert.inspect_checkpoint(out).entries}
    assert keys == {e.fqn for e in fsdp_convert.inspect_checkpoint(ckpt).entries}
    assert fsdp_convert.inspect_checkpoint(out).world_size == 3
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    fsdp_convert.consolidate(ckpt, a)
    fsdp_convert.consolidate(out, b)
    assert a.read_bytes() == b.read_bytes()
