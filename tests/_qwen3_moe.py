"""A tiny Qwen3 MoE from torchtitan 0.3.0's own model code, trained with FSDP2 on CPU ranks and saved with DCP.

Its ``debugmodel_moe`` flavour shrunk: 2 MoE layers of 4 routed experts (top 2), each layer's
expert weights stacked ``(E, F, D)`` (``w1_EFD``, ``w3_EFD``) and ``(E, D, F)`` (``w2_EDF``),
Q/K/V unfused (``fuse_qkv=False``: the fused ``wqkv`` saves as the same
``wq``/``wk``/``wv`` through its state-dict hook, but ``get_model_state_dict`` cannot resolve those
names on it), GQA with q/k norms, untied ``lm_head``, SDPA for FlexAttention (no CPU backward).
Every dim is a multiple of 4 (fp32): ``torch._grouped_mm`` on CPU needs 16-byte strides. Each
rank trains 2 steps of AdamW on the same batch (``fully_shard`` per block, then the root),
``dcp.save`` s ``get_model_state_dict`` and rank 0 writes the full model state dict, gathered,
as the truth.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

QW_VOCAB, QW_DIM, QW_HEADS, QW_KV_HEADS, QW_HEAD_DIM, QW_LAYERS, QW_EXPERTS, QW_MOE_DIM, QW_SEQ = 64, 16, 4, 2, 4, 2, 4, 8, 8


def qw_model_config() -> Any:
    """The tiny Qwen3 MoE config, built as torchtitan's ``qwen3`` ``_debugmodel_moe`` builds its own."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    v, d = QW_VOCAB, QW_DIM
    config = Qwen3Model.Config(
        vocab_size=v,
        dim=d,
        norm=_qwen3_norm(d),
        tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=d, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=d, out_features=v, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=False,  # the fused wqkv saves as the same wq/wk/wv, but get_model_state_dict cannot resolve those
            n_layers=QW_LAYERS,
            dim=d,
            n_heads=QW_HEADS,
            n_kv_heads=QW_KV_HEADS,
            head_dim=QW_HEAD_DIM,
            moe_hidden_dim=QW_MOE_DIM,
            num_experts=QW_EXPERTS,
            top_k=2,
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=QW_HEAD_DIM, max_seq_len=64, theta=1000000.0),
            moe_comm_backend="standard",
        ),
    )
    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return config


def qw_hf_config() -> dict[str, Any]:
    """``Qwen3MoeConfig`` of the run's model."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": QW_VOCAB,
        "hidden_size": QW_DIM,
        "intermediate_size": QW_MOE_DIM,
        "moe_intermediate_size": QW_MOE_DIM,
        "num_hidden_layers": QW_LAYERS,
        "num_attention_heads": QW_HEADS,
        "num_key_value_heads": QW_KV_HEADS,
        "head_dim": QW_HEAD_DIM,
        "num_experts": QW_EXPERTS,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def qw_run(rank: int, world_size: int, out: Path) -> None:
    """On each rank: the model under FSDP2, 2 AdamW steps, ``dcp.save`` to ``out/checkpoint``;
    rank 0 writes the model's full state dict, gathered, to ``out/truth.pt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1234)
    with torch.device("meta"):
        model = qw_model_config().build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, QW_VOCAB, (2, QW_SEQ), generator=torch.Generator().manual_seed(7))
    for _ in range(2):
        model(tokens).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    dcp.save(get_model_state_dict(model), checkpoint_id=out / "checkpoint")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, out / "truth.pt")
