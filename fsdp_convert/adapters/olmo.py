"""OLMo-core's transformer and Hugging Face's ``Olmo2ForCausalLM`` / ``Olmo3ForCausalLM``: the key map, both ways.

Follows OLMo-core 3.0.0's ``olmo_core.nn.hf.convert.convert_state_to_hf`` for OLMo-2/3 blocks
(``TransformerBlockType.reordered_norm``: norms after attention and after the feed-forward, with
``q_norm`` / ``k_norm``): its ``OLMO_CORE_TO_HF_WEIGHT_MAPPINGS``, one OLMo-core key to one HF
key, every tensor copied unchanged (no RoPE permutation: both use the half-split rotary layout).
As there, a key the map does not know is refused rather than left out (its ``StateConverter``
raises "Some state keys were not converted"), and so are mixture-of-experts blocks and the model
types whose blocks it maps otherwise (``llama``, ``qwen3``, ``gemma3_text``, ``olmo3moe``...).

``from_hf`` follows its inverse, ``convert_state_from_hf`` (with ``model_type`` the config's, as
OLMo-core's ``load_hf_model`` calls it): ``HF_TO_OLMO_CORE_WEIGHT_MAPPINGS``' dense entries for
those blocks (``FROM_HF``, ``TO_HF`` reversed), each tensor copied unchanged, and with
``tie_word_embeddings`` ``lm_head.w_out.weight`` a copy of ``embeddings.weight`` (HF's
``lm_head.weight``, if saved, set aside as there). Its output names are the model's own
(``blocks.0.attention.w_q.weight``); OLMo-core's checkpoint files them under ``model.``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_convert.adapters._common import config_int, moved, tied
from fsdp_convert.derive import Derived, TensorInfo
from fsdp_convert.errors import InvalidOptionError, UnsupportedTransformError

__all__ = ["TO_HF", "FROM_HF", "MODEL_TYPES", "to_hf", "from_hf"]

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
# OLMo-core 3.0.0 HF_TO_OLMO_CORE_WEIGHT_MAPPINGS for OLMo-2/3 blocks: TO_HF reversed (one to one)
FROM_HF: dict[str, str] = {hf: olmo for olmo, hf in TO_HF.items()}
# the HF model types whose blocks convert_state_to_hf maps with TO_HF alone (None: no config given)
MODEL_TYPES = (None, "olmo2", "olmo3")
_BLOCK_RE = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# a non-persistent buffer of old transformers releases' saves, recomputed from the config: not a weight
_INV_FREQ = "self_attn.rotary_emb.inv_freq"


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
    _check_model_type("olmo-core-to-hf", "convert_state_to_hf", config)
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


def from_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``hf-to-olmo-core``: ``Olmo2ForCausalLM`` / ``Olmo3ForCausalLM``'s tensors to OLMo-core's model's.

    As OLMo-core 3.0.0's ``convert_state_from_hf`` for ``model_type`` ``olmo2`` / ``olmo3``: each
    key mapped by ``FROM_HF``, each tensor unchanged (same shape, dtype and bytes); with
    ``tie_word_embeddings``, ``lm_head.w_out.weight`` a copy of ``model.embed_tokens.weight`` and
    HF's ``lm_head.weight`` (a tied save usually leaves it out) not read. A
    ``rotary_emb.inv_freq`` buffer (old transformers saves) is left out: OLMo-core computes it.

    Args:
        tensors: an HF folder's tensors (``model.layers.0.self_attn.q_proj.weight``...).
        config: the HF ``config.json``: ``model_type`` (absent: OLMo-2's map),
            ``tie_word_embeddings`` (absent: untied) and ``num_hidden_layers`` (absent: any layer
            index is taken; given, a layer at or past it is refused, as the converter leaves it
            unconverted and refuses it).

    Returns:
        ``{OLMo-core FQN: Derived}``, names without the checkpoint's ``model.`` prefix
        (``embeddings.weight``, ``blocks.0.attention.w_q.weight``), in the folder's order, the
        tied ``lm_head.w_out.weight`` last (as the converter adds it).

    Raises:
        InvalidOptionError: a ``model_type`` other than ``olmo2`` / ``olmo3``, or a
            ``num_hidden_layers`` that is not a positive integer.
        UnsupportedTransformError: a tensor the map does not know or a layer past
            ``num_hidden_layers`` (naming it), as OLMo-core's ``StateConverter`` refuses it
            ("Some state keys were not converted"); ``tie_word_embeddings`` without
            ``model.embed_tokens.weight``.
    """
    _check_model_type("hf-to-olmo-core", "convert_state_from_hf", config)
    n_layers = config_int(config, "num_hidden_layers", default=sys.maxsize)  # absent: no bound
    tie = tied(config)
    out: dict[str, Derived] = {}
    embed: TensorInfo | None = None
    for info in tensors:
        layer = _HF_LAYER_RE.fullmatch(info.fqn)
        abstract, numbers = (f"model.layers.{{}}.{layer.group(2)}", [layer.group(1)]) if layer else (info.fqn, [])
        if layer and layer.group(2) == _INV_FREQ:
            continue
        olmo = FROM_HF.get(abstract)
        if olmo is None:
            raise UnsupportedTransformError(
                f"{info.fqn}: not an OLMo-2/3 weight OLMo-core's convert_state_from_hf maps; "
                "hf-to-olmo-core refuses it, as it does"
            )
        if numbers and int(numbers[0]) >= n_layers:
            raise UnsupportedTransformError(
                f"{info.fqn}: layer {numbers[0]} is past num_hidden_layers={n_layers}, so OLMo-core's "
                "convert_state_from_hf leaves it unconverted and refuses it; hf-to-olmo-core refuses it too"
            )
        if info.fqn == "model.embed_tokens.weight":
            embed = info
        if tie and info.fqn == "lm_head.weight":
            continue  # the converter overwrites it with the embedding
        out[olmo.format(*numbers)] = moved(info)
    if tie:
        if embed is None:
            raise UnsupportedTransformError(
                "tie_word_embeddings is set but model.embed_tokens.weight is not in the folder: "
                "hf-to-olmo-core has no lm_head.w_out.weight to give"
            )
        out["lm_head.w_out.weight"] = moved(embed)
    return out


def _check_model_type(adapter: str, converter: str, config: Mapping[str, Any]) -> None:
    """Refuse a ``model_type`` whose blocks OLMo-core's converter maps otherwise than OLMo-2/3's.

    Raises:
        InvalidOptionError: ``model_type`` is given and not ``olmo2`` / ``olmo3``.
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise InvalidOptionError(
            f"{adapter}: model_type {model_type!r} is not one it maps; it follows {converter} "
            "for OLMo-2/3 blocks (model_type olmo2 or olmo3)"
        )
