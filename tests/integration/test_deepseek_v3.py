"""--adapter on torchtitan's own DeepSeek-V3: to Hugging Face and back, bit for bit as torchtitan's own adapter.

The checkpoint is tests._deepseek's run (torchtitan 0.3.0's DeepSeek-V3 model code at a tiny size:
a dense layer, an MoE layer with 4 routed experts and a shared expert, low-rank Q, one MTP layer;
FSDP2 on 2 CPU ranks, 2 AdamW steps, ``dcp.save`` of ``get_model_state_dict``); its truth is the
model's full state dict, gathered. ``consolidate --adapter torchtitan-deepseek-v3-to-hf`` must be
exactly what torchtitan's ``DeepSeekV3StateDictAdapter.to_hf`` makes of it (every key, every
tensor), ``reshard --adapter hf-to-torchtitan-deepseek-v3`` of that folder exactly its ``from_hf``
(so the run's model again), and transformers' ``DeepseekV3ForCausalLM`` loads the folder with no
missing key (the MTP layer, HF layer 2, is the only thing it does not take). With the run's
routing in its ``config.json``, that folder gives the torchtitan model's logits in transformers,
and its ``reshard --world-size 3`` is what torchtitan's ``CheckpointManager`` loads at 3 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from typer.testing import CliRunner

from fsdp_convert.adapters.deepseek_v3 import from_hf, to_hf
from fsdp_convert.cli.app import app
from fsdp_convert.derive import TensorInfo
from fsdp_convert.errors import UnsupportedTransformError
from tests._deepseek import (
    DS_DIM,
    DS_EXPERTS,
    DS_HEADS,
    DS_LAYERS,
    DS_NORM_EPS,
    DS_SEQ,
    DS_VOCAB,
    HF_ROUTING,
    ds_build,
    ds_fp32_experts,
    ds_load,
    ds_model_config,
)
from tests._dist import run_ranks


def _hf_config() -> dict[str, Any]:
    """``DeepseekV3Config`` of the run's model (tests._deepseek.ds_model_config)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": DS_VOCAB,
        "hidden_size": DS_DIM,
        "intermediate_size": 24,
        "moe_intermediate_size": 16,
        "num_hidden_layers": DS_LAYERS,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": DS_HEADS,
        "num_key_value_heads": DS_HEADS,
        "n_shared_experts": 1,
        "n_routed_experts": DS_EXPERTS,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 8,
        "kv_lora_rank": 8,
        "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 4,
        "v_head_dim": 4,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def test_torchtitan_deepseek_v3_to_hf_and_back(ds_checkpoint: Path, tmp_path: Path, runner: CliRunner) -> None:
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
    from transformers import DeepseekV3ForCausalLM

    truth = torch.load(ds_checkpoint / "truth.pt", weights_only=True)
    assert any(k.startswith("mtp_layers.") for k in truth) and any("inner_experts" in k for k in truth)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_hf_config()))
    hf = tmp_path / "hf"
    adapter = ["--adapter", "torchtitan-deepseek-v3-to-hf", "--model-config", str(config), "--nproc", "2"]
    result = runner.invoke(app, ["consolidate", str(ds_checkpoint / "checkpoint"), str(hf), *adapter])
    assert result.exit_code == 0, result.output

    # bit for bit what torchtitan's own adapter makes of the run's model
    titan_adapter = DeepSeekV3StateDictAdapter(ds_model_config(), None)
    want = titan_adapter.to_hf(dict(truth))
    got = load_file(hf / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key

    # transformers' DeepseekV3 takes every weight it has from the folder; the MTP layer is extra to it
    (hf / "config.json").write_text(config.read_text())
    model, info = DeepseekV3ForCausalLM.from_pretrained(hf, torch_dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    assert info["unexpected_keys"] and all(k.startswith(f"model.layers.{DS_LAYERS}.") for k in info["unexpected_keys"])
    hf_state = model.state_dict()
    for key, tensor in hf_state.items():  # transformers 5 holds each layer's experts fused: (E, 2F, D) and (E, D, F)
        if key.endswith("experts.gate_up_proj"):
            gate, up = (torch.stack([got[f"{key[:-12]}{e}.{w}_proj.weight"] for e in range(DS_EXPERTS)]) for w in ("gate", "up"))
            assert torch.equal(tensor, torch.cat([gate, up], dim=1)), key
        elif key.endswith("experts.down_proj"):
            assert torch.equal(tensor, torch.stack([got[f"{key[:-9]}{e}.down_proj.weight"] for e in range(DS_EXPERTS)])), key
        else:
            assert torch.equal(tensor, got[key]), key

    # back to torchtitan at 2 ranks: exactly torchtitan's from_hf of that folder, the run's model
    titan = tmp_path / "titan"
    back = ["--adapter", "hf-to-torchtitan-deepseek-v3", "--model-config", str(config)]
    result = runner.invoke(app, ["reshard", str(hf), str(titan), "--world-size", "2", *back])
    assert result.exit_code == 0, result.output
    expected = titan_adapter.from_hf(dict(got))
    loaded = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=titan, no_dist=True)
    assert sorted(dcp.FileSystemReader(titan).read_metadata().state_dict_metadata) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor) and torch.equal(tensor, truth[key]), key


def test_deepseek_v3_adapters_refuse_unknown_keys() -> None:
    titan = [TensorInfo(fqn="layers.0.moe.tokens_per_expert", shape=(4,), dtype=torch.float32)]
    with pytest.raises(UnsupportedTransformError, match="layers.0.moe.tokens_per_expert"):
        to_hf(titan, {})
    hf = [TensorInfo(fqn="model.layers.0.self_attn.rotary_emb.inv_freq", shape=(2,), dtype=torch.float32)]
    with pytest.raises(UnsupportedTransformError, match="rotary_emb.inv_freq"):
        from_hf(hf, {})


def test_deepseek_v3_mtp_layer_numbers_without_config() -> None:
    """Without ``num_hidden_layers``, ``to_hf`` numbers the MTP layers after the model's own ``layers.N``."""

    def info(fqn: str) -> TensorInfo:
        return TensorInfo(fqn=fqn, shape=(4,), dtype=torch.float32)

    titan = [info(f"layers.{n}.attention_norm.weight") for n in range(3)] + [info("mtp_layers.0.enorm.weight")]
    assert sorted(to_hf(titan, {}))[-1] == "model.layers.3.enorm.weight"
    assert list(from_hf([info("model.layers.3.enorm.weight")], {"num_hidden_layers": 3})) == ["mtp_layers.0.enorm.weight"]


@pytest.fixture(scope="module")
def ds_hf(ds_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``consolidate --adapter torchtitan-deepseek-v3-to-hf`` of the run, with a ``config.json``
    that is the run's model in full: its routing (``HF_ROUTING``), norm eps and RoPE."""
    root = tmp_path_factory.mktemp("deepseek_v3_hf")
    config = {**_hf_config(), **HF_ROUTING, "rms_norm_eps": DS_NORM_EPS, "rope_interleave": True}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (root / "config.json").write_text(json.dumps(config))
    hf = root / "hf"
    adapter = ["--adapter", "torchtitan-deepseek-v3-to-hf", "--model-config", str(root / "config.json"), "--nproc", "2"]
    result = CliRunner().invoke(app, ["consolidate", str(ds_checkpoint / "checkpoint"), str(hf), *adapter])
    assert result.exit_code == 0, result.output
    (hf / "config.json").write_text((root / "config.json").read_text())
    return hf


def test_hf_deepseek_v3_reshard_loads_with_torchtitans_checkpoint_manager_at_three_ranks(
    ds_checkpoint: Path, ds_hf: Path, tmp_path: Path, runner: CliRunner
) -> None:
    """docs/huggingface.md: ``reshard --adapter hf-to-torchtitan-deepseek-v3 --world-size 3`` of the
    exported folder is what torchtitan starts from: its ``CheckpointManager``, as
    ``initial_load_path`` at 3 ranks, fills the FSDP2-sharded DeepSeek-V3 (4 experts over 3
    ranks: uneven) with the run's model bit for bit, experts, router bias and MTP layer included."""
    truth = torch.load(ds_checkpoint / "truth.pt", weights_only=True)
    assert any(torch.count_nonzero(v) for k, v in truth.items() if k.endswith("expert_bias_E"))
    out = tmp_path / "titan"
    back = ["--adapter", "hf-to-torchtitan-deepseek-v3", "--model-config", str(ds_hf / "config.json")]
    result = runner.invoke(app, ["reshard", str(ds_hf), str(out), "--world-size", "3", *back])
    assert result.exit_code == 0, result.output
    work = tmp_path / "load"
    work.mkdir()
    run_ranks(ds_load, 3, out, ds_checkpoint / "truth.pt", work)


FP32_ATOL = 1e-6
"""|HF - torchtitan| on the logits (~4 in size) with torchtitan's routed experts in fp32: the same
function in other op orders (HF's fused-expert loop, RoPE on even/odd slices, eager attention);
measured max 1.2e-7 over 5 batches."""
BF16_EXPERTS_ATOL = 1e-4
"""The same with torchtitan's experts as shipped, in bf16 (``ds_fp32_experts``): measured max 3.4e-5."""


def test_hf_deepseek_v3_export_gives_torchtitans_logits(ds_checkpoint: Path, ds_hf: Path) -> None:
    """docs/huggingface.md: transformers' ``DeepseekV3ForCausalLM.from_pretrained`` of the exported
    folder computes the torchtitan model's logits (its main head; HF has no MTP), routing
    included (sigmoid, the run's ``expert_bias_E`` as ``e_score_correction_bias``, top 2
    renormalised and scaled): within ``FP32_ATOL`` once torchtitan's experts run in fp32 as HF's
    do, within ``BF16_EXPERTS_ATOL`` with its bf16 experts."""
    from transformers import DeepseekV3ForCausalLM

    truth = torch.load(ds_checkpoint / "truth.pt", weights_only=True)
    titan = ds_build(seed=0)
    titan.load_state_dict(truth)
    hf = DeepseekV3ForCausalLM.from_pretrained(ds_hf, torch_dtype=torch.float32, attn_implementation="eager")
    tokens = torch.randint(0, DS_VOCAB, (3, DS_SEQ), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        got = hf.eval()(tokens).logits
        shipped = titan.eval()(tokens)[0]
        ds_fp32_experts(titan)
        want = titan(tokens)[0]
    assert got.shape == want.shape == (3, DS_SEQ, DS_VOCAB)
    torch.testing.assert_close(got, want, rtol=0, atol=FP32_ATOL)
    torch.testing.assert_close(got, shipped, rtol=0, atol=BF16_EXPERTS_ATOL)
