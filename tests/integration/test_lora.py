"""A PEFT LoRA trained with FSDP2: --merge-lora loads in plain transformers as merge_and_unload() does,
--lora-only loads with PeftModel.from_pretrained as the run's own save_pretrained does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from fsdp_convert.cli.app import app
from tests._dist import run_ranks
from tests._lora import ADAPTER, BASE, TRUTH, base_model, train_lora

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora")
    run_ranks(train_lora, 2, out)
    return out


def _truth(run: Path) -> dict[str, Any]:
    truth = torch.load(run / TRUTH, weights_only=True)
    torch.testing.assert_close(truth["peft_logits"], truth["logits"], rtol=0, atol=0)  # the unsharded copy is the run's
    return truth  # type: ignore[no-any-return]


def _consolidate(runner: CliRunner, run: Path, out: Path, *extra: str) -> None:
    result = runner.invoke(app, ["consolidate", str(run / "checkpoint"), str(out), "--nproc", "1", *extra])
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize("how", [["--lora-config", "CONFIG", "--hf-assets", "BASE"], ["--lora-alpha", "8", "--lora-r", "4"]])
def test_merge_lora_loads_in_plain_transformers_as_merge_and_unload(
    lora_run: Path, runner: CliRunner, tmp_path: Path, how: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    truth = _truth(lora_run)
    out = tmp_path / "merged"
    paths = {"CONFIG": str(lora_run / ADAPTER / "adapter_config.json"), "BASE": str(lora_run / BASE)}
    flags = [paths.get(f, f) for f in how]
    _consolidate(runner, lora_run, out, "--merge-lora", *flags)
    weights = load_file(out / "model.safetensors")
    assert set(weights) == set(truth["merged"])  # merge_and_unload's names: no base_layer, no lora_*, no PEFT prefix
    unequal = [k for k, v in truth["merged"].items() if not torch.equal(weights[k], v)]
    assert not unequal, unequal  # bit for bit: one row block per tensor here, the same B @ A call as PEFT's
    if "--hf-assets" not in how:  # else copied by --hf-assets, from the base model's save_pretrained
        shutil.copy(lora_run / BASE / "config.json", out / "config.json")
    model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=truth["input_ids"]).logits
    torch.testing.assert_close(logits, truth["merged_logits"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("how", [["--lora-config", "CONFIG"], ["--lora-alpha", "8"]])
def test_lora_only_loads_with_peft_from_pretrained(
    lora_run: Path, runner: CliRunner, tmp_path: Path, how: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    truth = _truth(lora_run)
    out = tmp_path / "adapter"
    flags = [str(lora_run / ADAPTER / "adapter_config.json") if f == "CONFIG" else f for f in how]
    _consolidate(runner, lora_run, out, "--lora-only", *flags)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    got, want = load_file(out / "adapter_model.safetensors"), load_file(lora_run / ADAPTER / "adapter_model.safetensors")
    assert set(got) == set(want)  # save_pretrained's names: base_model.model.<module>.lora_A.weight
    assert all(torch.equal(got[k], want[k]) for k in want)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    model = PeftModel.from_pretrained(base_model(), out)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=truth["input_ids"]).logits
    torch.testing.assert_close(logits, truth["peft_logits"], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--merge-lora"], 2, "--merge-lora needs the adapter's lora_alpha"),
        (["--merge-lora", "--lora-only", "--lora-alpha", "8"], 2, "exclude each other"),
        (["--lora-alpha", "8"], 2, "go with --merge-lora or --lora-only"),
        (["--merge-lora", "--lora-alpha", "8", "--lora-r", "8"], 1, "q_proj.lora_A.default.weight: rank 4, but"),
        (["--merge-lora", "--lora-alpha", "8", "--verify"], 2, "--verify does not recompute computed tensors"),
    ],
)
def test_lora_usage_errors(lora_run: Path, runner: CliRunner, tmp_path: Path, args: list[str], code: int, message: str) -> None:
    result = runner.invoke(app, ["consolidate", str(lora_run / "checkpoint"), str(tmp_path / "out"), "--nproc", "1", *args])
    assert result.exit_code == code, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "out").exists()


def test_lora_only_needs_a_folder(lora_run: Path, runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "adapter.safetensors"
    result = runner.invoke(app, ["consolidate", str(lora_run / "checkpoint"), str(out), "--lora-only", "--lora-alpha", "8"])
    assert result.exit_code == 2, result.stderr
    assert "--lora-only writes a PEFT adapter folder" in result.stderr


def test_merge_lora_computes_in_fp32_then_casts(lora_run: Path, runner: CliRunner, tmp_path: Path) -> None:
    """With --dtype bf16 each merged weight is merge_and_unload's float32 result cast once, not B @ A in bf16."""
    from safetensors.torch import load_file

    truth = _truth(lora_run)
    out = tmp_path / "merged-bf16"
    _consolidate(runner, lora_run, out, "--merge-lora", "--lora-alpha", "8", "--dtype", "bf16")
    weights = load_file(out / "model.safetensors")
    assert all(torch.equal(weights[k], v.bfloat16()) for k, v in truth["merged"].items())
