"""A tiny gpt-oss from torchtitan 0.3.0's own model code, sharded with FSDP2 on CPU ranks and saved with DCP.

Its ``debugmodel`` flavour shrunk: 2 layers (sliding-window and full attention, 4 query heads over
2 KV heads with biases and sinks, Q/K/V unfused (``fuse_qkv=False``: the fused ``wqkv`` saves as
the same ``wq``/``wk``/``wv`` through its state-dict hook, but ``get_model_state_dict`` cannot
resolve those names on it), an MoE of 4 experts with biases and a biased router), its RoPE the
gpt-oss flavours' YaRN (factor 32 over 4096 positions) and a window of ``GO_WINDOW`` tokens, so a
short batch crosses it. Head dim 16, so that YaRN's interpolated frequencies turn by a radian within
128 tokens; expert hidden dim 16, as ``torch._grouped_mm`` wants 16-byte strides (12 bfloat16 are
24 bytes). It is not trained through its attention: gpt-oss attention needs its sinks'
log-sum-exp, which only torchtitan's varlen (CUDA) and FlexAttention backends give (torchtitan 0.3.0
offers no other ``attn_backend`` for gpt-oss), and FlexAttention has no CPU backward
("FlexAttention does not support backward on CPU"). So each rank builds it under the same seed with
torchtitan's own ``init_weights``, ``fully_shard`` s it (per block, then the root) and takes
``GO_STEPS`` AdamW steps on synthetic gradients (the same seeded full gradient on every rank, each
rank stepping its FSDP shard of it), so weights and optimizer state are not the initial ones. It
``dcp.save`` s the model state dict flattened at the top level with ``"optimizer"`` beside it (as
torchtitan's CheckpointManager lays them out), and rank 0 writes the truth: the full model and
optimizer state, gathered.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

GO_VOCAB, GO_DIM, GO_HEADS, GO_KV_HEADS, GO_HEAD_DIM, GO_LAYERS, GO_EXPERTS, GO_HIDDEN = 64, 16, 4, 2, 16, 2, 4, 16
GO_WINDOW, GO_STEPS = 4, 2
# gpt-oss's YaRN, as torchtitan's gpt-oss flavours (and the Hub's gpt-oss-20b config.json) set it
GO_YARN: dict[str, Any] = {
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 4096,
    "truncate": False,
}


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
    rope = CosSinRoPE.Config(
        dim=GO_HEAD_DIM,
        max_seq_len=128,
        theta=150000.0,
        scaling="yarn",
        rope_factor=GO_YARN["factor"],
        beta_fast=GO_YARN["beta_fast"],
        beta_slow=GO_YARN["beta_slow"],
        truncate=GO_YARN["truncate"],
        original_seq_len=GO_YARN["original_max_position_embeddings"],
    )
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
            sliding_window_size=GO_WINDOW if layer_id % 2 == 0 else None,
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
    """On each rank: the model under FSDP2, ``GO_STEPS`` AdamW steps on synthetic gradients, ``dcp.save``
    to ``out/checkpoint``; rank 0 writes ``out/truth.pt``: ``{"model": ..., "optim": ...}``, full, gathered."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    model = go_build(seed=4321)
    with torch.no_grad():  # expert_bias_E starts at zero; set it so a copy of the wrong tensor shows
        for layer in model.layers.values():
            layer.moe.expert_bias_E.copy_(torch.arange(GO_EXPERTS, dtype=torch.float32) / 8)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(77)
    for _ in range(GO_STEPS):  # synthetic gradients: no CPU backward through FlexAttention (module docstring)
        for param in model.parameters():
            assert isinstance(param, DTensor)
            full = torch.randn(param.shape, generator=generator)
            param.grad = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        optim.step()
        optim.zero_grad()
    titan_options = StateDictOptions(flatten_optimizer_state_dict=True)  # torchtitan's OptimizersContainer's
    state = {**get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim, options=titan_options)}
    dcp.save(state, checkpoint_id=out / "checkpoint")
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_model = get_model_state_dict(model, options=full_options)
    full_optim = get_optimizer_state_dict(model, optim, options=full_options)
    if rank == 0:
        torch.save({"model": _clone(full_model), "optim": _clone(full_optim)}, out / "truth.pt")


def _clone(value: Any) -> Any:
    """``value`` with every tensor cloned (nested dicts and lists as they are)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_clone(v) for v in value)
    return value
