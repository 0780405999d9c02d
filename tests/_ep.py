"""A tiny Qwen3 MoE trained by torchtitan 0.3.0's own Trainer with expert parallelism on CPU ranks.

The model is tests._qwen3_moe's (2 MoE layers, stacked ``(E, F, D)`` / ``(E, D, F)`` expert
weights), trained at 4 gloo ranks with ``expert_parallel_degree=2`` by torchtitan's own
``Trainer``: its ``parallelize_qwen3`` (``spmd_backend="full_dtensor"``) puts every weight but the
routed experts on the dense mesh (``dp_shard=4``) and the routed experts on the sparse mesh
``(efsdp=2, ep=2)``: EP cuts the expert dim (``Shard(0)`` on ``ep``), then FSDP2 cuts each EP
rank's experts again on ``efsdp``, on dim 0 while ``efsdp * ep <= E`` and on dim 1 beyond
(``apply_fsdp_to_decoder``). Tokens reach their experts through its ``AllToAllTokenDispatcher``
(all-to-all on gloo: EP trains on CPU as it is). Its AdamW ``OptimizersContainer`` with the MoE
load-balancing hook steps ``EP_STEPS`` times and its ``CheckpointManager`` saves ``step-N``; the
truth is the full model and optimizer state right after (``full_tensor()`` of each DTensor,
``get_optimizer_state_dict(full_state_dict=True)``).

``EP_RUNS``, one launch for both: ``experts4`` (4 experts: ranks hold one expert each, as
``(_StridedShard(0, sf=2), Shard(0))`` on ``(efsdp, ep)``: rank ``2 f + e`` holds expert
``2 e + f``) and ``experts2`` (2 experts: ``(Shard(1), Shard(0))``, rank ``2 f + e`` holds half
of expert ``e``'s rows on dim 1).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests._qwen3_moe import (
    QW_DIM,
    QW_HEAD_DIM,
    QW_HEADS,
    QW_KV_HEADS,
    QW_LAYERS,
    QW_MOE_DIM,
    QW_SEQ,
    QW_VOCAB,
    qw_hf_config,
    qw_model_config,
)

EP_WORLD_SIZE, EP_DEGREE, EP_STEPS = 4, 2, 2
EP_RUNS = {"experts4": 4, "experts2": 2}
"""Each run's folder under the launch's ``out`` and its experts per MoE layer."""
EP_CKPT, EP_TRUTH = f"checkpoint/step-{EP_STEPS}", "truth.pt"


def ep_model_config(num_experts: int) -> Any:
    """tests._qwen3_moe's model config with ``num_experts`` routed experts per MoE layer (top 2)."""
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers

    config = qw_model_config()
    layers = _build_qwen3_moe_layers(
        n_layers=QW_LAYERS,
        dim=QW_DIM,
        n_heads=QW_HEADS,
        n_kv_heads=QW_KV_HEADS,
        head_dim=QW_HEAD_DIM,
        moe_hidden_dim=QW_MOE_DIM,
        num_experts=num_experts,
        top_k=2,
        attn_backend="flex",
        rope=config.layers[0].attention.rope,
        moe_comm_backend="standard",
    )
    for layer, other in zip(config.layers, layers, strict=True):
        layer.moe = other.moe  # only the MoE differs from tests._qwen3_moe's
    return config


def ep_hf_config(num_experts: int) -> dict[str, Any]:
    """``Qwen3MoeConfig`` of ``ep_model_config(num_experts)``."""
    return {**qw_hf_config(), "num_experts": num_experts}


def ep_batch(seed: int) -> torch.Tensor:
    """``(2, QW_SEQ + 1)`` random tokens: a data-parallel rank's batch, inputs and shifted labels."""
    return torch.randint(0, QW_VOCAB, (2, QW_SEQ + 1), generator=torch.Generator().manual_seed(seed))


def ep_trainer(rank: int, folder: Path, *, seed: int, num_experts: int, batches: Callable[[int], torch.Tensor] | None) -> Any:
    """torchtitan's own ``Trainer`` for the tiny Qwen3 MoE with ``num_experts`` experts per layer on
    CPU, expert-parallel of degree ``EP_DEGREE`` (``spmd_backend="full_dtensor"``, its
    ``parallelize_qwen3``), with its ``CheckpointManager`` under ``folder/checkpoint`` (interval
    ``EP_STEPS``, model and optimizer) and its MoE load-balancing hook
    (``tests._frameworks.build_titan_trainer``). Only the data are ours: a loader of
    ``batches(100 * batch_index + dp_rank)`` (``None``: a trainer that only loads)."""
    from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook
    from torchtitan.models.qwen3 import parallelize_qwen3

    from tests._frameworks import build_titan_trainer

    return build_titan_trainer(
        rank,
        folder,
        seed=seed,
        batches=batches,
        spec={
            "name": "qwen3",
            "flavor": "tiny_moe",
            "model": ep_model_config(num_experts),
            "post_optimizer_build_fn": register_moe_load_balancing_hook,
        },
        parallelize_fn=parallelize_qwen3,
        vocab=QW_VOCAB,
        seq_len=QW_SEQ,
        steps=EP_STEPS,
        parallelism={"expert_parallel_degree": EP_DEGREE},
    )


def ep_full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The full model (its own state dict, each DTensor's ``full_tensor()``) and optimizer state
    (``get_optimizer_state_dict(full_state_dict=True)``), cloned; called on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from tests._producers import _clone

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return _clone(
        {
            "model": {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()},
            "optim": get_optimizer_state_dict(model, optim, options=full),
        }
    )


def ep_run(rank: int, world_size: int, out: Path) -> None:
    """On each rank, for each of ``EP_RUNS``: ``ep_trainer`` trains ``EP_STEPS`` steps and saves
    ``out/<run>/checkpoint/step-N``; rank 0 writes the full state right after to
    ``out/<run>/truth.pt`` (``"model"``, ``"optim"``), with each expert weight's mesh dim names and
    placements (``"placements"``: FQN to ``(names, [str(placement), ...])``)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for name, num_experts in EP_RUNS.items():
        trainer = ep_trainer(rank, out / name, seed=0, num_experts=num_experts, batches=ep_batch)
        trainer.train()
        model = trainer.model_parts[0]
        for block in model.layers.values():  # the tokens went to their experts by all-to-all over EP ranks
            assert block.moe.routed_experts.token_dispatcher.ep_mesh.size() == EP_DEGREE
        truth = ep_full_state(model, trainer.optimizers.optimizers[0])
        experts = {k: v for k, v in model.state_dict().items() if "inner_experts" in k and isinstance(v, DTensor)}
        truth["placements"] = {k: (v.device_mesh.mesh_dim_names, [str(p) for p in v.placements]) for k, v in experts.items()}
        if rank == 0:
            torch.save(truth, out / name / EP_TRUTH)
        dist.barrier()
        trainer.close()


def ep_load(rank: int, world_size: int, sources: dict[str, Path], truth_root: Path) -> None:
    """What a torchtitan job resumed at this world size does, for each of ``sources`` (an ``EP_RUNS``
    name to a folder holding ``checkpoint/step-N``): ``ep_trainer`` (EP ``EP_DEGREE`` again, over
    ``world_size`` ranks: another cut of the experts) from another seed, its
    ``checkpointer.load()``; every rank then holds the run's step, and rank 0 compares the full
    model and optimizer state with the run's ``truth.pt``, bit for bit."""
    from tests._compare import assert_same_state

    for name, folder in sources.items():
        trainer = ep_trainer(rank, folder, seed=4321, num_experts=EP_RUNS[name], batches=None)
        model = trainer.model_parts[0]
        before = ep_full_state(model, trainer.optimizers.optimizers[0])
        assert trainer.checkpointer.load(), f"{name}: CheckpointManager found nothing to load"
        assert trainer.step == EP_STEPS
        got = ep_full_state(model, trainer.optimizers.optimizers[0])
        trainer.close()
        if rank != 0:
            continue
        truth = torch.load(truth_root / name / EP_TRUTH, weights_only=True)
        experts = "layers.0.moe.routed_experts.inner_experts.w1_EFD"
        assert not torch.equal(before["model"][experts], truth["model"][experts]), "the seed gave the run's experts"
        for optim in (got["optim"], truth["optim"]):  # torchtitan's load rebuilds each group in its own key order
            optim["param_groups"] = [dict(sorted(group.items())) for group in optim["param_groups"]]
        want = {"model": truth["model"], "optim": truth["optim"]}
        assert assert_same_state(got, want) == len(truth["model"]) + 3 * len(truth["optim"]["state"])
