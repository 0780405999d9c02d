"""A tiny Hugging Face Llama with a PEFT LoRA adapter, trained with FSDP2 on CPU ranks, saved with DCP.

Ground truth comes from the same run: rank 0 gathers the full state dict into an unsharded
PeftModel and records its logits, ``save_pretrained`` of the adapter, and ``merge_and_unload()``'s
state dict and logits on fixed tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import fully_shard

from tests._hf import tiny_llama_config

TRUTH = "truth.pt"  # {"input_ids", "logits" (FSDP PeftModel), "peft_logits", "merged_logits", "merged"}
ADAPTER = "adapter"  # PeftModel.save_pretrained's folder
BASE = "base"  # the untrained base model, save_pretrained (config.json + weights)
LORA_R, LORA_ALPHA, TARGETS = 4, 8, ("q_proj", "v_proj")


def lora_config():  # type: ignore[no-untyped-def]
    """The adapter's config; ``init_lora_weights=False`` starts lora_B random, so B @ A != 0 from the start."""
    from peft import LoraConfig

    return LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=list(TARGETS), init_lora_weights=False)


def base_model():  # type: ignore[no-untyped-def]
    """The base LlamaForCausalLM, seeded: every rank and the test build the same one."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(1234)
    return LlamaForCausalLM(tiny_llama_config(False))


def peft_model():  # type: ignore[no-untyped-def]
    """``get_peft_model(base_model(), lora_config())``, seeded: every rank builds the same one."""
    from peft import get_peft_model

    model = base_model()
    torch.manual_seed(4321)
    return get_peft_model(model, lora_config())


def train_lora(rank: int, world_size: int, out: Path) -> None:
    """2 AdamW steps of the adapter (base frozen) under FSDP2; ``dcp.save({"model", "optim"})`` of
    ``get_state_dict`` into ``<out>/checkpoint``. Rank 0 writes ``<out>/base`` (the base model's
    ``save_pretrained``), ``<out>/adapter`` (the trained PeftModel's ``save_pretrained``) and
    ``<out>/truth.pt``."""
    model = peft_model()
    vocab = model.config.vocab_size
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model(input_ids=batch, labels=batch).loss.backward()
        optim.step()
        optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out / "checkpoint")
    eval_ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(99))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=eval_ids).logits.detach().clone()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        base_model().save_pretrained(out / BASE)
        plain = peft_model()
        plain.load_state_dict(full)
        plain.eval()
        plain.save_pretrained(out / ADAPTER)
        with torch.no_grad():
            peft_logits = plain(input_ids=eval_ids).logits
            merged = plain.merge_and_unload()
            merged_logits = merged(input_ids=eval_ids).logits
        truth = {
            "input_ids": eval_ids,
            "logits": logits,
            "peft_logits": peft_logits,
            "merged_logits": merged_logits,
            "merged": {k: v.clone() for k, v in merged.state_dict().items()},
        }
        torch.save(truth, out / TRUTH)
    dist.barrier()
