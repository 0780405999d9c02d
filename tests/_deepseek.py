"""A tiny DeepSeek-V3 from torchtitan 0.3.0's own model code, trained with FSDP2 on CPU ranks and saved with DCP.

Its ``debugmodel`` flavour shrunk: 2 layers (a dense one, then an MoE one with 4 routed experts
and a shared expert), low-rank Q (``wq_a``/``wq_b``), MLA's ``wkv_a``/``wkv_b``, one MTP layer,
SDPA for FlexAttention (no CPU backward). Each rank trains 2 steps of AdamW on the same batch
(``fully_shard`` per block, then the root), ``dcp.save`` s ``get_model_state_dict`` and rank 0
writes the full model state dict, gathered, as the truth.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

DS_VOCAB, DS_DIM, DS_HEADS, DS_LAYERS, DS_EXPERTS, DS_SEQ = 64, 16, 2, 2, 4, 8


def ds_model_config(*, mtp_layers: int = 1) -> Any:
    """The tiny DeepSeek-V3 config, built as ``torchtitan.models.deepseek_v3._debugmodel`` builds its own."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
        _build_mtp_layers,
        _output_linear_init,
    )

    v, d, rope_dim = DS_VOCAB, DS_DIM, 4
    layers = _build_dsv3_layers(
        n_layers=DS_LAYERS,
        n_dense_layers=1,
        dim=d,
        n_heads=DS_HEADS,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=rope_dim,
        v_head_dim=4,
        mscale=0.70,
        dense_hidden_dim=24,
        moe_hidden_dim=16,
        num_experts=DS_EXPERTS,
        num_shared_experts=1,
        router_top_k=2,
        router_score_func="softmax",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=64, theta=10000.0),
    )
    config = DeepSeekV3Model.Config(
        vocab_size=v,
        dim=d,
        tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=d, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=v, param_init=_output_linear_init(d)),
        layers=layers,
        mtp_layers=_build_mtp_layers(layers[-1], dim=d, num_mtp_layers=mtp_layers),
    )
    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return config


def ds_build(seed: int) -> torch.nn.Module:
    """The tiny model on CPU, initialised by torchtitan's own ``init_weights`` under ``seed``."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = ds_model_config().build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def ds_run(rank: int, world_size: int, out: Path) -> None:
    """On each rank: the model under FSDP2, 2 AdamW steps, ``dcp.save`` to ``out/checkpoint``;
    rank 0 writes the model's full state dict, gathered, to ``out/truth.pt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = ds_build(seed=1234)
    for block in [*model.layers.values(), *model.mtp_layers]:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, DS_VOCAB, (2, DS_SEQ), generator=torch.Generator().manual_seed(7))
    for _ in range(2):
        outputs = model(tokens)
        loss = sum(o.float().pow(2).mean() for o in outputs)
        loss.backward()
        optim.step()
        optim.zero_grad()
    dcp.save(get_model_state_dict(model), checkpoint_id=out / "checkpoint")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, out / "truth.pt")
