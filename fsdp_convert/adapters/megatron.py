"""Megatron-Core's GPT and HF's ``LlamaForCausalLM``, both ways: layers (un)stacked, QKV and gate/up split or fused.

Follows Megatron-Bridge 0.3.1's ``LlamaBridge.mapping_registry``
(``megatron/bridge/models/llama/llama_bridge.py``): its key map (local and Transformer Engine
norm names both), ``QKVMapping`` (``split_qkv_weights``: Megatron's ``linear_qkv`` rows are, per
query group, its ``heads_per_group`` query heads, then one key head, then one value head, each
``head_dim`` rows; no RoPE permutation, Megatron's rotary embedding halves each head as HF's does)
and ``GatedMLPMapping`` (``linear_fc1`` is ``[gate; up]``). Megatron-Bridge maps a live model's
per-layer names (``decoder.layers.N.…``); a ``torch_dist`` checkpoint stores each of
``decoder.layers.*`` once, stacked on a leading layer dim (``TransformerBlock.sharded_state_dict``),
so layer ``N`` is that tensor's ``N``-th slice, read through a ``(layers * rows, ...)`` view.

``from_hf`` is the inverse (``hf-to-megatron-gpt``): each HF layer tensor a row segment of its
stacked Megatron tensor (``linear_qkv``'s per query group), so the mover copies bytes only
(``chunk_rows.segment_runs``). A ``torch_dist`` folder Megatron-Core 0.16.1's
``dist_checkpointing.load`` reads also holds what ``extra_state`` and ``checkpoint_files`` give
(``AdapterRecord.values`` and ``files``): one ``_extra_state`` bytes entry per layer module, and
``common.pt`` and ``metadata.json`` as a model-only ``dist_checkpointing.save`` writes them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_convert.adapters._common import config_int, heads, tied, warn_left_out
from fsdp_convert.derive import Derived, Gather, Input, Segment, TensorInfo, copy_of
from fsdp_convert.errors import UnsupportedTransformError
from fsdp_convert.transform.unstack import check_split

__all__ = ["TO_HF", "FROM_HF", "to_hf", "from_hf", "extra_state", "checkpoint_files"]

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
# the inverse of TO_HF: HF key (per layer: "model.layers.N.") -> Megatron key, norms under
# Transformer Engine's names, which Megatron's local layer spec saves them under too
# (get_gpt_layer_local_spec's sharded_state_dict_keys_map)
FROM_HF: dict[str, str] = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
_QKV_PARTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_FC1_PARTS = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# the layer modules whose ShardedObject Megatron saves (their get_extra_state: None, saved as [None])
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
# metadata.json as Megatron-Core 0.16.1's dist_checkpointing.save(..., ("torch_dist", 1)) writes it
MEGATRON_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


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


_Part = tuple[TensorInfo, int, int]  # (HF tensor, its first row, row count): a row segment of one layer's slice


def _stack(layers: Sequence[Sequence[_Part]]) -> Derived:
    """Each layer's parts joined on dim 0, the layers stacked: ``(layers, rows, ...)``, built as ``(layers * rows, ...)``.

    Every input is a ``Segment`` of the output's view in input order, so the mover copies bytes
    (``chunk_rows.segment_runs``); a 1-d tensor (a norm weight) stacks in a 1-d view of its elements.
    """
    first = layers[0][0][0]
    rows = sum(count for _, _, count in layers[0])
    inputs, at = [], 0
    for parts in layers:
        for info, src, count in parts:
            inputs.append(Input(fqn=info.fqn, rows=Segment(at, count, src)))
            at += count
    cols = first.shape[1:]
    return Derived(inputs=tuple(inputs), shape=(len(layers), rows, *cols), dtype=first.dtype, view=(len(layers) * rows, *cols))


def _alike(infos: Sequence[TensorInfo], what: str) -> TensorInfo:
    """The first of ``infos``, each checked to have its shape (not 0-dim) and dtype: tensors stacked or fused into one."""
    first = infos[0]
    for info in infos:
        if not info.shape or (info.shape, info.dtype) != (first.shape, first.dtype):
            raise UnsupportedTransformError(
                f"{info.fqn}: shape {info.shape} {info.dtype.name}, where {first.fqn} is {first.shape} {first.dtype.name}; "
                f"{what} needs one shape and dtype"
            )
    return first


def _qkv_parts(q: TensorInfo, k: TensorInfo, v: TensorInfo, n_heads: int, n_groups: int) -> list[_Part]:
    """One layer's ``linear_qkv`` rows: per query group its query heads' rows of ``q``, then its key head's, then its value's.

    Raises:
        UnsupportedTransformError: the rows do not split into ``n_heads`` query heads and
            ``n_groups`` key and value heads of one ``head_dim``, or the three differ in columns or dtype.
    """
    _alike((k, v), f"{LAYERS}{QKV}")
    if len(q.shape) != 2 or q.shape[1:] != k.shape[1:] or q.dtype != k.dtype:
        raise UnsupportedTransformError(
            f"{q.fqn}: shape {q.shape} {q.dtype.name} does not fuse with {k.fqn}'s {k.shape} {k.dtype.name} into {LAYERS}{QKV}"
        )
    hd = q.shape[0] // n_heads
    if n_heads % n_groups or q.shape[0] % n_heads or hd == 0 or k.shape[0] != n_groups * hd:
        raise UnsupportedTransformError(
            f"{q.fqn} ({q.shape[0]} rows) and {k.fqn} ({k.shape[0]} rows) do not split into {n_heads} query heads in "
            f"{n_groups} groups of one head_dim; check num_attention_heads / num_key_value_heads"
        )
    # inputs are made per group: bounded by the bytes held, whatever the shape claims ((10**9, 0) holds none)
    check_split(q.fqn, q.shape, q.dtype, n_groups, "query groups (num_key_value_heads)")
    per = n_heads // n_groups
    return [part for j in range(n_groups) for part in ((q, j * per * hd, per * hd), (k, j * hd, hd), (v, j * hd, hd))]


def from_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``hf-to-megatron-gpt``: ``LlamaForCausalLM``'s tensors to a Megatron-Core GPT's ``torch_dist`` model tensors.

    The inverse of ``to_hf`` (Megatron-Bridge 0.3.1's Llama mapping): each per-layer tensor stacked
    on a leading layer dim under Megatron's name (norms under Transformer Engine's), ``q_proj``,
    ``k_proj`` and ``v_proj`` fused into ``linear_qkv`` per query group (its query heads, its key
    head, its value head), ``gate_proj`` and ``up_proj`` into ``linear_fc1`` (``[gate; up]``);
    ``lm_head.weight`` left out when ``tie_word_embeddings`` (Megatron's shared output layer saves
    none). Every output is row segments of its inputs: bytes copied. Other tensors (``rotary_emb``
    buffers, biases a Llama has not) are left out with a warning.

    Args:
        tensors: an HF folder's tensors (``model.layers.0.self_attn.q_proj.weight``...).
        config: ``num_attention_heads``, ``num_key_value_heads`` (default: as many),
            ``num_hidden_layers``, ``tie_word_embeddings`` (HF ``config.json`` names).

    Raises:
        InvalidOptionError: no layer or head count in ``config``.
        UnsupportedTransformError: a tensor Megatron's GPT needs is missing (every layer's nine, the
            embedding, the final norm, the head when untied), a layer past ``num_hidden_layers``,
            layers of different shapes, or q/k/v whose rows do not split into those heads.
    """
    n_heads, n_groups = heads(config)
    layers = config_int(config, "num_hidden_layers", "num_layers")
    per_layer: dict[str, dict[int, TensorInfo]] = {}  # by HF name in a layer, by layer
    top: dict[str, TensorInfo] = {}
    left_out = []
    for info in tensors:
        match = _HF_LAYER.fullmatch(info.fqn)
        name = match[2] if match else info.fqn
        if match is None and name in FROM_HF:
            top[name] = info
        elif match is None or match[1] != str(int(match[1])) or name not in (*FROM_HF, *_QKV_PARTS, *_FC1_PARTS):
            left_out.append(info.fqn)
        elif int(match[1]) >= layers:
            raise UnsupportedTransformError(f"{info.fqn}: layer {match[1]}, but num_hidden_layers is {layers}")
        else:
            per_layer.setdefault(name, {})[int(match[1])] = info

    def each_layer(name: str) -> list[TensorInfo]:
        infos = per_layer.get(name, {})
        if len(infos) < layers:  # a count from the config: the first layer missing is at most len(infos)
            missing = next(n for n in range(layers) if n not in infos)
            raise UnsupportedTransformError(
                f"model.layers.{missing}.{name}: missing; Megatron's GPT needs it in each of {layers} layers"
            )
        found = [infos[n] for n in range(layers)]
        _alike(found, f"{LAYERS}{FROM_HF.get(name, name)} stacking {layers} layers")
        return found

    def whole(name: str) -> Derived:
        if name not in top:
            raise UnsupportedTransformError(f"{name}: missing; Megatron's GPT needs it as {FROM_HF[name]}")
        return copy_of(top[name])

    def plain(name: str) -> Derived:
        return _stack([[(info, 0, info.shape[0])] for info in each_layer(name)])

    qkv = [each_layer(name) for name in _QKV_PARTS]
    _qkv_parts(qkv[0][0], qkv[1][0], qkv[2][0], n_heads, n_groups)  # checks layer 0; the others have its shapes
    gate, up = (each_layer(name) for name in _FC1_PARTS)
    _alike((gate[0], up[0]), f"{LAYERS}{FC1}")
    out = {
        FROM_HF["model.embed_tokens.weight"]: whole("model.embed_tokens.weight"),
        LAYERS + FROM_HF["input_layernorm.weight"]: plain("input_layernorm.weight"),
        LAYERS + QKV: _stack([_qkv_parts(q, k, v, n_heads, n_groups) for q, k, v in zip(*qkv, strict=True)]),
        LAYERS + FROM_HF["self_attn.o_proj.weight"]: plain("self_attn.o_proj.weight"),
        LAYERS + FROM_HF["post_attention_layernorm.weight"]: plain("post_attention_layernorm.weight"),
        LAYERS + FC1: _stack([[(g, 0, g.shape[0]), (u, 0, u.shape[0])] for g, u in zip(gate, up, strict=True)]),
        LAYERS + FROM_HF["mlp.down_proj.weight"]: plain("mlp.down_proj.weight"),
        FROM_HF["model.norm.weight"]: whole("model.norm.weight"),
    }
    if not tied(config):
        out[FROM_HF["lm_head.weight"]] = whole("lm_head.weight")
    warn_left_out("hf-to-megatron-gpt", left_out)
    return out


def extra_state(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``_extra_state`` bytes entries of a Megatron GPT's layers, as ``dist_checkpointing.save`` stores them.

    One per layer module with one (``EXTRA_STATE_MODULES``) and layer ``n`` of ``L``
    (``num_hidden_layers``): ``decoder.layers.<module>._extra_state/shard_<n>_<L>``, the
    ``ShardedObject`` of the stacked layers, holding ``[None]`` (its modules' ``get_extra_state``
    in a list); Megatron's loader refuses a folder without them.

    Raises:
        InvalidOptionError: no ``num_hidden_layers``.
    """
    layers = config_int(config, "num_hidden_layers", "num_layers")
    return {f"{LAYERS}{module}._extra_state/shard_{n}_{layers}": [None] for n in range(layers) for module in EXTRA_STATE_MODULES}


def checkpoint_files(config: Mapping[str, Any]) -> dict[str, bytes]:
    """``common.pt`` and ``metadata.json`` as Megatron-Core 0.16.1's model-only ``dist_checkpointing.save`` writes them.

    ``common.pt``: ``torch.save({})`` (the state a model's sharded state dict leaves common: none),
    its bytes as torch.save writes them to a buffer; ``metadata.json``: its ``torch_dist`` backend
    and ``torch`` common backend, version 1 each, byte for byte. Neither depends on ``config``.
    """
    from fsdp_convert.writers.transaction import value_payload  # torch.save's bytes, without torch

    return {"common.pt": value_payload({}), "metadata.json": json.dumps(MEGATRON_METADATA).encode()}
