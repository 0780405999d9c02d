"""torchtitan's DeepSeek-V3 and Hugging Face's ``DeepseekV3ForCausalLM``: key map, expert layout and MTP layers, both ways.

Follows torchtitan 0.3.0's ``torchtitan/models/deepseek_v3/state_dict_adapter.py``
(``DeepSeekV3StateDictAdapter.to_hf`` / ``from_hf``, offline path, unquantized): its
``from_hf_map`` with both query forms (low-rank ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``
and plain ``q_proj``; a model has one of them), MLA's ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` /
``kv_b_proj``, shared experts, the router's ``e_score_correction_bias``, each stacked
``(num_experts, ...)`` routed-expert weight split into one HF tensor per expert and stacked back,
and the multi-token-prediction layers: torchtitan's ``mtp_layers.I`` is HF's layer
``num_hidden_layers + I``. Like torchtitan's, both directions refuse a key the map does not know.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_convert.adapters._common import abstract_key, config_int, moved, split_experts, stack_experts
from fsdp_convert.derive import Derived, TensorInfo
from fsdp_convert.errors import UnsupportedTransformError

__all__ = ["FROM_HF", "to_hf", "from_hf"]

# torchtitan 0.3.0 DeepSeekV3StateDictAdapter.from_hf_map, both q_lora_rank forms (HF key -> torchtitan key)
FROM_HF: dict[str, str] = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.q_a_proj.weight": "layers.{}.attention.wq_a.weight",
    "model.layers.{}.self_attn.q_a_layernorm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.q_b_proj.weight": "layers.{}.attention.wq_b.weight",
    "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight": "layers.{}.attention.wkv_a.weight",
    "model.layers.{}.self_attn.kv_a_layernorm.weight": "layers.{}.attention.kv_norm.weight",
    "model.layers.{}.self_attn.kv_b_proj.weight": "layers.{}.attention.wkv_b.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.layers.{}.mlp.experts.{}.gate_proj.weight": "layers.{}.moe.routed_experts.inner_experts.w1_EFD",
    "model.layers.{}.mlp.experts.{}.up_proj.weight": "layers.{}.moe.routed_experts.inner_experts.w3_EFD",
    "model.layers.{}.mlp.experts.{}.down_proj.weight": "layers.{}.moe.routed_experts.inner_experts.w2_EDF",
    "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.gate.weight",
    "model.layers.{}.mlp.shared_experts.gate_proj.weight": "layers.{}.moe.shared_experts.w1.weight",
    "model.layers.{}.mlp.shared_experts.up_proj.weight": "layers.{}.moe.shared_experts.w3.weight",
    "model.layers.{}.mlp.shared_experts.down_proj.weight": "layers.{}.moe.shared_experts.w2.weight",
    "model.layers.{}.mlp.gate.e_score_correction_bias": "layers.{}.moe.expert_bias_E",
    "model.layers.{}.enorm.weight": "layers.{}.enorm.weight",
    "model.layers.{}.hnorm.weight": "layers.{}.hnorm.weight",
    "model.layers.{}.eh_proj.weight": "layers.{}.eh_proj.weight",
    "model.layers.{}.shared_head.norm.weight": "layers.{}.mtp_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
TO_HF = {v: k for k, v in FROM_HF.items()}
_EXPERTS = "moe.routed_experts.inner_experts"
_MTP = "mtp_layers."


def _main_layers(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> int:
    """The number of main (non-MTP) layers: ``num_hidden_layers`` (or ``n_layers``), else the model's ``layers.N`` count."""
    found = {fqn.split(".")[1] for fqn in (t.fqn for t in tensors) if fqn.startswith("layers.")}
    return config_int(config, "num_hidden_layers", "n_layers", default=max(len(found), 1))


def to_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``torchtitan-deepseek-v3-to-hf``: a torchtitan DeepSeek-V3 model's tensors to HF ``DeepseekV3ForCausalLM``'s.

    As torchtitan 0.3.0's ``DeepSeekV3StateDictAdapter.to_hf`` (offline): keys mapped, each
    stacked ``(E, F, D)`` expert weight split into ``E`` HF tensors (expert ``e`` is rows
    ``[e * F, (e + 1) * F)`` of its ``(E * F, D)`` view, a byte-range copy), and ``mtp_layers.I``
    written as HF layer ``num_hidden_layers + I``.

    Args:
        tensors: the model's tensors.
        config: ``num_hidden_layers`` (torchtitan: ``n_layers``), read only for MTP layers and
            otherwise the number of ``layers.N`` the model has.

    Raises:
        UnsupportedTransformError: a tensor torchtitan's map does not know (naming it), or an
            expert weight that is not 3-d.
    """
    out: dict[str, Derived] = {}
    main_layers = _main_layers(tensors, config) if any(t.fqn.startswith(_MTP) for t in tensors) else 0
    for info in tensors:
        abstract, numbers = abstract_key(info.fqn)
        if abstract.startswith(_MTP):
            abstract = abstract[len("mtp_") :]
            numbers = [str(main_layers + int(numbers[0]))]
        hf = TO_HF.get(abstract)
        if hf is None:
            raise UnsupportedTransformError(f"{info.fqn}: not a DeepSeek-V3 weight torchtitan's DeepSeekV3StateDictAdapter maps")
        if _EXPERTS in abstract:
            out.update(split_experts(info, hf, numbers[0]))
        else:
            out[hf.format(*numbers)] = moved(info)
    return out


def from_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``hf-to-torchtitan-deepseek-v3``: HF DeepSeek-V3 tensors (unquantized) to torchtitan 0.3.0's DeepSeek-V3 model's.

    The Hub's block-FP8 weights reach it dequantized to float32, without their scales:
    ``adapters.load_adapter`` runs it after ``transform.fp8.dequantize_rules`` (as torchtitan reads
    them through ``QuantizedHuggingFaceStorageReader``), each expert dequantized as it is stacked.

    As torchtitan 0.3.0's ``DeepSeekV3StateDictAdapter.from_hf`` (offline): keys mapped, each
    layer's experts stacked in expert order into one ``(num_experts, ...)`` weight (one segment
    per expert of its ``(E * F, D)`` view), and with ``num_hidden_layers`` in the config, HF layers
    from ``num_hidden_layers`` on written as ``mtp_layers.{N - num_hidden_layers}``.

    Args:
        tensors: the HF checkpoint's tensors.
        config: its ``config.json`` (``num_hidden_layers``; without it every layer is a main layer).

    Raises:
        UnsupportedTransformError: a key torchtitan's map does not know (naming it), or a layer's
            experts that are missing one or differ in shape or dtype.
    """
    main_layers = config_int(config, "num_hidden_layers", "n_layers", default=2**62)
    out: dict[str, Derived] = {}
    experts: dict[str, dict[int, TensorInfo]] = {}
    for info in tensors:
        is_expert = ".mlp.experts." in info.fqn
        abstract, numbers = abstract_key(info.fqn, count=2 if is_expert else 1)
        titan = FROM_HF.get(abstract)
        if titan is None:
            raise UnsupportedTransformError(f"{info.fqn}: not a DeepSeek-V3 weight torchtitan's DeepSeekV3StateDictAdapter maps")
        if numbers and int(numbers[0]) >= main_layers:
            titan = "mtp_" + titan
            numbers[0] = str(int(numbers[0]) - main_layers)
        if is_expert:
            key = titan.format(numbers[0])
            if key not in experts:
                out[key] = moved(info)  # a placeholder, keeping the output order; replaced below
            experts.setdefault(key, {})[int(numbers[1])] = info
        else:
            out[titan.format(*numbers)] = moved(info)
    for key, by_expert in experts.items():
        out[key] = stack_experts(key, by_expert)
    return out
