"""A tiny gpt-oss from torchtitan 0.3.0's own model code, sharded with FSDP2 on CPU ranks and saved with DCP.

Its ``debugmodel`` flavour shrunk: 2 layers (sliding-window and full attention, 4 query heads over
2 KV heads with biases and sinks, Q/K/V unfused (``fuse_qkv=False``: the fused ``wqkv`` saves as
the same ``wq``/``wk``/``wv`` through its state-dict hook, but ``get_model_state_dict`` cannot
resolve those names on it), an MoE of 4 experts with biases and a biased router). It is not
trained: gpt-oss attention needs its sinks' log-sum-exp, which only torchtitan's varlen (CUDA) and
FlexAttention backends give, and FlexAttention has no CPU backward. So each rank builds it under
the same seed with torchtitan's own ``init_weights``, ``fully_shard`` s it (per block, then the
root), ``dcp.save`` s ``get_model_state_dict`` and rank 0 writes the full state dict, gathered, as
the truth.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

GO_VOCAB, GO_DIM, GO_HEADS, GO_KV_HEADS, GO_HEAD_DIM, GO_LAYERS, GO_EXPERTS, GO_HIDDEN = 64, 16, 4, 2, 4, 2, 4, 12


def go_model_config() -> Any:
    """The tiny gpt-oss config, built as ``torchtitan.models.gpt_oss._debugmodel`` builds its own."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.gpt_oss import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        GptOssModel,
        _build_gptoss_layers,
        _make_gptoss_attn_config,
        _output_linear_init,
    )

    v, d = GO_VOCAB, GO_DIM
    rope = CosSinRoPE.Config(dim=GO_HEAD_DIM, max_seq_len=64, theta=150000.0)
    layers = _build_gptoss_layers(
        dim=d,
        n_layers=GO_LAYERS,
        hidden_dim=GO_HIDDEN,
        num_experts=GO_EXPERTS,
        top_k=2,
        load_balance_coeff=1e-3,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=rope,
    )
    for layer_id, layer in enumerate(layers):  # torchtitan's builder keeps 64 heads of 64; the same config, tiny
        attention = _make_gptoss_attn_config(
            dim=d,
            layer_id=layer_id,
            attn_backend="flex",
            n_heads=GO_HEADS,
            n_kv_heads=GO_KV_HEADS,
            head_dim=GO_HEAD_DIM,
            sliding_window_size=128 if layer_id % 2 == 0 else None,
            fuse_qkv=False,
            rope=rope,
        )
        layers[layer_id] = dataclasses.replace(layer, attention=attention)
    return GptOssModel.Config(
        vocab_size=v,
        dim=d,
        tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=d, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=v, param_init=_output_linear_init(d)),
        layers=layers,
    )


def go_build(seed: int) -> torch.nn.Module:
    """The tiny model on CPU, initialised by torchtitan's own ``init_weights`` under ``seed``."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = go_model_config().build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def go_run(rank: int, world_size: int, out: Path) -> None:
    """On each rank: the model under FSDP2, ``dcp.save`` to ``out/checkpoint``; rank 0 writes the
    model's full state dict, gathered, to ``out/truth.pt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = go_build(seed=4321)
    with torch.no_grad():  # expert_bias_E starts at zero; set it so a copy of the wrong tensor shows
        for layer in model.layers.values():
            layer.moe.expert_bias_E.copy_(torch.arange(GO_EXPERTS, dtype=torch.float32) / 8)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    dcp.save(get_model_state_dict(model), checkpoint_id=out / "checkpoint")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, out / "truth.pt")
