"""OLMo-core's transformer and Hugging Face's ``Olmo2ForCausalLM`` / ``Olmo3ForCausalLM``: the key map to HF.

Follows OLMo-core 3.0.0's ``olmo_core.nn.hf.convert.convert_state_to_hf`` for OLMo-2/3 blocks
(``TransformerBlockType.reordered_norm``: norms after attention and after the feed-forward, with
``q_norm`` / ``k_norm``): its ``OLMO_CORE_TO_HF_WEIGHT_MAPPINGS``, one OLMo-core key to one HF
key, every tensor copied unchanged (no RoPE permutation: both use the half-split rotary layout).
As there, a key the map does not know is refused rather than left out (its ``StateConverter``
raises "Some state keys were not converted"), and so are mixture-of-experts blocks and the model
types whose blocks it maps otherwise (``llama``, ``qwen3``, ``gemma3_text``, ``olmo3moe``...).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_convert.adapters._common import moved
from fsdp_convert.derive import Derived, TensorInfo
from fsdp_convert.errors import InvalidOptionError, UnsupportedTransformError

__all__ = ["TO_HF", "MODEL_TYPES", "to_hf"]

# OLMo-core 3.0.0 OLMO_CORE_TO_HF_WEIGHT_MAPPINGS, dense entries ({} is the block index)
TO_HF: dict[str, str] = {
    "embeddings.weight": "model.embed_tokens.weight",
    "lm_head.norm.weight": "model.norm.weight",
    "lm_head.w_out.weight": "lm_head.weight",
    "blocks.{}.attention.w_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blocks.{}.attention.w_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blocks.{}.attention.w_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blocks.{}.attention.w_out.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blocks.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blocks.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "blocks.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "blocks.{}.attention_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blocks.{}.feed_forward_norm.weight": "model.layers.{}.post_feedforward_layernorm.weight",
    "blocks.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "blocks.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}
# the HF model types whose blocks convert_state_to_hf maps with TO_HF alone (None: no config given)
MODEL_TYPES = (None, "olmo2", "olmo3")
_BLOCK_RE = re.compile(r"blocks\.(\d+)\.(.+)")


def to_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``olmo-core-to-hf``: an OLMo-core OLMo-2/3 model's tensors (``model.*`` FQNs, prefix removed) to HF's names.

    As OLMo-core 3.0.0's ``convert_state_to_hf`` for ``model_type`` ``olmo2`` / ``olmo3``: each
    key mapped by ``TO_HF``, each tensor unchanged (same shape, dtype and bytes).

    Args:
        tensors: the model's tensors, OLMo-core's names (``blocks.0.attention.w_q.weight``).
        config: the HF ``config.json``; only ``model_type`` is read (absent: OLMo-2's map).

    Raises:
        InvalidOptionError: a ``model_type`` other than ``olmo2`` / ``olmo3``.
        UnsupportedTransformError: a tensor the map does not know (naming it), as OLMo-core's
            converter refuses it.
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise InvalidOptionError(
            f"olmo-core-to-hf: model_type {model_type!r} is not one it maps; it follows convert_state_to_hf "
            "for OLMo-2/3 blocks (model_type olmo2 or olmo3)"
        )
    out: dict[str, Derived] = {}
    for info in tensors:
        block = _BLOCK_RE.fullmatch(info.fqn)
        abstract, numbers = (f"blocks.{{}}.{block.group(2)}", [block.group(1)]) if block else (info.fqn, [])
        hf = TO_HF.get(abstract)
        if hf is None:
            raise UnsupportedTransformError(
                f"{info.fqn}: not an OLMo-2/3 weight OLMo-core's convert_state_to_hf maps; olmo-core-to-hf refuses it, as it does"
            )
        out[hf.format(*numbers)] = moved(info)
    return out
