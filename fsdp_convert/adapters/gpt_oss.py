"""torchtitan's gpt-oss to Hugging Face's and back: torchtitan's own key map, and the same with transformers' expert layout.

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

transformers' unquantized ``GptOssForCausalLM`` does not read those ``*_blocks`` names: it reads
``mlp.experts.gate_up_proj`` ``(E, D, 2F)`` and ``mlp.experts.down_proj`` ``(E, F, D)``, each
expert the transpose of torchtitan's (``x @ gate_up_proj[e]`` where torchtitan computes
``x @ mlp1_weight_EGD[e].T``; gate and up interleaved alike, ``[..., ::2]`` and ``[..., 1::2]``).
``to_transformers`` / ``from_transformers`` are the same map with those two weights transposed
expert by expert: each expert is one dim-0 row, so an output block of experts is built from the
same experts' input rows (a transpose, no value changed) within the mover's buffers, at least one
expert at a time.

gpt-oss as released holds those experts in MXFP4: uint8 ``*_blocks`` with ``*_scales`` beside them
(``transform.mxfp4``). ``--dequantize`` (implied by ``hf-to-torchtitan-gpt-oss``) gives them as
torch's ``QuantizedHuggingFaceStorageReader`` does, float ``*_blocks`` in torchtitan's ``(E, 2F,
D)`` and ``(E, D, F)`` layout, which both ``from_hf`` and ``from_transformers`` take as they are
(transformers' own MXFP4 loader gives the same values transposed, under the names without
``_blocks``). Nibbles not dequantized are refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fsdp_convert.adapters._common import abstract_key, moved, warn_left_out
from fsdp_convert.derive import Derived, Input, TensorInfo
from fsdp_convert.dtypes import DType
from fsdp_convert.errors import UnsupportedTransformError
from fsdp_convert.transform.mxfp4 import BLOCKS_SUFFIX

if TYPE_CHECKING:
    import torch

__all__ = ["FROM_HF", "to_hf", "from_hf", "to_transformers", "from_transformers", "transpose_experts"]

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
# transformers' GptOssExperts reads the same map with the *_blocks names' suffix dropped, each expert transposed;
# a float *_blocks (the released MXFP4 experts dequantized, torch's reader's layout) is torchtitan's layout as it is
FROM_TRANSFORMERS = {k.removesuffix("_blocks"): v for k, v in FROM_HF.items()} | {
    k: v for k, v in FROM_HF.items() if k.endswith("_blocks")
}
TO_TRANSFORMERS = {k: v.removesuffix("_blocks") for k, v in TO_HF.items()}
_TRANSPOSED = {k.removesuffix("_blocks") for k in FROM_HF if k.endswith("_blocks")} | {
    k for k, v in TO_HF.items() if v.endswith("_blocks")
}


def transpose_experts(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """A block of stacked experts ``(n, A, B)``, each transposed: ``(n, B, A)`` (a view; the mover copies it)."""
    return parts[0].transpose(1, 2)


def _transposed(info: TensorInfo) -> Derived:
    """``info``, a stacked ``(E, A, B)`` expert weight, as ``(E, B, A)``: rows are experts, each transposed.

    Raises:
        UnsupportedTransformError: ``info`` is not 3-d.
    """
    if len(info.shape) != 3:
        raise UnsupportedTransformError(f"{info.fqn}: expected a stacked (experts, rows, columns) weight, got shape {info.shape}")
    n, rows, cols = info.shape
    return Derived(inputs=(Input(fqn=info.fqn),), shape=(n, cols, rows), dtype=info.dtype, combine=transpose_experts)


def _refused(fqn: str, adapter: str, dtype: DType) -> UnsupportedTransformError:
    """The one-line refusal of a key ``adapter``'s map does not know, with the adapter to use when another fits."""
    hint = ""
    if fqn.endswith("_scales") or (fqn.endswith(BLOCKS_SUFFIX) and dtype == DType("uint8")):
        hint = " (MXFP4-quantized experts: --dequantize, with each *_blocks's *_scales beside it)"
    elif fqn.endswith(("experts.gate_up_proj", "experts.down_proj")):
        hint = " (transformers' transposed expert layout: use the transformers-to-torchtitan-gpt-oss adapter)"
    return UnsupportedTransformError(f"{fqn}: not a gpt-oss weight {adapter} maps{hint}")


def _adapt(
    tensors: Sequence[TensorInfo], names: Mapping[str, str], adapter: str, *, from_titan: bool, transpose: bool = False
) -> dict[str, Derived]:
    """Every tensor under its ``names`` key (``transpose``: the ``_TRANSPOSED`` ones transposed).

    From torchtitan (``from_titan``), ``_LEFT_OUT`` is left out with a warning, as its ``to_hf`` leaves it.

    Raises:
        UnsupportedTransformError: a key ``names`` does not know, MXFP4 nibbles (uint8 ``*_blocks``:
            not dequantized), or a transposed weight that is not 3-d.
    """
    out: dict[str, Derived] = {}
    left_out: list[str] = []
    for info in tensors:
        abstract, numbers = abstract_key(info.fqn)
        target = names.get(abstract)
        if abstract.endswith(BLOCKS_SUFFIX) and info.dtype == DType("uint8"):
            raise _refused(info.fqn, adapter, info.dtype)
        if target is not None:
            out[target.format(*numbers)] = _transposed(info) if transpose and abstract in _TRANSPOSED else moved(info)
        elif abstract == _LEFT_OUT and from_titan:
            left_out.append(info.fqn)
        else:
            raise _refused(info.fqn, adapter, info.dtype)
    warn_left_out(adapter, left_out)
    return out


def to_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``torchtitan-gpt-oss-to-hf``: a torchtitan gpt-oss model's tensors under HF gpt-oss names.

    As torchtitan 0.3.0's ``GptOssStateDictAdapter.to_hf``: keys mapped, every tensor copied as it
    is (the ``(E, 2F, D)`` and ``(E, D, F)`` expert weights, float, under the ``*_blocks`` names,
    which transformers' ``GptOssForCausalLM`` does not read: see ``to_transformers``).
    ``moe.expert_bias_E`` is left out with a warning.

    Args:
        tensors: the model's tensors.
        config: unused; the map needs no sizes.

    Raises:
        UnsupportedTransformError: a tensor torchtitan's map does not know, naming it.
    """
    return _adapt(tensors, TO_HF, "torchtitan-gpt-oss-to-hf", from_titan=True)


def from_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``hf-to-torchtitan-gpt-oss``: HF gpt-oss tensors (unquantized, torchtitan's layout) to torchtitan 0.3.0's model's.

    As torchtitan 0.3.0's ``GptOssStateDictAdapter.from_hf``: keys mapped, every tensor copied as
    it is; the experts under the model's own names (``mlp1_weight_EGD``...).

    Args:
        tensors: the HF checkpoint's tensors.
        config: unused; the map needs no sizes.

    Raises:
        UnsupportedTransformError: a key torchtitan's map does not know, naming it (MXFP4
            ``*_scales`` and uint8 ``*_blocks`` not dequantized, or transformers' own transposed
            ``experts.gate_up_proj``, among them).
    """
    return _adapt(tensors, FROM_HF, "hf-to-torchtitan-gpt-oss", from_titan=False)


def to_transformers(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``torchtitan-gpt-oss-to-transformers``: a torchtitan gpt-oss model as transformers' ``GptOssForCausalLM`` reads it.

    ``to_hf``'s map, but ``mlp1_weight_EGD`` ``(E, 2F, D)`` is written as ``mlp.experts.gate_up_proj``
    ``(E, D, 2F)`` and ``mlp2_weight_EDF`` ``(E, D, F)`` as ``mlp.experts.down_proj`` ``(E, F, D)``,
    each expert transposed (gate/up stay interleaved, as both models read them). Built an expert
    (a dim-0 row) at a time or more: memory holds at least one expert's input and output.
    ``moe.expert_bias_E`` is left out with a warning.

    Args:
        tensors: the model's tensors.
        config: unused; the map needs no sizes.

    Raises:
        UnsupportedTransformError: a tensor the map does not know, or an expert weight that is not 3-d, naming it.
    """
    return _adapt(tensors, TO_TRANSFORMERS, "torchtitan-gpt-oss-to-transformers", from_titan=True, transpose=True)


def from_transformers(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``transformers-to-torchtitan-gpt-oss``: an unquantized transformers gpt-oss folder to torchtitan 0.3.0's model's tensors.

    The inverse of ``to_transformers``: ``gate_up_proj`` ``(E, D, 2F)`` to ``mlp1_weight_EGD``
    ``(E, 2F, D)`` and ``down_proj`` ``(E, F, D)`` to ``mlp2_weight_EDF`` ``(E, D, F)``, each expert
    transposed; every other tensor under ``from_hf``'s map, as it is, float ``*_blocks`` too (the
    released MXFP4 experts dequantized, ``--dequantize``: already torchtitan's layout).

    Args:
        tensors: the HF folder's tensors.
        config: unused; the map needs no sizes.

    Raises:
        UnsupportedTransformError: a key the map does not know, naming it (MXFP4 uint8 ``*_blocks`` /
            ``*_scales`` not dequantized among them), or an expert weight that is not 3-d.
    """
    return _adapt(tensors, FROM_TRANSFORMERS, "transformers-to-torchtitan-gpt-oss", from_titan=False, transpose=True)
