"""A consolidated FSDP2 checkpoint of a Hugging Face model loads with ``from_pretrained``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fsdp_convert.cli.app import app
from tests._dist import run_ranks
from tests._hf import EVAL, train_llama


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama")
    run_ranks(train_llama, 2, out)
    return out


def _logits(folder: Path, eval_path: Path) -> tuple[torch.Tensor, torch.Tensor, dict[str, list[str]]]:
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    model.eval()
    want = torch.load(eval_path, weights_only=True)
    with torch.no_grad():
        got = model(input_ids=want["input_ids"]).logits
    return got, want["logits"], info


@pytest.mark.parametrize(("tie", "extra"), [("untied", []), ("tied", []), ("tied", ["--exclude", "lm_head.weight"])])
def test_from_pretrained_gives_the_trained_logits(
    llama_runs: Path, runner: CliRunner, tmp_path: Path, tie: str, extra: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = llama_runs / tie
    out = tmp_path / "hf"
    args = [
        "consolidate",
        str(run / "checkpoint"),
        str(out),
        "--format",
        "safetensors",
        "--max-shard-size",
        "20KB",
        "--only",
        "model",
    ]
    result = runner.invoke(app, args + extra)
    assert result.exit_code == 0, result.stderr
    shutil.copy(run / "config.json", out / "config.json")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert ("lm_head.weight" in index["weight_map"]) == (not extra)
    got, want, info = _logits(out, run / EVAL)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert torch.equal(got, want)


def test_folder_with_optimizer_state_resumes_in_plain_torch(llama_runs: Path, runner: CliRunner, tmp_path: Path) -> None:
    """With --only all the optimizer state goes beside the shards as optimizer.pt, keyed by id so
    the Trainer's ``optimizer.load_state_dict(torch.load(optimizer.pt))`` takes it."""
    from transformers import LlamaForCausalLM

    run = llama_runs / "untied"
    out = tmp_path / "hf"
    result = runner.invoke(app, ["consolidate", str(run / "checkpoint"), str(out), "--optim-keys", "ids"])
    assert result.exit_code == 0, result.stderr
    shutil.copy(run / "config.json", out / "config.json")
    model = LlamaForCausalLM.from_pretrained(out)
    optim = torch.optim.AdamW(model.parameters())
    optim.load_state_dict(torch.load(out / "optimizer.pt", weights_only=True))
    assert len(optim.state) == len(list(model.parameters()))
    assert all(float(state["step"]) == 2.0 for state in optim.state.values())
