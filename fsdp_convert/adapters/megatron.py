"""Megatron-Core's GPT (Llama layout) and Hugging Face's ``LlamaForCausalLM``: layers unstacked, fused QKV and gate/up split.

Follows Megatron-Bridge 0.3.1's ``LlamaBridge.mapping_registry``
(``megatron/bridge/models/llama/llama_bridge.py``): its key map (local and Transformer Engine
norm names both), ``QKVMapping`` (``split_qkv_weights``: Megatron's ``linear_qkv`` rows are, per
query group, its ``heads_per_group`` query heads, then one key head, then one value head, each
``head_dim`` rows; no RoPE permutation, Megatron's rotary embedding halves each head as HF's does)
and ``GatedMLPMapping`` (``linear_fc1`` is ``[gate; up]``). Megatron-Bridge maps a live model's
per-layer names (``decoder.layers.N.…``); a ``torch_dist`` checkpoint stores each of
``decoder.layers.*`` once, stacked on a leading layer dim (``TransformerBlock.sharded_state_dict``),
so layer ``N`` is that tensor's ``N``-th slice, read through a ``(layers * rows, ...)`` view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_convert.adapters._common import config_int, heads, tied, warn_left_out
from fsdp_convert.derive import Derived, Gather, Input, Segment, TensorInfo
from fsdp_convert.errors import UnsupportedTransformError
from fsdp_convert.transform.unstack import check_split

__all__ = ["TO_HF", "to_hf"]

NAME = "megatron-gpt-to-hf"
LAYERS = "decoder.layers."
# Megatron-Bridge 0.3.1 LlamaBridge: Megatron key (per layer: "decoder.layers.*.") -> HF key
TO_HF: dict[str, str] = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "model.layers.{}.input_layernorm.weight",  # Transformer Engine
    "input_layernorm.weight": "model.layers.{}.input_layernorm.weight",  # local
    "mlp.linear_fc1.layer_norm_weight": "model.layers.{}.post_attention_layernorm.weight",  # Transformer Engine
    "pre_mlp_layernorm.weight": "model.layers.{}.post_attention_layernorm.weight",  # local
    "self_attention.linear_proj.weight": "model.layers.{}.self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "model.layers.{}.mlp.down_proj.weight",
}
QKV = "self_attention.linear_qkv.weight"
FC1 = "mlp.linear_fc1.weight"
_ATTN = "model.layers.{}.self_attn.{}_proj.weight"
_MLP = "model.layers.{}.mlp.{}_proj.weight"


def _qkv_rows(rows: int, n_heads: int, n_groups: int, info: TensorInfo) -> tuple[list[int], list[int], list[int]]:
    """The q, k and v rows of one layer's ``linear_qkv`` weight, as ``split_qkv_weights`` picks them."""
    per_group = n_heads // n_groups
    total = n_heads + 2 * n_groups  # heads of head_dim rows in the fused weight
    if n_heads % n_groups or rows % total:
        raise UnsupportedTransformError(
            f"{info.fqn}: {rows} rows do not split into {n_heads} query heads in {n_groups} groups plus a key and a "
            "value head each; check num_attention_heads / num_key_value_heads"
        )
    hd = rows // total
    step = (per_group + 2) * hd
    q = [g * step + j for g in range(n_groups) for j in range(per_group * hd)]
    k = [g * step + per_group * hd + j for g in range(n_groups) for j in range(hd)]
    v = [g * step + (per_group + 1) * hd + j for g in range(n_groups) for j in range(hd)]
    return q, k, v


def _layer(info: TensorInfo, layer: int, rows: Any, count: int) -> Derived:
    """``count`` rows of a stacked ``(layers, rows, ...)`` tensor's layer ``layer``, picked by ``rows`` from its view."""
    per_layer = info.shape[1]
    view = (info.shape[0] * per_layer, *info.shape[2:])
    return Derived(
        inputs=(Input(fqn=info.fqn, rows=rows, view=view),),
        shape=(count, *info.shape[2:]),
        dtype=info.dtype,
    )


def _slice(info: TensorInfo, layer: int, start: int = 0, count: int | None = None) -> Derived:
    per_layer = info.shape[1]
    count = per_layer - start if count is None else count
    return _layer(info, layer, Segment(0, count, layer * per_layer + start), count)


def _stacked(info: TensorInfo, layers: int, n_heads: int, n_groups: int) -> dict[str, Derived] | None:
    """HF's tensors of every layer of one stacked ``decoder.layers.*`` tensor; None for a key not mapped."""
    name = info.fqn.removeprefix(LAYERS)
    if len(info.shape) < 2 or info.shape[0] != layers:
        raise UnsupportedTransformError(
            f"{info.fqn}: shape {info.shape} is not stacked on {layers} layers (num_hidden_layers); "
            "a torch_dist checkpoint stacks decoder.layers.* on a leading layer dim"
        )
    # per layer its rows, listed for linear_qkv: bounded by the bytes held, whatever the shape claims
    check_split(info.fqn, info.shape, info.dtype, layers * max(info.shape[1], 1), "layers and rows")
    out: dict[str, Derived] = {}
    for n in range(layers):
        if name == QKV:
            base = n * info.shape[1]
            for part, rows in zip("qkv", _qkv_rows(info.shape[1], n_heads, n_groups, info), strict=True):
                out[_ATTN.format(n, part)] = _layer(info, n, Gather(tuple(base + r for r in rows)), len(rows))
        elif name == FC1:
            if info.shape[1] % 2:
                raise UnsupportedTransformError(f"{info.fqn}: {info.shape[1]} rows do not split into gate and up halves")
            half = info.shape[1] // 2
            out[_MLP.format(n, "gate")] = _slice(info, n, 0, half)
            out[_MLP.format(n, "up")] = _slice(info, n, half, half)
        elif name in TO_HF:
            out[TO_HF[name].format(n)] = _slice(info, n)
        else:
            return None
    return out


def to_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``megatron-gpt-to-hf``: a Megatron-Core GPT's (Llama layout) ``torch_dist`` model tensors to ``LlamaForCausalLM``'s.

    As Megatron-Bridge 0.3.1's Llama mapping: keys mapped, each stacked ``decoder.layers.*``
    tensor split per layer, ``linear_qkv`` split into ``q_proj``/``k_proj``/``v_proj`` and
    ``linear_fc1`` into ``gate_proj``/``up_proj``; ``lm_head.weight`` left out when
    ``tie_word_embeddings``. Other tensors (``_extra_state``, biases a Llama has not) are left out
    with a warning.

    Args:
        tensors: the model's tensors in the checkpoint's keys (``decoder.layers.mlp.linear_fc1.weight``
            of shape ``(layers, 2 * ffn, hidden)``...).
        config: ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` (default: as
            many), ``tie_word_embeddings`` (HF ``config.json`` names).

    Raises:
        InvalidOptionError: no layer or head count in ``config``.
        UnsupportedTransformError: a layer tensor not stacked on ``num_hidden_layers``, or a fused
            weight whose rows do not split into those heads or halves.
    """
    n_heads, n_groups = heads(config)
    layers = config_int(config, "num_hidden_layers", "num_layers")
    out: dict[str, Derived] = {}
    left_out = []
    for info in tensors:
        if info.fqn.startswith(LAYERS):
            rules = _stacked(info, layers, n_heads, n_groups)
            if rules is None:
                left_out.append(info.fqn)
            else:
                out.update(rules)
            continue
        hf = TO_HF.get(info.fqn)
        if hf is None or (hf == "lm_head.weight" and tied(config)):
            if hf is None:
                left_out.append(info.fqn)
            continue
        out[hf] = Derived(inputs=(Input(fqn=info.fqn),), shape=info.shape, dtype=info.dtype)
    warn_left_out(NAME, left_out)
    return dict(sorted(out.items(), key=lambda kv: _hf_order(kv[0])))


def _hf_order(fqn: str) -> tuple[int, int, str]:
    """HF's order: the embedding, then layer by layer, then the final norm and the head."""
    if fqn.startswith("model.layers."):
        return (1, int(fqn.split(".")[2]), fqn)
    return (0 if fqn == "model.embed_tokens.weight" else 2, 0, fqn)
