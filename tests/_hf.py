"""A tiny Hugging Face causal LM trained with FSDP2 on CPU ranks, saved with DCP (no download)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import fully_shard

EVAL = "eval.pt"


def tiny_llama_config(tie: bool):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=97,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )


def train_llama(rank: int, world_size: int, out: Path) -> None:
    """For untied and tied embeddings: 2 AdamW steps with FSDP2, ``dcp.save({"model", "optim"})``
    of ``get_state_dict`` into ``<out>/<tied|untied>/checkpoint``; rank 0 writes ``config.json``
    (``save_pretrained``) and ``eval.pt``: a fixed batch and the trained model's logits on it."""
    from transformers import LlamaForCausalLM

    for tie in (False, True):
        folder = out / ("tied" if tie else "untied")
        cfg = tiny_llama_config(tie)
        torch.manual_seed(1234)
        model = LlamaForCausalLM(cfg)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batch = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            model(input_ids=batch, labels=batch).loss.backward()
            optim.step()
            optim.zero_grad()
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder / "checkpoint")
        eval_ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(99))
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=eval_ids).logits
        if rank == 0:
            cfg.save_pretrained(folder)
            torch.save({"input_ids": eval_ids, "logits": logits.detach().clone()}, folder / EVAL)
        dist.barrier()
