"""torchtitan's gpt-oss and Hugging Face's gpt-oss names, both ways: torchtitan's own key map.

Follows torchtitan 0.3.0's ``torchtitan/models/gpt_oss/state_dict_adapter.py``
(``GptOssStateDictAdapter.to_hf`` / ``from_hf``, unquantized): a key map and nothing else, no
tensor changes shape. Q/K/V with their biases, ``o_proj``'s bias, the attention ``sinks``, the
biased router, and each layer's stacked experts as they are: torchtitan's ``(E, 2F, D)``
``mlp1`` (gate and up interleaved) is written under HF's MXFP4 name ``gate_up_proj_blocks``,
``(E, D, F)`` ``mlp2`` as ``down_proj_blocks``, unquantized. torchtitan 0.3.0's model names its
experts ``mlp1_weight_EGD``, ``mlp1_bias_EG``, ``mlp2_weight_EDF``, ``mlp2_bias_ED``, which its
adapter's map (``mlp1_weight``...) no longer matches, so its ``to_hf`` drops them silently: here
both spellings map, and ``from_hf`` writes the model's own. The load-balancing buffer
``moe.expert_bias_E`` has no HF counterpart: left out with a warning, as torchtitan's ``to_hf``
leaves it out. Any other key the map does not know is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_convert.adapters._common import abstract_key, moved, warn_left_out
from fsdp_convert.derive import Derived, TensorInfo
from fsdp_convert.errors import UnsupportedTransformError

__all__ = ["FROM_HF", "to_hf", "from_hf"]

_EXPERTS = "layers.{}.moe.routed_experts.inner_experts."
# torchtitan 0.3.0 GptOssStateDictAdapter.from_hf_map (HF key -> torchtitan key), experts under the model's names
FROM_HF: dict[str, str] = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.qkv_linear.wq.weight",
    "model.layers.{}.self_attn.q_proj.bias": "layers.{}.attention.qkv_linear.wq.bias",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.qkv_linear.wk.weight",
    "model.layers.{}.self_attn.k_proj.bias": "layers.{}.attention.qkv_linear.wk.bias",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.qkv_linear.wv.weight",
    "model.layers.{}.self_attn.v_proj.bias": "layers.{}.attention.qkv_linear.wv.bias",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.o_proj.bias": "layers.{}.attention.wo.bias",
    "model.layers.{}.self_attn.sinks": "layers.{}.attention.sinks",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.layers.{}.mlp.experts.gate_up_proj_blocks": _EXPERTS + "mlp1_weight_EGD",
    "model.layers.{}.mlp.experts.gate_up_proj_bias": _EXPERTS + "mlp1_bias_EG",
    "model.layers.{}.mlp.experts.down_proj_blocks": _EXPERTS + "mlp2_weight_EDF",
    "model.layers.{}.mlp.experts.down_proj_bias": _EXPERTS + "mlp2_bias_ED",
    "model.layers.{}.mlp.router.weight": "layers.{}.moe.router.gate.weight",
    "model.layers.{}.mlp.router.bias": "layers.{}.moe.router.gate.bias",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
TO_HF = {v: k for k, v in FROM_HF.items()}
# the expert names torchtitan's own map still spells (before the model's _EGD-style suffixes)
TO_HF.update({k.rsplit("_", 1)[0]: v for k, v in TO_HF.items() if k.startswith(_EXPERTS)})
_LEFT_OUT = "layers.{}.moe.expert_bias_E"


def _refused(fqn: str) -> UnsupportedTransformError:
    """The one-line refusal of a key torchtitan's gpt-oss map does not know."""
    hint = ""
    if fqn.endswith("_scales"):
        hint = " (MXFP4-quantized experts: dequantize the checkpoint first)"
    elif fqn.endswith(("experts.gate_up_proj", "experts.down_proj")):
        hint = " (transformers' transposed expert layout, not torchtitan's map; use its MXFP4-layout names)"
    return UnsupportedTransformError(f"{fqn}: not a gpt-oss weight torchtitan's GptOssStateDictAdapter maps{hint}")


def to_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``torchtitan-gpt-oss-to-hf``: a torchtitan gpt-oss model's tensors under HF gpt-oss names.

    As torchtitan 0.3.0's ``GptOssStateDictAdapter.to_hf``: keys mapped, every tensor copied as it
    is (the ``(E, 2F, D)`` and ``(E, D, F)`` expert weights, float, under the ``*_blocks`` names).
    ``moe.expert_bias_E`` is left out with a warning.

    Args:
        tensors: the model's tensors.
        config: unused; the map needs no sizes.

    Raises:
        UnsupportedTransformError: a tensor torchtitan's map does not know, naming it.
    """
    out: dict[str, Derived] = {}
    left_out: list[str] = []
    for info in tensors:
        abstract, numbers = abstract_key(info.fqn)
        hf = TO_HF.get(abstract)
        if hf is not None:
            out[hf.format(*numbers)] = moved(info)
        elif abstract == _LEFT_OUT:
            left_out.append(info.fqn)
        else:
            raise _refused(info.fqn)
    warn_left_out("torchtitan-gpt-oss-to-hf", left_out)
    return out


def from_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``hf-to-torchtitan-gpt-oss``: HF gpt-oss tensors (unquantized, torchtitan's layout) to torchtitan 0.3.0's model's.

    As torchtitan 0.3.0's ``GptOssStateDictAdapter.from_hf``: keys mapped, every tensor copied as
    it is; the experts under the model's own names (``mlp1_weight_EGD``...).

    Args:
        tensors: the HF checkpoint's tensors.
        config: unused; the map needs no sizes.

    Raises:
        UnsupportedTransformError: a key torchtitan's map does not know, naming it (MXFP4
            ``*_scales``, or transformers' own transposed ``experts.gate_up_proj``, among them).
    """
    out: dict[str, Derived] = {}
    for info in tensors:
        abstract, numbers = abstract_key(info.fqn)
        titan = FROM_HF.get(abstract)
        if titan is None:
            raise _refused(info.fqn)
        out[titan.format(*numbers)] = moved(info)
    return out
