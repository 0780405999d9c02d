"""adapters/torchtune.py: ``torchtune-llama-to-hf``'s key map, its Q/K rows and what it refuses, on tensor infos alone.

Bit-for-bit equality with torchtune's own ``tune_to_hf`` on a trained model is
``tests/integration/test_torchtune.py``.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_convert.adapters import load_adapter
from fsdp_convert.derive import HeadPermute, TensorInfo
from fsdp_convert.errors import InvalidOptionError, UnsupportedTransformError

F32 = torch.float32
CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2}


def _info(fqn: str, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo(fqn, F32, shape)


def test_keys_map_as_tune_to_hf_and_only_q_and_k_rows_move() -> None:
    infos = [
        _info("tok_embeddings.weight", (64, 32)),
        _info("layers.11.attn.q_proj.weight", (32, 32)),
        _info("layers.11.attn.k_proj.weight", (16, 32)),
        _info("layers.11.sa_norm.scale", (32,)),
        _info("norm.scale", (32,)),
        _info("output.weight", (64, 32)),
    ]
    rules = load_adapter("torchtune-llama-to-hf", CONFIG)(infos)
    assert list(rules) == [
        "model.embed_tokens.weight",
        "model.layers.11.self_attn.q_proj.weight",
        "model.layers.11.self_attn.k_proj.weight",
        "model.layers.11.input_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    rows = {fqn: rule.inputs[0].rows for fqn, rule in rules.items()}
    assert rows["model.layers.11.self_attn.q_proj.weight"] == HeadPermute(4, 8, to_hf=True)
    assert rows["model.layers.11.self_attn.k_proj.weight"] == HeadPermute(2, 8, to_hf=True)
    assert [fqn for fqn, rule in rules.items() if not rule.is_copy] == [
        "model.layers.11.self_attn.q_proj.weight",
        "model.layers.11.self_attn.k_proj.weight",
    ]


def test_a_key_tune_to_hf_does_not_map_is_refused_by_name() -> None:
    lora = _info("layers.0.attn.q_proj.lora_a.weight", (8, 32))
    with pytest.raises(UnsupportedTransformError, match=r"layers\.0\.attn\.q_proj\.lora_a\.weight: not a Llama weight"):
        load_adapter("torchtune-llama-to-hf", CONFIG)([lora])


def test_torchtunes_own_head_names_work_and_a_missing_head_count_is_asked_for() -> None:
    q = _info("layers.0.attn.q_proj.weight", (32, 32))
    rules = load_adapter("torchtune-llama-to-hf", {"num_heads": 4})([q])
    assert rules["model.layers.0.self_attn.q_proj.weight"].inputs[0].rows == HeadPermute(4, 8, to_hf=True)
    with pytest.raises(InvalidOptionError, match="num_attention_heads"):
        load_adapter("torchtune-llama-to-hf", {})([q])
