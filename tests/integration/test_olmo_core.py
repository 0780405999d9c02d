"""OLMo-core 3.0.0's own checkpoints: named, consolidated as its ``unshard_checkpoint``, resharded for its loaders, to HF.

One module-scoped run (``tests._olmo.olmo_run``: OLMo-core's Trainer, TransformerTrainModule (FSDP2)
and Checkpointer on 2 forked gloo ranks) feeds every test; its ground truth is the full state taken
in the same run. The 3-rank load is OLMo-core's own ``Checkpointer.load`` and
``load_model_and_optim_state`` (``tests._olmo.olmo_load``); the HF export is checked against
OLMo-core's ``convert_state_to_hf`` bit for bit and against the trained model's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli.app import app
from tests import _olmo
from tests._compare import assert_same_state
from tests._dist import run_ranks

TARGET = 3  # the run saved at 2


@pytest.fixture(scope="module")
def olmo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OLMo-core's step folder at ``olmo/step2`` and the run's ``olmo/truth.pt`` (see tests/_olmo.py)."""
    _olmo.preload()
    out = tmp_path_factory.mktemp("olmo_run")
    run_ranks(_olmo.olmo_run, 2, out, timeout=300)
    return out


def _n_tensors(state: dict[str, object]) -> int:
    return sum(1 for v in state.values() if isinstance(v, torch.Tensor))


def test_olmo_core_step_folder_is_named_and_consolidates_as_its_unshard_checkpoint(
    olmo_run: Path, runner: CliRunner, tmp_path: Path
) -> None:
    """``inspect`` names ``olmo-core`` for the step folder and its ``model_and_optim/`` (and answers the save
    folder with the step folders to pass); ``consolidate``
    of the step folder is the run's full state dict bit for bit, its ``model`` and ``optim`` exactly
    OLMo-core's own ``unshard_checkpoint``'s ``model.pt`` and ``optim.pt`` (the optimizer flattened as
    saved); ``--layout nested`` rebuilds ``{"state", "param_groups"}`` as ``get_optimizer_state_dict`` gives them."""
    from olmo_core.distributed.checkpoint import unshard_checkpoint

    step = olmo_run / _olmo.CKPT
    truth = torch.load(olmo_run / _olmo.TRUTH, weights_only=True)
    for path in (step, step / "model_and_optim"):
        result = runner.invoke(app, ["inspect", str(path), "--json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert (doc["producer"], doc["world_size"]) == ("olmo-core", 2), doc
    result = runner.invoke(app, ["inspect", str(step.parent)])  # the run's save folder: one step folder, please
    assert result.exit_code == 3 and "it holds 2 checkpoints (step0, step2): pass one" in result.stderr, result.output

    full = tmp_path / "full.pt"
    result = runner.invoke(app, ["consolidate", str(step), str(full), "--verify"])
    assert result.exit_code == 0, result.output
    ours = torch.load(full, weights_only=True)
    want = {"model": truth["model"], "optim": truth["optim"]}
    assert any(k.startswith("param_groups.") for k in want["optim"])  # flattened, as OLMo-core saved it
    assert assert_same_state(ours, want) == _n_tensors(want["model"]) + _n_tensors(want["optim"])

    model_pt, optim_pt = unshard_checkpoint(step / "model_and_optim", tmp_path / "unsharded", optim=True)
    assert_same_state(ours["model"], torch.load(model_pt, weights_only=True))
    assert_same_state(ours["optim"], torch.load(optim_pt, weights_only=True))

    nested = tmp_path / "nested.pt"
    result = runner.invoke(app, ["consolidate", str(step), str(nested), "--layout", "nested"])
    assert result.exit_code == 0, result.output
    assert assert_same_state(torch.load(nested, weights_only=True), {"model": truth["model"], "optim": truth["optim_nested"]})


def test_olmo_core_reshard_loads_with_its_checkpointer_at_three_ranks(olmo_run: Path, tmp_path: Path) -> None:
    """``reshard`` of the step folder writes a step folder for 3 ranks: ``model_and_optim/`` laid out
    for 3, ``config.json`` copied byte for byte, ``train/`` (per-rank trainer state) left out with a
    note; OLMo-core's own ``Checkpointer.load`` and ``load_model_and_optim_state`` at 3 ranks then
    hold the run's model and optimizer state, bit for bit."""
    step = olmo_run / _olmo.CKPT
    out = tmp_path / f"step{_olmo.STEPS}"
    result = fsdp_convert.reshard(step, out, world_size=TARGET)
    assert result.folders == ("model_and_optim",)
    assert result.copied == (".metadata.json", "config.json")
    assert (out / "config.json").read_bytes() == (step / "config.json").read_bytes()
    assert result.left_out == ("train",) and result.notes[0].startswith("left out train: OLMo-core's per-rank trainer state")
    assert sorted(p.name for p in (out / "model_and_optim").iterdir()) == [
        ".metadata",
        *(f"__{r}_0.distcp" for r in range(TARGET)),
    ]
    info = fsdp_convert.inspect_checkpoint(out)
    assert (info.producer, info.world_size) == ("olmo-core", TARGET)

    _olmo.preload()
    work = tmp_path / "work"
    work.mkdir()
    run_ranks(_olmo.olmo_load, TARGET, out, olmo_run / _olmo.TRUTH, work, timeout=300)


def test_olmo_core_to_hf_is_its_convert_state_to_hf_and_gives_the_models_logits(
    olmo_run: Path, runner: CliRunner, tmp_path: Path
) -> None:
    """``--adapter olmo-core-to-hf`` writes exactly what OLMo-core's ``convert_state_to_hf`` makes of the
    run's model, and transformers' ``Olmo2ForCausalLM`` loaded from it computes the trained OLMo-core
    model's logits on the same tokens."""
    from olmo_core.nn.hf.convert import convert_state_to_hf
    from transformers import Olmo2Config, Olmo2ForCausalLM

    truth = torch.load(olmo_run / _olmo.TRUTH, weights_only=True)
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(_olmo.hf_config()))
    hf = tmp_path / "hf"
    args = ["consolidate", str(olmo_run / _olmo.CKPT), str(hf), "--adapter", "olmo-core-to-hf", "--hf-assets", str(assets)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output

    want = convert_state_to_hf(Olmo2Config(**_olmo.hf_config()), dict(truth["model"]))
    got = load_file(hf / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key

    tokens = truth["batch"]
    # SDPA, as OLMo-core's attention on CPU: equal to the bit here (0.0; eager attention: 1.6e-7 of 0.38)
    model = Olmo2ForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="sdpa").eval()
    olmo = _olmo.model_config().build(init_device="cpu")
    olmo.load_state_dict(truth["model"])
    olmo.eval()
    with torch.no_grad():
        logits, expected = model(tokens).logits, olmo(tokens)
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0)


def test_olmo_core_to_hf_refuses_a_tensor_its_map_does_not_know(olmo_run: Path, runner: CliRunner, tmp_path: Path) -> None:
    """A key OLMo-core's converter does not map (here the model renamed) is refused in one line naming it, as its
    ``StateConverter`` refuses it ("Some state keys were not converted")."""
    args = ["consolidate", str(olmo_run / _olmo.CKPT), str(tmp_path / "hf.safetensors"), "--adapter", "olmo-core-to-hf"]
    result = runner.invoke(app, [*args, "--rename", r"^embeddings\.weight$=tok.weight"])
    assert result.exit_code == 1, result.output
    assert "tok.weight: not an OLMo-2/3 weight OLMo-core's convert_state_to_hf maps" in result.stderr
    assert "Traceback" not in result.stderr
