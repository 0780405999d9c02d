"""A tiny DeepSeek-V3 from torchtitan 0.3.0's own model code, trained with FSDP2 on CPU ranks and saved with DCP.

Its ``debugmodel`` flavour shrunk: 2 layers (a dense one, then an MoE one with 4 routed experts
and a shared expert), low-rank Q (``wq_a``/``wq_b``), MLA's ``wkv_a``/``wkv_b``, one MTP layer,
SDPA for FlexAttention (no CPU backward). The router is Hugging Face ``DeepseekV3TopkRouter``'s
(``HF_ROUTING``): sigmoid scores plus ``expert_bias_E`` to choose, one expert group (more would
balance this batch so well that the bias update undoes itself), the top 2 of the unbiased scores
renormalised and scaled by 2.5; every RMSNorm's eps is 1e-6 (HF fixes ``q_a_layernorm``'s and
``kv_a_layernorm``'s there), so the exported model computes what this one does. Each rank trains 2 steps of AdamW on the same
batch (``fully_shard`` per block, then the root), with torchtitan's load-balancing update of
``expert_bias_E`` before each step, ``dcp.save`` s ``get_model_state_dict`` and rank 0 writes the
full model state dict, gathered, as the truth.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

DS_VOCAB, DS_DIM, DS_HEADS, DS_LAYERS, DS_EXPERTS, DS_SEQ = 64, 16, 2, 2, 4, 8
DS_NORM_EPS = 1e-6
HF_ROUTING = {"n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5}
""":class:`DeepseekV3Config`'s routing keys for the router of ``ds_model_config``."""


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
        router_score_func="sigmoid",
        router_num_expert_groups=HF_ROUTING["n_group"],
        router_num_limited_groups=HF_ROUTING["topk_group"],
        router_route_norm=HF_ROUTING["norm_topk_prob"],
        router_route_scale=HF_ROUTING["routed_scaling_factor"],
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
    for _, norm, _, _ in list(config.traverse(RMSNorm.Config)):
        norm.eps = DS_NORM_EPS
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


def _update_expert_bias(model: torch.nn.Module) -> None:
    """torchtitan's optimizer step pre-hook for its MoE layers (``build_optimizers_with_moe_load_balancing``):
    ``expert_bias_E`` moves by ``load_balance_coeff * sign(mean - tokens_per_expert)``, centred; every
    rank routes the same batch, so each one's own counts give the sign the hook's all-reduce gives."""
    with torch.no_grad():
        for block in model.layers.values():
            if block.moe_enabled:
                moe = block.moe
                tokens = moe.tokens_per_expert_E.float()
                delta = moe.load_balance_coeff * torch.sign(tokens.mean() - tokens)
                moe.expert_bias_E.add_(delta - delta.mean())
                moe.tokens_per_expert_E.zero_()


def _shard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in [*model.layers.values(), *model.mtp_layers]:
        fully_shard(block)
    fully_shard(model)


def ds_fp32_experts(model: torch.nn.Module) -> None:
    """Make ``model``'s routed experts compute in fp32. torchtitan 0.3.0's ``GroupedExperts.forward``
    casts tokens and expert weights to bf16 for its grouped matmuls whatever the model's dtype; this
    is the same SwiGLU, expert by expert over the same expert-sorted tokens, without the casts."""
    import types

    import torch.nn.functional as F

    def forward(experts: Any, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        parts = x_RD.split([int(n) for n in num_tokens_per_expert_E.tolist()])
        weights = zip(parts, experts.w1_EFD, experts.w3_EFD, experts.w2_EDF, strict=True)
        return torch.cat([(F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T for x, w1, w3, w2 in weights])

    for block in model.layers.values():
        if block.moe_enabled:
            inner = block.moe.routed_experts.inner_experts
            inner.forward = types.MethodType(forward, inner)


def ds_run(rank: int, world_size: int, out: Path) -> None:
    """On each rank: the model under FSDP2, 2 AdamW steps, ``dcp.save`` to ``out/checkpoint``;
    rank 0 writes the model's full state dict, gathered, to ``out/truth.pt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = ds_build(seed=1234)
    _shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, DS_VOCAB, (2, DS_SEQ), generator=torch.Generator().manual_seed(7))
    for _ in range(2):
        outputs = model(tokens)
        loss = sum(o.float().pow(2).mean() for o in outputs)
        loss.backward()
        _update_expert_bias(model)
        optim.step()
        optim.zero_grad()
    dcp.save(get_model_state_dict(model), checkpoint_id=out / "checkpoint")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, out / "truth.pt")


def ds_load(rank: int, world_size: int, checkpoint: Path, truth_path: Path, work: Path) -> None:
    """On each rank: a fresh model (another seed) under FSDP2 as ``ds_run`` shards it, loaded by
    torchtitan's own ``CheckpointManager`` from ``checkpoint`` as its ``initial_load_path``
    (model only, the way a run starts from a converted checkpoint); then every tensor of the
    model's state dict, gathered, must equal the truth's, dtype and bits, experts included."""
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpoint import CheckpointManager

    def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}

    truth = torch.load(truth_path, weights_only=True)
    model = ds_build(seed=4321)
    _shard(model)
    before = full(model)
    experts = "layers.1.moe.routed_experts.inner_experts.w1_EFD"
    assert not torch.equal(before[experts], truth[experts]), "the fresh model already holds the run's experts"
    config = CheckpointManager.Config(enable=True, initial_load_path=str(checkpoint), initial_load_model_only=True)
    parts = {"dataloader": None, "optimizers": None, "lr_schedulers": None, "states": {}, "sd_adapter": None}
    manager = config.build(model_parts=[model], base_folder=str(work), **parts)
    assert manager.load(), "CheckpointManager found nothing to load"
    got = full(model)
    assert sorted(got) == sorted(truth)
    for key, tensor in truth.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), f"rank {rank}: {key}"
    manager.close()
