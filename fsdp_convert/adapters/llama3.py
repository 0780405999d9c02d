"""torchtitan's Llama 3 and Hugging Face's ``LlamaForCausalLM``: key map and Q/K RoPE permutation, both ways.

Follows torchtitan 0.3.0's ``torchtitan/models/llama3/state_dict_adapter.py``
(``Llama3StateDictAdapter.to_hf`` / ``from_hf``): its ``from_hf_map``, ``_permute`` of ``wq`` with
``n_heads`` and of ``wk`` with ``n_kv_heads`` (torchtitan keeps RoPE's pairs interleaved, HF
splits each head in halves), and weight tying (``lm_head.weight`` left out when tied). Besides
0.3.0's names (``layers.N.attention.qkv_linear.wq.weight``, which its fused ``wqkv`` module's save
hook writes), ``to_hf`` reads the earlier releases' ``layers.N.attention.wq.weight`` and
``output.weight``, and a fused ``layers.N.attention.qkv_linear.wqkv.weight`` saved without that
hook (rows grouped per KV head: ``n_heads // n_kv_heads`` query heads, one key, one value head).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_convert.adapters._common import abstract_key, heads, moved, rope_rows, tied, warn_left_out
from fsdp_convert.derive import Derived, Gather, TensorInfo
from fsdp_convert.errors import UnsupportedTransformError
from fsdp_convert.transform.unstack import check_split

__all__ = ["FROM_HF", "to_hf", "from_hf"]

# torchtitan 0.3.0 Llama3StateDictAdapter.from_hf_map (HF key -> torchtitan key; None: dropped)
FROM_HF: dict[str, str | None] = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.qkv_linear.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.qkv_linear.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.qkv_linear.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
TO_HF = {v: k for k, v in FROM_HF.items() if v is not None}
# torchtitan before 0.3 (attention.wq without qkv_linear; the output projection named output)
LEGACY = {
    "layers.{}.attention.wq.weight": TO_HF["layers.{}.attention.qkv_linear.wq.weight"],
    "layers.{}.attention.wk.weight": TO_HF["layers.{}.attention.qkv_linear.wk.weight"],
    "layers.{}.attention.wv.weight": TO_HF["layers.{}.attention.qkv_linear.wv.weight"],
    "output.weight": "lm_head.weight",
}
FUSED = "layers.{}.attention.qkv_linear.wqkv.weight"
_Q, _K = ("model.layers.{}.self_attn.q_proj.weight", "model.layers.{}.self_attn.k_proj.weight")


def _fused_split(info: TensorInfo, layer: str, n_heads: int, n_kv: int) -> dict[str, Derived]:
    """HF's q/k/v projections of a fused ``wqkv`` (``FusedQKVLinear``'s row order), Q and K permuted."""
    per_kv = n_heads // n_kv
    rows = info.shape[0] if info.shape else 0
    if len(info.shape) != 2 or n_heads % n_kv or rows % (n_kv * (per_kv + 2)):
        raise UnsupportedTransformError(f"{info.fqn}: shape {info.shape} is not a fused wqkv of {n_heads} heads, {n_kv} KV heads")
    check_split(info.fqn, info.shape, info.dtype, rows, "rows")  # each listed below: bounded by the bytes held
    hd = rows // (n_kv * (per_kv + 2))
    group = (per_kv + 2) * hd
    q = [g * group + j for g in range(n_kv) for j in range(per_kv * hd)]
    k = [g * group + per_kv * hd + j for g in range(n_kv) for j in range(hd)]
    v = [g * group + (per_kv + 1) * hd + j for g in range(n_kv) for j in range(hd)]
    return {
        _Q.format(layer): moved(info, rope_rows(info, n_heads, to_hf=True, rows_from=q), rows_count=len(q)),
        _K.format(layer): moved(info, rope_rows(info, n_kv, to_hf=True, rows_from=k), rows_count=len(k)),
        f"model.layers.{layer}.self_attn.v_proj.weight": moved(info, Gather(tuple(v)), rows_count=len(v)),
    }


def to_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``torchtitan-llama3-to-hf``: a torchtitan Llama 3 model's tensors to ``LlamaForCausalLM``'s.

    As torchtitan 0.3.0's ``Llama3StateDictAdapter.to_hf``: keys mapped, ``q_proj`` rows permuted
    for ``num_attention_heads`` heads and ``k_proj`` for ``num_key_value_heads``, ``lm_head.weight``
    left out when ``tie_word_embeddings``; other tensors are left out (with a warning).

    Args:
        tensors: the model's tensors (``layers.N.attention.qkv_linear.wq.weight``...).
        config: ``num_attention_heads``, ``num_key_value_heads`` (default: as many),
            ``tie_word_embeddings`` (HF ``config.json`` names; torchtitan's ``n_heads``,
            ``n_kv_heads``, ``enable_weight_tying`` also do).

    Raises:
        InvalidOptionError: no head count in ``config``.
        UnsupportedTransformError: a Q/K weight whose rows do not split into those heads.
    """
    n_heads, n_kv = heads(config)
    out: dict[str, Derived] = {}
    left_out = []
    for info in tensors:
        abstract, numbers = abstract_key(info.fqn)
        layer = numbers[0] if numbers else ""
        if abstract == FUSED:
            out.update(_fused_split(info, layer, n_heads, n_kv))
            continue
        hf = TO_HF.get(abstract) or LEGACY.get(abstract)
        if hf is None:
            left_out.append(info.fqn)
            continue
        if hf == "lm_head.weight" and tied(config):
            continue  # tied to embed_tokens: HF's model ties it back
        rows = None
        if hf == _Q:
            rows = rope_rows(info, n_heads, to_hf=True)
        elif hf == _K:
            rows = rope_rows(info, n_kv, to_hf=True)
        out[hf.format(layer)] = moved(info, rows)
    warn_left_out("torchtitan-llama3-to-hf", left_out)
    return out


def from_hf(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """``hf-to-torchtitan-llama3``: ``LlamaForCausalLM``'s tensors to torchtitan 0.3.0's Llama 3 model's.

    As torchtitan 0.3.0's ``Llama3StateDictAdapter.from_hf``: keys mapped (to
    ``layers.N.attention.qkv_linear.wq.weight``..., which its fused ``wqkv`` module's load hook
    joins), Q/K rows permuted back, ``rotary_emb.inv_freq`` dropped, and with
    ``tie_word_embeddings`` and no ``lm_head.weight``, ``lm_head.weight`` a copy of the embedding.

    Args:
        tensors: an HF folder's tensors (``model.layers.N.self_attn.q_proj.weight``...).
        config: as for ``to_hf``.

    Raises:
        InvalidOptionError: no head count in ``config``.
        UnsupportedTransformError: a key torchtitan's map does not know (naming it), or a Q/K weight
            whose rows do not split into the heads.
    """
    n_heads, n_kv = heads(config)
    out: dict[str, Derived] = {}
    names = {info.fqn for info in tensors}
    for info in tensors:
        abstract, numbers = abstract_key(info.fqn)
        if abstract not in FROM_HF:
            raise UnsupportedTransformError(f"{info.fqn}: not a Llama weight torchtitan's Llama3StateDictAdapter maps")
        titan = FROM_HF[abstract]
        if titan is None:
            continue
        rows = None
        if abstract == _Q:
            rows = rope_rows(info, n_heads, to_hf=False)
        elif abstract == _K:
            rows = rope_rows(info, n_kv, to_hf=False)
        out[titan.format(*numbers)] = moved(info, rows)
    embed = next((t for t in tensors if t.fqn == "model.embed_tokens.weight"), None)
    if tied(config) and "lm_head.weight" not in names and embed is not None:
        out["lm_head.weight"] = moved(embed)
    return out
