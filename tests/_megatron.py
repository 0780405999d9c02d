"""Megatron-Core 0.16.1 producer: a tiny Llama-style GPT at tensor parallel 2, saved with ``dist_checkpointing``.

``megatron_run`` runs on both ranks of a 2-rank gloo group (``tests._dist.run_ranks``, forked):
Megatron's ``parallel_state`` at TP=2, its ``GPTModel`` (local layer spec: RMSNorm, SwiGLU, GQA,
RoPE, untied output layer, no biases), a few AdamW steps, and ``dist_checkpointing.save`` of
``{"model": model.sharded_state_dict(), "optimizer": <FP32Optimizer.sharded_state_dict>,
"iteration": STEPS}`` with the ``("torch_dist", 1)`` strategy, as Megatron-LM's checkpointing saves
it. Rank 0 writes ``truth.pt``: the full tensors put together from the very shards that were saved
(each main replica's box at its global offset), in the checkpoint's keys.

What is patched to run on CPU, and nothing else (see /work/shared/FRAMEWORKS.md):
``torch.cuda.synchronize`` (a no-op) and ``torch.cuda.current_device`` ("cpu") for the save and
load; ``FP32Optimizer.__init__`` makes its loss scale ``torch.tensor([1.0], device="cuda")``, so
the optimizer is made with ``MegatronOptimizer.__init__`` and that scale on the CPU; the GPT
forward needs CUDA, so each step's gradients are a fixed function of the weights (the same on both
TP ranks for the replicated norms), and AdamW (Megatron's own fallback optimizer without Apex or
Transformer Engine) steps on them through ``FP32Optimizer.step``.

``megatron_load`` runs at 3 ranks (TP=1) and reads a folder with ``dist_checkpointing.load`` into
a fresh model's and optimizer's sharded state dicts, Megatron-LM's own resume path, and compares
with ``truth.pt`` bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

TRUTH = "truth.pt"
CHECKPOINT = "iter_0000003"
STEPS = 3
VOCAB = 128
SEQ = 16
SEED = 1234
LR = 1e-3
WEIGHT_DECAY = 0.01


def preload() -> None:
    """Import Megatron-Core here (the parent), once, so forked ranks share it."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401


def _on_cpu() -> None:
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]


def config(tp: int) -> Any:
    """The model's ``TransformerConfig``: a Llama block (RMSNorm, SwiGLU, 4 heads in 2 query groups)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        tensor_model_parallel_size=tp,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )


def _model(tp: int) -> Any:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    _on_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(SEED)  # the same master weights on every rank: each keeps its TP slice
    return GPTModel(
        config(tp),
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )


def _init_state(opt: torch.optim.Optimizer, config: Any = None) -> None:
    """Megatron's ``init_state_fn`` for Adam (``megatron/core/optimizer/__init__.py``), for loading."""
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


def _group(wd_mult: float) -> dict[str, Any]:
    """The fields Megatron's ``_get_param_groups`` gives a group, which ``load_state_dict`` matches groups by."""
    return {"wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}


def _optimizer(model: Any) -> Any:
    """Megatron's ``FP32Optimizer`` over AdamW, weight decay off for the norms (as ``_get_param_groups``)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    decay = [p for n, p in model.named_parameters() if not n.endswith("layernorm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("layernorm.weight")]
    adam = torch.optim.AdamW(
        [{"params": decay, **_group(1.0)}, {"params": no_decay, **_group(0.0), "weight_decay": 0.0}],
        lr=LR,
        weight_decay=WEIGHT_DECAY,
    )
    cfg = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=0.0)
    opt = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(opt, adam, cfg, _init_state)
    opt._scale = torch.tensor([1.0])  # FP32Optimizer.__init__ puts it on "cuda"
    opt.is_stub_optimizer = False
    return opt


def _sharded(model: Any, opt: Any, *, is_loading: bool = False) -> dict[str, Any]:
    model_sd = model.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading), "iteration": STEPS}


def _boxes(sharded: dict[str, Any]) -> list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]]:
    """Every main-replica ShardedTensor as (key, global shape, global offset, local box), factories applied."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    apply_factories(sharded)
    out = []
    for t in nested_values(sharded):
        if isinstance(t, ShardedTensor) and is_main_replica(t.replica_id):
            assert t.flattened_range is None
            box = t.data.detach().reshape((1,) * t.prepend_axis_num + tuple(t.data.shape)).clone()
            out.append((t.key, tuple(t.global_shape), tuple(t.global_offset), box))
    return out


def _assemble(pieces: list[list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]]]) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for key, shape, offset, box in (p for rank in pieces for p in rank):
        if key not in full:
            full[key] = torch.full(shape, float("nan"), dtype=box.dtype)
        full[key][tuple(slice(o, o + s) for o, s in zip(offset, box.shape))] = box
    return full


def _truth(sharded: dict[str, Any], world_size: int) -> dict[str, Any] | None:
    """The run's full state in the checkpoint's keys, on rank 0 (None elsewhere)."""
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, _boxes(sharded))
    if dist.get_rank() != 0:
        return None
    full = _assemble(gathered)
    prefix = "optimizer.state."
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in full.items():
        if key.startswith(prefix):
            name, _, param = key.removeprefix(prefix).partition(".")
            state.setdefault(param, {})[name] = tensor
    model = {k: v for k, v in full.items() if not k.startswith(prefix)}
    assert all(not t.isnan().any() for t in full.values())
    return {"model": model, "optimizer_state": state}


def _grads(model: Any, step: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.grad = torch.sin(p * (step + 2)) + 0.1 * torch.cos(p * 7)


def megatron_run(rank: int, world_size: int, out: Path) -> None:
    """Train ``STEPS`` steps at TP=2 and save ``out/iter_0000003`` with ``dist_checkpointing.save``; rank 0 writes the truth."""
    from megatron.core import dist_checkpointing, parallel_state

    model = _model(world_size)
    opt = _optimizer(model)
    for step in range(STEPS):
        _grads(model, step)
        opt.step()
    folder = out / CHECKPOINT
    if rank == 0:
        folder.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(model, opt), str(folder), ("torch_dist", 1))
    truth = _truth(_sharded(model, opt), world_size)
    if truth is not None:
        common = opt.state_dict()
        truth["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in common["param_groups"]]
        truth["step"] = next(iter(common["state"].values()))["step"].clone()
        torch.save(truth, out / TRUTH)
    parallel_state.destroy_model_parallel()


def megatron_load(rank: int, world_size: int, checkpoint: Path, truth_path: Path) -> None:
    """``dist_checkpointing.load`` of ``checkpoint`` at TP=1 on every rank, compared with the truth bit for bit."""
    from megatron.core import dist_checkpointing, parallel_state

    from tests._compare import assert_same_state

    model = _model(1)
    opt = _optimizer(model)
    loaded = dist_checkpointing.load(_sharded(model, opt, is_loading=True), str(checkpoint))
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    truth = torch.load(truth_path, weights_only=True)
    got = _truth(_sharded(model, opt), world_size)
    if got is not None:
        assert_same_state(got["model"], truth["model"])
        assert_same_state(got["optimizer_state"], truth["optimizer_state"])
        state = opt.state_dict()
        assert_same_state([{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]], truth["param_groups"])
        assert all(torch.equal(s["step"], truth["step"]) for s in state["state"].values())
        assert loaded["iteration"] == STEPS
    parallel_state.destroy_model_parallel()


def _qkv(attention: Any, hidden: int) -> tuple[torch.Tensor, ...]:
    """q, k and v projection weights as Megatron's own forward splits ``linear_qkv``'s output
    (``SelfAttention.get_query_key_value_tensors``), fed the identity (sequence = hidden, batch 1)."""
    with torch.no_grad():
        q, k, v = attention.get_query_key_value_tensors(torch.eye(hidden).unsqueeze(1), None)
    return tuple(t.reshape(hidden, -1).t().contiguous() for t in (q, k, v))


def megatron_hf_reference(rank: int, world_size: int, checkpoint: Path, out_path: Path) -> None:
    """One rank at TP=1: ``dist_checkpointing.load`` of ``checkpoint`` into Megatron's modules, and
    each module's weight saved under the ``LlamaForCausalLM`` name it plays: q/k/v as Megatron's
    forward splits them, gate/up as its SwiGLU halves ``linear_fc1``'s output (gate first)."""
    from megatron.core import dist_checkpointing, parallel_state

    model = _model(1)
    opt = _optimizer(model)
    loaded = dist_checkpointing.load(_sharded(model, opt, is_loading=True), str(checkpoint))
    model.load_state_dict(loaded["model"])
    hidden = model.config.hidden_size
    ref = {"model.embed_tokens.weight": model.embedding.word_embeddings.weight}
    for n, layer in enumerate(model.decoder.layers):
        q, k, v = _qkv(layer.self_attention, hidden)
        gate, up = torch.chunk(layer.mlp.linear_fc1.weight, 2, dim=0)
        ref |= {
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
    ref |= {"model.norm.weight": model.decoder.final_layernorm.weight, "lm_head.weight": model.output_layer.weight}
    torch.save({k: v.detach().clone() for k, v in ref.items()}, out_path)
    parallel_state.destroy_model_parallel()


def hf_config() -> dict[str, Any]:
    """The run's model as a Hugging Face ``LlamaConfig``."""
    cfg = config(1)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "vocab_size": VOCAB,
        "max_position_embeddings": SEQ,
        "rms_norm_eps": cfg.layernorm_epsilon,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
