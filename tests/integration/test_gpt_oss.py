"""--adapter on torchtitan's own gpt-oss: to Hugging Face names and back, bit for bit as torchtitan's own adapter.

The checkpoint is tests._gpt_oss's (torchtitan 0.3.0's gpt-oss model code at a tiny size: 2
layers of biased Q/K/V/O with sinks and a 4-expert MoE with biases; FSDP2 on 2 CPU ranks,
``dcp.save`` of ``get_model_state_dict``, untrained: no CPU backward for its attention); its truth is
the model's full state dict, gathered. ``consolidate --adapter torchtitan-gpt-oss-to-hf`` must be
exactly what torchtitan's ``GptOssStateDictAdapter.to_hf`` makes of it, the experts included
(torchtitan's map spells them without the model's ``_EGD``-style suffixes, so its ``to_hf`` of the
model's own names drops them); ``reshard --adapter hf-to-torchtitan-gpt-oss`` of that folder
exactly its ``from_hf``, so the run's model again. transformers' ``GptOssForCausalLM`` loads every
weight but the expert matrices from the folder: torchtitan writes those in the MXFP4 checkpoint's
``(out, in)`` layout under its ``*_blocks`` names, transformers wants ``(in, out)`` ``gate_up_proj``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from typer.testing import CliRunner

from fsdp_convert.adapters.gpt_oss import from_hf, to_hf
from fsdp_convert.cli.app import app
from fsdp_convert.derive import TensorInfo
from fsdp_convert.errors import UnsupportedTransformError
from tests._dist import run_ranks
from tests._frameworks import preload
from tests._gpt_oss import (
    GO_DIM,
    GO_EXPERTS,
    GO_HEAD_DIM,
    GO_HEADS,
    GO_HIDDEN,
    GO_KV_HEADS,
    GO_LAYERS,
    GO_VOCAB,
    go_model_config,
    go_run,
)

_SUFFIXES = {
    "mlp1_weight_EGD": "mlp1_weight",
    "mlp1_bias_EG": "mlp1_bias",
    "mlp2_weight_EDF": "mlp2_weight",
    "mlp2_bias_ED": "mlp2_bias",
}


@pytest.fixture(scope="module")
def go_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny gpt-oss: ``checkpoint/`` (DCP, 2 ranks) and ``truth.pt``."""
    preload("torchtitan")
    out = tmp_path_factory.mktemp("gpt_oss")
    run_ranks(go_run, 2, out)
    return out


def _hf_config() -> dict[str, Any]:
    """``GptOssConfig`` of the run's model (tests._gpt_oss.go_model_config)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": GO_VOCAB,
        "hidden_size": GO_DIM,
        "intermediate_size": GO_HIDDEN,
        "num_hidden_layers": GO_LAYERS,
        "num_attention_heads": GO_HEADS,
        "num_key_value_heads": GO_KV_HEADS,
        "head_dim": GO_HEAD_DIM,
        "num_local_experts": GO_EXPERTS,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _titan_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state dict with its experts under the names torchtitan's adapter map spells."""
    out = {}
    for key, tensor in state.items():
        head, _, last = key.rpartition(".")
        out[f"{head}.{_SUFFIXES.get(last, last)}"] = tensor
    return out


def test_torchtitan_gpt_oss_to_hf_and_back(
    go_checkpoint: Path, tmp_path: Path, runner: CliRunner, caplog: pytest.LogCaptureFixture
) -> None:
    from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
    from transformers import GptOssForCausalLM

    truth = torch.load(go_checkpoint / "truth.pt", weights_only=True)
    assert any(k.endswith("mlp1_weight_EGD") for k in truth) and any(k.endswith("attention.sinks") for k in truth)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_hf_config()))
    hf = tmp_path / "hf"
    adapter = ["--adapter", "torchtitan-gpt-oss-to-hf", "--nproc", "2"]
    with caplog.at_level(logging.WARNING):
        result = runner.invoke(app, ["consolidate", str(go_checkpoint / "checkpoint"), str(hf), *adapter])
    assert result.exit_code == 0, result.output
    assert "layers.1.moe.expert_bias_E" in caplog.text  # the one buffer with no HF name, left out aloud

    # bit for bit what torchtitan's own adapter makes of the run's model, the experts under its map's names
    titan_adapter = GptOssStateDictAdapter(go_model_config(), None)
    want = titan_adapter.to_hf(_titan_names(truth))
    assert len(titan_adapter.to_hf(dict(truth))) == len(want) - 4 * GO_LAYERS  # its map misses the model's expert names
    got = load_file(hf / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key

    # transformers' GptOss takes every weight but the (in, out) expert matrices, which torchtitan writes as *_blocks
    (hf / "config.json").write_text(config.read_text())
    model, info = GptOssForCausalLM.from_pretrained(hf, dtype=torch.float32, output_loading_info=True)
    layers = range(GO_LAYERS)
    assert sorted(info["missing_keys"]) == sorted(
        f"model.layers.{n}.mlp.experts.{w}" for n in layers for w in ("down_proj", "gate_up_proj")
    )
    assert sorted(info["unexpected_keys"]) == sorted(f"{k}_blocks" for k in info["missing_keys"])
    for key, tensor in model.state_dict().items():
        if key not in info["missing_keys"]:
            assert torch.equal(tensor, got[key]), key

    # back to torchtitan at 2 ranks: exactly torchtitan's from_hf of that folder under the model's names, the run's model
    titan = tmp_path / "titan"
    result = runner.invoke(app, ["reshard", str(hf), str(titan), "--world-size", "2", "--adapter", "hf-to-torchtitan-gpt-oss"])
    assert result.exit_code == 0, result.output
    expected = {k: v for k, v in truth.items() if not k.endswith("expert_bias_E")}
    assert _titan_names(expected).keys() == titan_adapter.from_hf(dict(got)).keys()
    loaded = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=titan, no_dist=True)
    assert sorted(dcp.FileSystemReader(titan).read_metadata().state_dict_metadata) == sorted(expected)
    titan_from_hf = titan_adapter.from_hf(dict(got))
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor) and torch.equal(
            titan_from_hf[_titan_names({key: tensor}).popitem()[0]], tensor
        ), key


def test_gpt_oss_adapters_refuse_unknown_keys() -> None:
    def info(fqn: str) -> TensorInfo:
        return TensorInfo(fqn=fqn, shape=(4,), dtype=torch.float32)

    with pytest.raises(UnsupportedTransformError, match="layers.0.moe.tokens_per_expert_E"):
        to_hf([info("layers.0.moe.tokens_per_expert_E")], {})
    with pytest.raises(UnsupportedTransformError, match="gate_up_proj_scales: .*MXFP4"):
        from_hf([info("model.layers.0.mlp.experts.gate_up_proj_scales")], {})
    with pytest.raises(UnsupportedTransformError, match="experts.down_proj: .*transposed"):
        from_hf([info("model.layers.0.mlp.experts.down_proj")], {})


def test_gpt_oss_to_hf_reads_the_expert_names_torchtitans_map_spells() -> None:
    """Checkpoints of torchtitan's gpt-oss before the ``_EGD``-style suffixes: the names its adapter's map still spells."""
    titan = [
        TensorInfo(fqn=f"layers.3.moe.routed_experts.inner_experts.{name}", shape=(4,), dtype=torch.float32)
        for name in _SUFFIXES.values()
    ]
    got = to_hf(titan, {})
    assert sorted(got) == sorted(
        f"model.layers.3.mlp.experts.{w}"
        for w in ("gate_up_proj_blocks", "gate_up_proj_bias", "down_proj_blocks", "down_proj_bias")
    )
    assert all(got[k].inputs[0].fqn == t.fqn for k, t in zip(got, titan, strict=True))
