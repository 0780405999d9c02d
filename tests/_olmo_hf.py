"""An HF ``Olmo2ForCausalLM`` folder made by transformers, and OLMo-core 3.0.0 loading its conversion at M ranks.

``save_hf`` builds the model transformers' way from ``tests._olmo``'s sizes (the ``Olmo2Config`` of
OLMo-core's tiny OLMo-2 model, ``_olmo.hf_config``), random weights from a seed, every norm weight
drawn at random too (transformers initialises them to ones, which would hide a norm swapped for
another), and ``save_pretrained`` writes the folder.

``olmo_load_model`` runs on every rank (``tests._dist.run_ranks``, forked gloo ranks): OLMo-core's
``TransformerTrainModule`` (its FSDP2 ``parallelize_model``) around a freshly initialised model,
then OLMo-core's own ``load_model_and_optim_state`` of a DCP folder into the model alone; rank 0
checks the model then holds ``want`` (a ``torch.save`` of an OLMo-core model state dict) bit for bit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests import _olmo
from tests._compare import assert_same_state

HF_SEED = 77


def hf_config(*, tie: bool = False) -> dict[str, Any]:
    """``_olmo.hf_config()`` (OLMo-core's tiny OLMo-2 model as an ``Olmo2Config``), its special tokens inside the vocabulary."""
    return {**_olmo.hf_config(), "tie_word_embeddings": tie, "pad_token_id": 1, "eos_token_id": 2, "bos_token_id": None}


def save_hf(folder: Path, *, tie: bool = False, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """transformers' ``Olmo2ForCausalLM`` of ``hf_config(tie=tie)``, random weights (norms too) in ``dtype``, saved to ``folder``.

    Returns:
        The model's ``state_dict()`` (cloned): with ``tie``, ``lm_head.weight`` is the embedding,
        which ``save_pretrained`` leaves out of the folder.
    """
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(HF_SEED)
    model = Olmo2ForCausalLM(Olmo2Config(**hf_config(tie=tie)))
    gen = torch.Generator().manual_seed(HF_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
    model.to(dtype=dtype)  # type: ignore[call-arg]  # transformers types its to() wrapper oddly
    model.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["model_type"] == "olmo2" and saved["tie_word_embeddings"] is tie
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def olmo_load_model(rank: int, world_size: int, model_dir: Path, want_path: Path) -> None:
    """OLMo-core's ``load_model_and_optim_state(model_dir, model)`` at ``world_size`` ranks (FSDP2); rank 0 checks the model.

    ``model_dir`` is the DCP folder OLMo-core reads (a step folder's ``model_and_optim/``); only the
    model is loaded (``optim`` None), strictly, as OLMo-core loads converted weights.
    """
    from olmo_core.distributed.checkpoint import load_model_and_optim_state

    os.environ["OLMO_SHARED_FS"] = "1"  # the ranks share this machine's filesystem (OLMo-core asks to be told)
    train_module = _olmo._train_module(_olmo.LOAD_SEED)  # FSDP2 over the ranks, freshly initialised
    before = _olmo.full_state(train_module)["model"]
    load_model_and_optim_state(model_dir, train_module.model)
    got = _olmo.full_state(train_module)["model"]
    if rank == 0:
        want = torch.load(want_path, weights_only=True)
        assert not torch.equal(before["embeddings.weight"], want["embeddings.weight"])  # the load changed the model
        assert assert_same_state(dict(sorted(got.items())), dict(sorted(want.items()))) == len(want)
    dist.barrier()
