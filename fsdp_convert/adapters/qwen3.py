"""torchtitan's Qwen 3 and Hugging Face's ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``: key map and expert layout, both ways.

Follows torchtitan 0.3.0's ``torchtitan/models/qwen3/state_dict_adapter.py``
(``Qwen3StateDictAdapter.to_hf`` / ``from_hf``, offline path): its ``from_hf_map``, no RoPE
permutation (both use HF's half-split rotary layout), ``q_norm`` / ``k_norm``, weight tying, and
for MoE layers each stacked ``(num_experts, ...)`` expert weight split into one HF tensor per
expert (``torch.split`` on dim 0, squeezed) and stacked back. Tensors its map does not know are
left out by ``to_hf`` (as torchtitan's skips them) and refused by ``from_hf``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_convert.adapters._common import abstract_key, moved, split_experts, stack_experts, tied, warn_left_out
from fsdp_convert.derive import Derived, TensorInfo
from fsdp_convert.errors import UnsupportedTransformError

__all__ = ["FROM_HF", "to_hf", "from_hf"]

# torchtitan 0.3.0 Qwen3StateDictAdapter.from_hf_map (HF key -> torchtitan key; None: dropped)
FROM_HF: dict[str, str | None] = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.qkv_linear.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.qkv_linear.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.qkv_linear.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
    "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.layers.{}.mlp.experts.{}.gate_proj.weight": "layers.{}.moe.routed_experts.inner_experts.w1_EFD",
    "model.layers.{}.mlp.experts.{}.up_proj.weight": "layers.{}.moe.routed_experts.inner_experts.w3_EFD",
    "model.layers.{}.mlp.experts.{}.down_proj.weight": "layers.{}.moe.routed_experts.inner_experts.w2_EDF",
    "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.gate.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
TO_HF = {v: k for k, v in FROM_HF.items() if v is not None}
_EXPERTS = "moe.routed_experts.inner_experts"


def to_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``torchtitan-qwen3-to-hf``: a torchtitan Qwen 3 model's tensors to HF ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``'s.

    As torchtitan 0.3.0's ``Qwen3StateDictAdapter.to_hf`` (offline): keys mapped, stacked expert
    weights split per expert, ``lm_head.weight`` left out when ``tie_word_embeddings``, unknown
    tensors left out (with a warning).

    Args:
        tensors: the model's tensors.
        config: ``tie_word_embeddings`` (or torchtitan's ``enable_weight_tying``); nothing else is needed.

    Raises:
        UnsupportedTransformError: an expert weight that is not 3-d.
    """
    out: dict[str, Derived] = {}
    left_out = []
    for info in tensors:
        abstract, numbers = abstract_key(info.fqn)
        hf = TO_HF.get(abstract)
        if hf is None:
            left_out.append(info.fqn)
        elif _EXPERTS in abstract:
            out.update(split_experts(info, hf, numbers[0]))
        elif not (hf == "lm_head.weight" and tied(config)):
            out[hf.format(*numbers)] = moved(info)
    warn_left_out("torchtitan-qwen3-to-hf", left_out)
    return out


def from_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``hf-to-torchtitan-qwen3``: HF Qwen 3 (dense or MoE) tensors to torchtitan 0.3.0's Qwen 3 model's.

    As torchtitan 0.3.0's ``Qwen3StateDictAdapter.from_hf`` (offline): keys mapped, each layer's
    experts stacked in expert order into one ``(num_experts, ...)`` weight (built from its
    ``(E * F, D)`` view, one segment per expert), ``rotary_emb.inv_freq`` dropped, and with
    ``tie_word_embeddings`` and no ``lm_head.weight``, ``lm_head.weight`` a copy of the embedding.

    Raises:
        UnsupportedTransformError: a key torchtitan's map does not know (naming it), or a layer's
            experts that are missing one or differ in shape or dtype.
    """
    out: dict[str, Derived] = {}
    experts: dict[str, dict[int, TensorInfo]] = {}
    for info in tensors:
        is_expert = ".mlp.experts." in info.fqn
        abstract, numbers = abstract_key(info.fqn, count=2 if is_expert else 1)
        if abstract not in FROM_HF:
            raise UnsupportedTransformError(f"{info.fqn}: not a Qwen3 weight torchtitan's Qwen3StateDictAdapter maps")
        titan = FROM_HF[abstract]
        if titan is None:
            continue
        if is_expert:
            key = titan.format(numbers[0])
            if key not in experts:
                out[key] = moved(info)  # a placeholder, keeping the output order; replaced below
            experts.setdefault(key, {})[int(numbers[1])] = info
        else:
            out[titan.format(*numbers)] = moved(info)
    for key, by_expert in experts.items():
        out[key] = stack_experts(key, by_expert)
    embed = next((t for t in tensors if t.fqn == "model.embed_tokens.weight"), None)
    if tied(config) and not any(t.fqn == "lm_head.weight" for t in tensors) and embed is not None:
        out["lm_head.weight"] = moved(embed)
    return out
