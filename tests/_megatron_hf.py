"""An HF ``LlamaForCausalLM`` folder made by transformers, and Megatron-Core 0.16.1 loading its conversion at TP=1 and TP=2.

``save_hf`` builds the model transformers' way from ``tests._megatron``'s sizes (its ``hf_config``:
4 query heads in 2 groups, so GQA, and TP=2 splits the groups), random weights from a seed, every
norm weight drawn at random too (transformers initialises them to ones, which would hide a norm
filed as another), and ``save_pretrained`` writes the folder.

``megatron_state`` is the Megatron checkpoint the HF weights make under Megatron-Bridge's Llama
mapping, written out here in plain torch (not with the adapter's rules): layers stacked, each
``linear_qkv`` per query group (its query heads, its key head, its value head), ``linear_fc1``
``[gate; up]``, the norms under Transformer Engine's names.

``megatron_load`` runs on every rank (``tests._dist.run_ranks``, forked gloo ranks): for each
``(checkpoint, tied, out)`` job, Megatron's ``GPTModel`` (``tests._megatron``'s local layer spec,
tensor parallel = the world size, the embedding shared with the output layer when tied),
``dist_checkpointing.load(model.sharded_state_dict(), checkpoint)``, a strict
``load_state_dict``; rank 0 writes ``out``: the model's full tensors put together from every
rank's shards (in the checkpoint's keys, with each one's global shape) and, at TP=1, each module's
weight under the ``LlamaForCausalLM`` name it plays as Megatron's own forward splits it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests import _megatron

HF_SEED = 91
LAYERS = "decoder.layers."


def hf_config(*, tie: bool = False) -> dict[str, Any]:
    """``_megatron.hf_config()`` (the Megatron tests' model as a ``LlamaConfig``), tied or not."""
    return {**_megatron.hf_config(), "tie_word_embeddings": tie}


def save_hf(folder: Path, *, tie: bool = False) -> dict[str, torch.Tensor]:
    """transformers' ``LlamaForCausalLM`` of ``hf_config(tie=tie)``, random weights (norms too), saved to ``folder``.

    Returns:
        The model's ``state_dict()`` (cloned).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(HF_SEED + tie)
    model = LlamaForCausalLM(LlamaConfig(**hf_config(tie=tie)))
    gen = torch.Generator().manual_seed(HF_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is tie
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def megatron_state(hf: dict[str, torch.Tensor], *, tie: bool = False) -> dict[str, torch.Tensor]:
    """The Megatron ``torch_dist`` model tensors ``hf`` maps to (Megatron-Bridge's Llama mapping), in plain torch."""
    cfg = hf_config(tie=tie)
    n_heads, n_groups, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    per = n_heads // n_groups

    def qkv(n: int) -> torch.Tensor:
        p = f"model.layers.{n}.self_attn."
        q = hf[p + "q_proj.weight"].reshape(n_groups, per, -1, hf[p + "q_proj.weight"].shape[1])
        k = hf[p + "k_proj.weight"].reshape(n_groups, 1, -1, q.shape[-1])
        v = hf[p + "v_proj.weight"].reshape(n_groups, 1, -1, q.shape[-1])
        return torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])

    def stack(per_layer: Any) -> torch.Tensor:
        return torch.stack([per_layer(n) for n in range(layers)])

    def layer(name: str) -> Any:
        return lambda n: hf[f"model.layers.{n}.{name}"]

    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        f"{LAYERS}self_attention.linear_qkv.layer_norm_weight": stack(layer("input_layernorm.weight")),
        f"{LAYERS}self_attention.linear_qkv.weight": stack(qkv),
        f"{LAYERS}self_attention.linear_proj.weight": stack(layer("self_attn.o_proj.weight")),
        f"{LAYERS}mlp.linear_fc1.layer_norm_weight": stack(layer("post_attention_layernorm.weight")),
        f"{LAYERS}mlp.linear_fc1.weight": stack(
            lambda n: torch.cat([hf[f"model.layers.{n}.mlp.gate_proj.weight"], hf[f"model.layers.{n}.mlp.up_proj.weight"]])
        ),
        f"{LAYERS}mlp.linear_fc2.weight": stack(layer("mlp.down_proj.weight")),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not tie:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def _model(tp: int, tie: bool) -> Any:
    """``_megatron``'s GPT (local layer spec) at tensor parallel ``tp``, its output layer the embedding when ``tie``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    _megatron._on_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(_megatron.SEED)
    return GPTModel(
        _megatron.config(tp),
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=_megatron.VOCAB,
        max_sequence_length=_megatron.SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tie,
    )


def _hf_view(model: Any) -> dict[str, torch.Tensor]:
    """Each module's weight under the ``LlamaForCausalLM`` name it plays, as Megatron's forward splits it (TP=1)."""
    hidden = model.config.hidden_size
    view = {"model.embed_tokens.weight": model.embedding.word_embeddings.weight}
    for n, layer in enumerate(model.decoder.layers):
        q, k, v = _megatron._qkv(layer.self_attention, hidden)
        gate, up = torch.chunk(layer.mlp.linear_fc1.weight, 2, dim=0)
        view |= {
            f"model.layers.{n}.input_layernorm.weight": layer.input_layernorm.weight,
            f"model.layers.{n}.self_attn.q_proj.weight": q,
            f"model.layers.{n}.self_attn.k_proj.weight": k,
            f"model.layers.{n}.self_attn.v_proj.weight": v,
            f"model.layers.{n}.self_attn.o_proj.weight": layer.self_attention.linear_proj.weight,
            f"model.layers.{n}.post_attention_layernorm.weight": layer.pre_mlp_layernorm.weight,
            f"model.layers.{n}.mlp.gate_proj.weight": gate,
            f"model.layers.{n}.mlp.up_proj.weight": up,
            f"model.layers.{n}.mlp.down_proj.weight": layer.mlp.linear_fc2.weight,
        }
    view["model.norm.weight"] = model.decoder.final_layernorm.weight
    if model.output_layer.weight is not None:
        view["lm_head.weight"] = model.output_layer.weight
    return {k: t.detach().clone() for k, t in view.items()}


def megatron_load(rank: int, world_size: int, jobs: list[tuple[Path, bool, Path]]) -> None:
    """For each ``(checkpoint, tied, out)``: Megatron's GPT at TP=``world_size`` loads ``checkpoint``; rank 0 writes ``out``."""
    from megatron.core import dist_checkpointing, parallel_state

    for checkpoint, tie, out in jobs:
        model = _model(world_size, tie)
        before = model.embedding.word_embeddings.weight.detach().clone()
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(checkpoint))
        model.load_state_dict(loaded)  # strict: every key of the model, none left over
        assert not torch.equal(before, model.embedding.word_embeddings.weight)  # the load changed the model
        boxes = _megatron._boxes(model.sharded_state_dict())
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, boxes)
        if rank == 0:
            shapes = {key: shape for key, shape, _, _ in boxes}
            state = _megatron._assemble(gathered)
            assert all(not t.isnan().any() for t in state.values())  # every element came from some rank
            result = {"state": state, "shapes": shapes, "hf_view": _hf_view(model) if world_size == 1 else None}
            torch.save(result, out)
        dist.barrier()
        parallel_state.destroy_model_parallel()
