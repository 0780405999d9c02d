"""torchtune's Llama models to Hugging Face's ``LlamaForCausalLM``: key map and Q/K RoPE permutation.

Follows torchtune 0.6.1's ``torchtune/models/convert_weights.py`` ``tune_to_hf``: its ``_FROM_HF``
map inverted (``layers.N.attn.q_proj.weight`` to ``model.layers.N.self_attn.q_proj.weight``,
``layers.N.sa_norm.scale`` to ``model.layers.N.input_layernorm.weight``, ``output.weight`` to
``lm_head.weight``...), and ``_permute`` of ``q_proj`` with ``num_heads`` and of ``k_proj`` with
``num_kv_heads`` (torchtune's RoPE rotates interleaved pairs, HF's rotates halves). Like
``tune_to_hf``, a key outside the map is an error (naming it), and a tied model (Llama 3.2's
``TiedLinear``) has no ``output.weight`` to map: HF ties ``lm_head`` back from its config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_convert.adapters._common import config_int, moved, rope_rows
from fsdp_convert.derive import Derived, TensorInfo
from fsdp_convert.errors import UnsupportedTransformError

__all__ = ["FROM_HF", "TO_HF", "to_hf"]

# torchtune 0.6.1 convert_weights._FROM_HF (HF key -> torchtune key; None: dropped)
FROM_HF: dict[str, str | None] = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attn.q_proj.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attn.k_proj.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attn.v_proj.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attn.output_proj.weight",
    "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.mlp.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.mlp.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.mlp.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.sa_norm.scale",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.mlp_norm.scale",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
TO_HF = {v: k for k, v in FROM_HF.items() if v is not None}
_LAYER = re.compile(r"\.\d+")  # get_mapped_key's abstract key: every ".N" becomes ".{}"


def to_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``torchtune-llama-to-hf``: a torchtune Llama model's tensors to ``LlamaForCausalLM``'s.

    As torchtune 0.6.1's ``tune_to_hf``: keys mapped by ``get_mapped_key`` over the inverted
    ``_FROM_HF``, ``q_proj`` rows permuted for ``num_attention_heads`` heads and ``k_proj`` for
    ``num_key_value_heads`` (``head_dim`` is the rows per head). Dtypes and shapes are kept.

    Args:
        tensors: the model's tensors (``layers.N.attn.q_proj.weight``..., ``model.`` already
            stripped by the producer's layout).
        config: ``num_attention_heads``, ``num_key_value_heads`` (default: as many) (HF
            ``config.json`` names; torchtune's ``num_heads``, ``num_kv_heads`` also do).

    Raises:
        InvalidOptionError: no head count in ``config``.
        UnsupportedTransformError: a key ``tune_to_hf`` does not map (naming it, as its
            "unexpected key" error), or a Q/K weight whose rows do not split into the heads.
    """
    n_heads = config_int(config, "num_attention_heads", "num_heads")
    n_kv = config_int(config, "num_key_value_heads", "num_kv_heads", default=n_heads)
    out: dict[str, Derived] = {}
    for info in tensors:
        abstract = _LAYER.sub(".{}", info.fqn)
        hf = TO_HF.get(abstract)
        if hf is None:
            raise UnsupportedTransformError(
                f"{info.fqn}: not a Llama weight torchtune's tune_to_hf maps (a LoRA or another family's model?)"
            )
        layer = re.search(r"\d+", info.fqn)
        rows = None
        if "q_proj" in info.fqn:  # tune_to_hf tests the key the same way
            rows = rope_rows(info, n_heads, to_hf=True)
        elif "k_proj" in info.fqn:
            rows = rope_rows(info, n_kv, to_hf=True)
        out[hf.format(layer.group(0) if layer else "")] = moved(info, rows)
    return out
