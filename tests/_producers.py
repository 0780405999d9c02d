"""Producer fixtures: one real training run per FSDP version, saved in each producer's DCP layout.

Every function runs on each rank of a gloo group (``tests._dist.run_ranks``) and writes, on rank 0,
``truth.pt`` with the full state dicts taken in the same run (``get_model_state_dict`` /
``get_optimizer_state_dict(full_state_dict=True)``), so each layout has its ground truth.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing, checkpoint_wrapper
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_convert._sample import Block, SampleConfig, Transformer

CFG = SampleConfig(vocab_size=37, dim=12, n_layers=2, steps=2)
TRUTH = "truth.pt"


def _batch(cfg: SampleConfig, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=gen)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor, vocab_size: int) -> float:
    """One AdamW step on ``tokens`` (next-token cross entropy); returns the loss."""
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, vocab_size), tokens[:, 1:].reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss.detach())


def _checkpointed_model(cfg: SampleConfig) -> Transformer:
    """The sample Transformer with activation checkpointing on each block's MLP: its own
    ``model.state_dict()`` then says ``layers.0.mlp._checkpoint_wrapped_module.0.weight``."""
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg)
    mlps = {id(layer.mlp) for layer in model.layers}
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: id(m) in mlps)
    return model


def fsdp2_layouts(rank: int, world_size: int, out: Path) -> None:
    """FSDP2 training, saved by torch's own writers and in the layouts of producers not run here.

    accelerate, Lightning Fabric and torchtitan checkpoints come from those frameworks' own save
    calls (tests/_frameworks.py). Layouts here:
    - ``wrapped``: ``{"model": torch.compile(model).state_dict(), "optim": ...}``: a compiled
      module's own state dict puts ``_orig_mod.`` before every key (activation checkpointing's
      wrapper removes its own name from state dicts; torch.compile's does not).
    - ``hf_storage``: the model state dict through torch's ``HuggingFaceStorageWriter``
      (``save_distributed=True``): per-rank safetensors shards, no ``.metadata``.
    - ``verl``: not DCP: per-rank ``torch.save`` of ``model.state_dict()`` (DTensors) and
      ``optim.state_dict()`` (id-keyed) as ``model_world_size_2_rank_{r}.pt`` / ``optim_...`` /
      ``extra_state_...``, as verl's FSDP checkpoint manager writes them: an imitation, as verl
      needs Ray and transformers>=5.5 (the test extra pins transformers<5) and saves from inside
      its Ray workers.

    ``truth.pt``: ``model`` and ``optim`` (full, FQN-keyed), and for the resume test the fixed
    ``batch`` every rank then trains on and the full ``next_model`` after that step.
    """
    cfg = CFG
    model = _checkpointed_model(cfg)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(cfg.steps):
        train_step(model, optim, _batch(cfg, 100 * step + rank), cfg.vocab_size)

    model_sd, optim_sd = get_state_dict(model, optim)
    # torch.compile wraps lazily (nothing compiles until a call), and its state dict says _orig_mod.
    dcp_save({"model": torch.compile(model).state_dict(), "optim": optim_sd}, checkpoint_id=out / "wrapped")
    dcp_save(model_sd, storage_writer=HuggingFaceStorageWriter(str(out / "hf_storage"), save_distributed=True))
    verl = out / "verl"
    verl.mkdir(exist_ok=True)
    torch.save(model.state_dict(), verl / f"model_world_size_{world_size}_rank_{rank}.pt")
    torch.save(optim.state_dict(), verl / f"optim_world_size_{world_size}_rank_{rank}.pt")
    torch.save({"lr_scheduler": {"last_epoch": cfg.steps}}, verl / f"extra_state_world_size_{world_size}_rank_{rank}.pt")

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # cloned: on CPU the "offloaded" state shares the live step tensors, which the next step bumps
    truth = _clone(
        {"model": get_model_state_dict(model, options=full), "optim": get_optimizer_state_dict(model, optim, options=full)}
    )
    batch = _batch(cfg, 999)  # the same on every rank: the data-parallel step equals one process's step
    train_step(model, optim, batch, cfg.vocab_size)
    next_model = get_model_state_dict(model, options=full)
    if rank == 0:
        torch.save({**truth, "batch": batch, "next_model": next_model}, out / TRUTH)
    dist.barrier()


def fsdp1_layouts(rank: int, world_size: int, out: Path) -> None:
    """FSDP1 training saved with ``SHARDED_STATE_DICT``: ``{"model": model.state_dict(), "optim":
    FSDP.optim_state_dict(model, optim)}``, once with ``use_orig_params=True`` and once with
    ``False`` (``orig_params_true/``, ``orig_params_false/``), as DCP (``checkpoint/``) and as
    per-rank torch.save files (``rank_files/model_rank_{r}.pt``, ``optim_rank_{r}.pt``), each with ``truth.pt`` from
    ``get_model_state_dict``/``get_optimizer_state_dict(full_state_dict=True)`` (no CPU offload:
    FSDP1's offloaded full optimizer state can reuse a gather buffer on this torch).

    Blocks are wrapped by their own FSDP unit and their MLPs by activation checkpointing, so the
    live module names carry ``_fsdp_wrapped_module.`` and ``_checkpoint_wrapped_module.``.
    """
    cfg = CFG
    for use_orig_params in (True, False):
        folder = out / f"orig_params_{str(use_orig_params).lower()}"
        model = FSDP(
            _checkpointed_model(cfg),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=torch.device("cpu"),
            use_orig_params=use_orig_params,
        )
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(cfg.steps):
            train_step(model, optim, _batch(cfg, 100 * step + rank), cfg.vocab_size)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp_save(state, checkpoint_id=folder / "checkpoint")
        rank_files = folder / "rank_files"  # the same state, torch.save rank by rank (ShardedTensor values)
        rank_files.mkdir(exist_ok=True)
        torch.save(state["model"], rank_files / f"model_rank_{rank}.pt")
        torch.save(state["optim"], rank_files / f"optim_rank_{rank}.pt")
        opts = StateDictOptions(full_state_dict=True)
        truth = {
            "model": _clone(get_model_state_dict(model, options=opts)),
            "optim": _clone(get_optimizer_state_dict(model, optim, options=opts)),
        }
        if rank == 0:
            torch.save(truth, folder / TRUTH)
        dist.barrier()


def _clone(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj
