"""Real-framework producers: accelerate, Lightning Fabric and torchtitan train and save with their own code.

Each ``*_run`` function runs on every rank of a 2-rank gloo group (``tests._dist.run_ranks``, forked),
trains a few steps through the framework, saves through the framework's own checkpoint call, and
writes on rank 0 ``truth.pt``: the full state dicts taken in the same run with torch's
``get_model_state_dict``/``get_optimizer_state_dict(full_state_dict=True)`` (cloned; torchtitan's
model: its own state dict, gathered), the fixed ``batch`` every rank then trains one more step on,
and the full ``next_model`` after that step (for the resume test). What is patched to run on CPU,
and nothing else, is said at each patch.

``preload(name)`` imports a framework in the parent before forking, so the two ranks do not import
it side by side on a 2-core box.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from fsdp_convert._sample import Transformer
from tests._producers import CFG, TRUTH, _batch, _clone

_MODULES = {
    "accelerate": ("accelerate", "accelerate.utils"),
    "lightning": ("lightning.fabric", "lightning.fabric.strategies"),
    "torchtitan": ("torchtitan.trainer", "torchtitan.models.llama3", "torchtitan.components.checkpoint"),
}
RESUME_BATCH_SEED = 999  # the batch of the step after the save, the same on every rank


def preload(name: str) -> None:
    """Import framework ``name`` here (the parent), once, so forked ranks share it. The environment
    is restored after (Lightning's import sets ``PYTORCH_NVML_BASED_CUDA_CHECK`` and
    ``TORCHINDUCTOR_CACHE_DIR``), so later tests' subprocesses see what they saw before."""
    environ = dict(os.environ)
    try:
        for module in _MODULES[name]:
            importlib.import_module(module)
    finally:
        os.environ.clear()
        os.environ.update(environ)


def _loss(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, vocab_size), tokens[:, 1:].reshape(-1))


def _write_truth(
    rank: int,
    out: Path,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    step: Callable[[torch.Tensor], None],
    *,
    cpu_offload: bool = True,
    batch: torch.Tensor | None = None,
    full_model: Callable[[nn.Module], dict[str, Any]] | None = None,
) -> None:
    """Take the full state (cloned: on CPU the offloaded step tensors are the live ones), run
    ``step(batch)`` on every rank, take the full model again; rank 0 saves all in ``out/truth.pt``.
    ``full_model`` replaces ``get_model_state_dict`` where the model's state dict hooks rename."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    if full_model is None:
        full_model = lambda m: get_model_state_dict(m, options=full)  # noqa: E731
    truth = _clone({"model": full_model(model), "optim": get_optimizer_state_dict(model, optim, options=full)})
    batch = _batch(CFG, RESUME_BATCH_SEED) if batch is None else batch
    step(batch)
    next_model = _clone(full_model(model))
    if rank == 0:
        torch.save({**truth, "batch": batch, "next_model": next_model}, out / TRUTH)
    dist.barrier()


# Loaders: each framework's own resume, checked against the run's truth.pt --------------------------

LOAD_SEED = 4321  # another initialisation than the run's: only a load makes the model the run's


def _full_state(model: nn.Module, optim: torch.optim.Optimizer, *, cpu_offload: bool = True) -> dict[str, Any]:
    """The full model and optimizer state, as ``_write_truth`` takes it (called on every rank)."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    return _clone(
        {"model": get_model_state_dict(model, options=full), "optim": get_optimizer_state_dict(model, optim, options=full)}
    )


def _assert_is_the_run(rank: int, got: dict[str, Any], before: dict[str, Any], truth_path: Path) -> None:
    """Rank 0: ``got`` is the run's model and optimizer state bit for bit; ``before`` (the state
    before the load) was not, so the load put it there."""
    if rank != 0:
        return
    from tests._compare import assert_same_state

    truth = torch.load(truth_path, weights_only=True)
    want = {"model": truth["model"], "optim": truth["optim"]}
    assert not torch.equal(before["model"]["output.weight"], want["model"]["output.weight"]), "the seed gave the run's weights"
    assert assert_same_state(got, want) == len(want["model"]) + 3 * len(want["optim"]["state"])


# accelerate ---------------------------------------------------------------------------------------


def _switch_on_accelerate_fsdp() -> None:
    """accelerate 1.15 turns FSDP on only for accelerator process groups: on CPU it silently wraps
    the model in DDP instead. After ``AcceleratorState.__init__``, say FSDP and keep the plugin,
    as its own init does on a GPU (``prepare`` then runs ``fsdp2_prepare_model``, ``save_state``
    ``save_fsdp_model``/``save_fsdp_optimizer``)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init  # type: ignore[method-assign]


def _accelerate_prepared(seed: int) -> tuple[Any, Any, Any]:
    """``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
    state_dict_type="SHARDED_STATE_DICT"))`` with FSDP switched on (``_switch_on_accelerate_fsdp``),
    and the model (initialised from ``seed``) and AdamW through its ``prepare``."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    _switch_on_accelerate_fsdp()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        state_dict_type="SHARDED_STATE_DICT",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    assert accelerator.is_fsdp2
    torch.manual_seed(seed)
    model = Transformer(CFG)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optim = accelerator.prepare(model, optim)
    return accelerator, model, optim


def accelerate_run(rank: int, world_size: int, out: Path) -> None:
    """``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
    state_dict_type="SHARDED_STATE_DICT"))``, ``prepare``, ``CFG.steps`` AdamW steps with
    ``accelerator.backward``, then ``accelerator.save_state(out / "accelerate")``."""
    accelerator, model, optim = _accelerate_prepared(CFG.seed)

    def step(tokens: torch.Tensor) -> None:
        accelerator.backward(_loss(model(tokens[:, :-1]), tokens, CFG.vocab_size))
        optim.step()
        optim.zero_grad()

    for i in range(CFG.steps):
        step(_batch(CFG, 100 * i + rank))
    accelerator.save_state(str(out / "accelerate"))
    _write_truth(rank, out / "accelerate", model, optim.optimizer, step)


def accelerate_load(rank: int, world_size: int, checkpoint: Path, truth_path: Path) -> None:
    """accelerate's own resume at this world size: the run's ``Accelerator`` and FSDP2 plugin
    (``_accelerate_prepared``; on CPU accelerate honours the plugin only when the process group is
    on an accelerator, so ``_switch_on_accelerate_fsdp`` tells its state FSDP right after its own
    init, as on a GPU) over a model from another seed, then ``accelerator.load_state(checkpoint)``
    (``load_fsdp_model``/``load_fsdp_optimizer``: ``dcp.load`` of ``pytorch_model_fsdp_0/`` and
    ``optimizer_0/``). Rank 0 compares the full model and optimizer state with the run's, bit for bit."""
    accelerator, model, optim = _accelerate_prepared(LOAD_SEED)
    before = _full_state(model, optim.optimizer)
    accelerator.load_state(str(checkpoint))
    _assert_is_the_run(rank, _full_state(model, optim.optimizer), before, truth_path)


# Lightning Fabric ---------------------------------------------------------------------------------


def _cpu_fsdp_strategy() -> Any:
    """Lightning 2.6's ``FSDPStrategy`` on CPU: Fabric refuses FSDP off a GPU by a ``type(strategy)
    is FSDPStrategy`` check (a do-nothing subclass passes it), and wraps with ``device_id=None``,
    which torch refuses on CPU: map it to ``torch.device("cpu")`` while ``setup_module`` wraps."""
    from lightning.fabric.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    class CPUFSDPStrategy(FSDPStrategy):
        def setup_module(self, module: nn.Module) -> nn.Module:
            original = FSDP.__init__

            def init(fsdp: Any, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
                original(fsdp, *args, device_id=torch.device("cpu") if device_id is None else device_id, **kwargs)

            FSDP.__init__ = init  # type: ignore[method-assign]
            try:
                return super().setup_module(module)
            finally:
                FSDP.__init__ = original  # type: ignore[method-assign]

    return CPUFSDPStrategy


def _lightning_strategies(world_size: int) -> dict[str, Any]:
    """The two Fabric strategies of the Lightning run, by the folder each saves into: FSDP1
    (``FSDPStrategy(state_dict_type="sharded")``, blocks wrapped) and FSDP2 (``ModelParallelStrategy``,
    ``fully_shard`` per block)."""
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from fsdp_convert._sample import Block

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    return {
        "lightning_fsdp1": _cpu_fsdp_strategy()(state_dict_type="sharded", auto_wrap_policy={Block}),
        "lightning_fsdp2": ModelParallelStrategy(
            parallelize_fn=parallelize, data_parallel_size=world_size, tensor_parallel_size=1
        ),
    }


def _fabric_setup(strategy: Any, world_size: int, seed: int) -> tuple[Any, Any, Any]:
    """``Fabric(accelerator="cpu", devices=world_size, strategy=strategy)``, launched, with the model
    (initialised from ``seed``) and AdamW through ``setup_module``/``setup_optimizers``."""
    import lightning.fabric as L

    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    torch.manual_seed(seed)
    model = fabric.setup_module(Transformer(CFG))
    optim = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    return fabric, model, optim


def lightning_run(rank: int, world_size: int, out: Path) -> None:
    """Lightning Fabric, twice: ``FSDPStrategy(state_dict_type="sharded")`` (FSDP1, blocks wrapped)
    into ``lightning_fsdp1/`` and ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` per block) into
    ``lightning_fsdp2/``; each ``fabric.setup_module``/``setup_optimizers``, ``CFG.steps`` AdamW
    steps with ``fabric.backward``, then ``fabric.save(path, {"model", "optimizer", "step"})``."""
    os.environ["LOCAL_RANK"] = str(rank)  # Fabric then takes the processes as launched, and the group as made
    for name, strategy in _lightning_strategies(world_size).items():
        fabric, model, optim = _fabric_setup(strategy, world_size, CFG.seed)

        def step(tokens: torch.Tensor, model: Any = model, optim: Any = optim, fabric: Any = fabric) -> None:
            fabric.backward(_loss(model(tokens[:, :-1]), tokens, CFG.vocab_size))
            optim.step()
            optim.zero_grad()

        for i in range(CFG.steps):
            step(_batch(CFG, 100 * i + rank))
        fabric.save(out / name, {"model": model, "optimizer": optim, "step": CFG.steps})
        # FSDP1's CPU-offloaded full optimizer state can reuse a gather buffer on this torch: no offload
        _write_truth(rank, out / name, model._forward_module, optim.optimizer, step, cpu_offload=name != "lightning_fsdp1")


def lightning_load(rank: int, world_size: int, sources: dict[str, list[Path]], truth_root: Path) -> None:
    """Lightning's own resume at this world size, for each strategy of ``lightning_run``
    (``lightning_fsdp1``, ``lightning_fsdp2``) and each of its ``sources`` (a folder for
    ``fabric.load``'s sharded path, which needs ``meta.pt``; a file for its full-checkpoint path):
    a fresh Fabric over a model from another seed, ``fabric.load(path, {"model", "optimizer"})``,
    which returns the rest (``{"step": CFG.steps}``); rank 0 compares the full model and optimizer
    state with the run's ``truth.pt``, bit for bit."""
    os.environ["LOCAL_RANK"] = str(rank)
    for name, paths in sources.items():
        offload = name != "lightning_fsdp1"  # as _write_truth took it
        for path in paths:
            fabric, model, optim = _fabric_setup(_lightning_strategies(world_size)[name], world_size, LOAD_SEED)
            before = _full_state(model._forward_module, optim.optimizer, cpu_offload=offload)
            rest = fabric.load(path, {"model": model, "optimizer": optim})
            assert rest == {"step": CFG.steps}, (path, rest)
            got = _full_state(model._forward_module, optim.optimizer, cpu_offload=offload)
            if path.is_file() and name == "lightning_fsdp2":
                # ModelParallelStrategy's full-checkpoint load gives ``betas`` back as a list (it
                # does so with Lightning's own consolidate_checkpoint output too): compare values
                for group in got["optim"].get("param_groups", []):  # rank 0 holds the full state
                    group["betas"] = tuple(group["betas"])
            _assert_is_the_run(rank, got, before, truth_root / name / TRUTH)


def fabric_plain_load(path: Path, truth_path: Path) -> None:
    """A single-process Fabric (``accelerator="cpu", devices=1``: no FSDP, no process group) over a
    plain model from another seed loads the full checkpoint file with ``fabric.load(path, {"model",
    "optimizer"})``, which returns the rest (``{"step": CFG.steps}``); the model and the
    optimizer state (read back FQN-keyed with ``get_optimizer_state_dict``) are the run's, bit for bit."""
    import lightning.fabric as L

    fabric = L.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(LOAD_SEED)
    model = Transformer(CFG)
    model, optim = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    before = _full_state(model._forward_module, optim.optimizer)
    rest = fabric.load(path, {"model": model, "optimizer": optim})
    assert rest == {"step": CFG.steps}, rest
    _assert_is_the_run(0, _full_state(model._forward_module, optim.optimizer), before, truth_path)


# torchtitan ---------------------------------------------------------------------------------------

TITAN_VOCAB, TITAN_DIM, TITAN_HEADS, TITAN_LAYERS, TITAN_SEQ = 64, 16, 2, 2, 8


def titan_model_config() -> Any:
    """torchtitan's llama3 model at a tiny size, built as its ``debugmodel`` flavour is (fused
    ``wqkv``, RMSNorm, complex RoPE), with SDPA for FlexAttention, which has no CPU backward."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    v, d, h = TITAN_VOCAB, TITAN_DIM, TITAN_HEADS
    config = Llama3Model.Config(
        dim=d,
        vocab_size=v,
        tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=d, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=v, param_init=_output_linear_init(d)),
        layers=_build_llama3_layers(
            n_layers=TITAN_LAYERS,
            dim=d,
            n_heads=h,
            hidden_dim=compute_ffn_hidden_dim(d, multiple_of=16),
            rope=ComplexRoPE.Config(dim=d // h, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return config


def titan_batch(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TITAN_VOCAB, (2, TITAN_SEQ + 1), generator=gen)


class _CPUDeviceModule:
    """``torch.cpu`` plus the few ``torch.cuda`` calls torchtitan's metrics and barriers make."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def get_device_name(self, *_: Any) -> str:
        return "cpu"

    def get_device_properties(self, *_: Any) -> Any:
        return types.SimpleNamespace(total_memory=1 << 30)

    def reset_peak_memory_stats(self, *_: Any) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def memory_stats(self, *_: Any) -> dict[str, int]:
        return {}

    def current_device(self) -> int:
        return 0


def _torchtitan_on_cpu() -> None:
    """torchtitan 0.3.0 picks ``cuda`` at import when no accelerator is found: say ``cpu`` to every
    module that took it. ``set_pg_timeouts`` calls ``torch.distributed.set_timeout``, which torch
    2.13 lacks; it only shortens timeouts after the first step, so it does nothing here."""
    import torchtitan.distributed.utils as titan_dist

    cpu = _CPUDeviceModule()
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"  # type: ignore[attr-defined]
            if hasattr(module, "device_module"):
                module.device_module = cpu  # type: ignore[attr-defined]
    titan_dist.set_pg_timeouts = lambda **_: None  # type: ignore[assignment]


def titan_trainer(rank: int, folder: Path, *, seed: int, batches: Callable[[int], torch.Tensor] | None) -> Any:
    """torchtitan's own ``Trainer`` for the tiny run, built on CPU: the llama3 model, its FSDP2
    ``parallelize_llama`` with ``spmd_backend="full_dtensor"``, its AdamW ``OptimizersContainer``
    and LR schedulers, and its ``CheckpointManager`` under ``folder/checkpoint`` (interval
    ``CFG.steps``, ``last_save_model_only=False``). Only the data are ours: a tokenizer stand-in and
    a loader of ``batches(100 * batch_index + dp_rank)`` (``None``: a loader that only keeps its
    ``{"batches"}`` state, for a trainer that only loads). torchtitan reads C4 and a tokenizer
    from its repository instead."""
    from torchtitan.models.llama3 import parallelize_llama

    return build_titan_trainer(
        rank,
        folder,
        seed=seed,
        batches=batches,
        spec={"name": "llama3", "flavor": "tiny", "model": titan_model_config(), "post_optimizer_build_fn": None},
        parallelize_fn=parallelize_llama,
        vocab=TITAN_VOCAB,
        seq_len=TITAN_SEQ,
        steps=CFG.steps,
    )


def build_titan_trainer(
    rank: int,
    folder: Path,
    *,
    seed: int,
    batches: Callable[[int], torch.Tensor] | None,
    spec: dict[str, Any],
    parallelize_fn: Callable[..., nn.Module],
    vocab: int,
    seq_len: int,
    steps: int,
    parallelism: dict[str, Any] | None = None,
) -> Any:
    """torchtitan 0.3.0's own ``Trainer`` on CPU for a tiny model: ``spec`` (``ModelSpec``'s
    ``name``, ``flavor``, ``model`` and ``post_optimizer_build_fn``), ``parallelize_fn`` with FSDP2's
    reduction summed (gloo has no PREMUL_SUM), ``spmd_backend="full_dtensor"`` plus ``parallelism``,
    AdamW (lr 1e-2, constant after one warmup step), and ``CheckpointManager`` under
    ``folder/checkpoint`` every ``steps`` steps, model and optimizer. Only the data are ours: a
    tokenizer stand-in of ``vocab`` tokens and a loader of ``batches(100 * batch_index + dp_rank)``,
    ``seq_len`` tokens a row (``None``: a loader that only keeps its ``{"batches"}`` state)."""
    from dataclasses import dataclass

    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    os.environ["LOCAL_RANK"] = str(rank)
    _torchtitan_on_cpu()
    # torch's DTensor sharding-propagation cache matches device meshes by equality: left as an
    # earlier trainer in this process filled it, it hands this trainer's new parameters that
    # trainer's meshes (equal, not identical), which fully_shard refuses ("different mesh objects")
    torch._C._clear_DTensor_sharding_propagator_cache()

    class Tokens(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Any, tokenizer_path: str | None = None) -> None:
            super().__init__()

        def encode(self, *_: Any, **__: Any) -> list[int]:
            return []

        def decode(self, *_: Any, **__: Any) -> str:
            return ""

        def get_vocab_size(self) -> int:
            return vocab

    class RandomTokens(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config: Any, *, dp_rank: int, **_: Any) -> None:
            self.rank, self.batches = dp_rank, 0

        def __iter__(self) -> Any:
            if batches is None:
                raise AssertionError("this trainer only loads")
            while True:
                tokens = batches(100 * self.batches + self.rank)
                self.batches += 1
                yield {"input": tokens[:, :-1]}, tokens[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {"batches": self.batches}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.batches = state_dict["batches"]

    def parallelize(model: nn.Module, **kwargs: Any) -> nn.Module:
        model = parallelize_fn(model, **kwargs)
        for module in model.modules():  # gloo has no PREMUL_SUM: FSDP2 sums, then divides
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    config = Trainer.Config(
        model_spec=ModelSpec(**spec, parallelize_fn=parallelize, pipelining_fn=None, state_dict_adapter=None),
        dump_folder=str(folder),
        hf_assets_path=str(folder),
        tokenizer=Tokens.Config(),
        dataloader=RandomTokens.Config(),
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)),
        optimizer=default_adamw(lr=1e-2),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1, decay_ratio=0.0),  # constant after warmup
        training=TrainingConfig(
            local_batch_size=2, seq_len=seq_len, steps=steps, mixed_precision_param="float32", disable_cuda_graphs=True
        ),
        parallelism=ParallelismConfig(spmd_backend="full_dtensor", **(parallelism or {})),
        checkpoint=CheckpointManager.Config(enable=True, interval=steps, last_save_model_only=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
        metrics=MetricsProcessor.Config(log_freq=steps),
        validator=Validator.Config(enable=False),
        debug=DebugConfig(seed=seed, enable_structured_logging=False),
    )
    return config.build()


def torchtitan_run(rank: int, world_size: int, out: Path) -> None:
    """torchtitan's ``Trainer`` (``titan_trainer``) trains ``CFG.steps`` steps on seeded random
    tokens and its ``CheckpointManager`` saves ``out/torchtitan/checkpoint/step-N``; then the
    truth, as ``_write_truth`` takes it."""
    folder = out / "torchtitan"
    trainer = titan_trainer(rank, folder, seed=0, batches=titan_batch)
    trainer.train()
    model, optim = trainer.model_parts[0], trainer.optimizers

    def step(tokens: torch.Tensor) -> None:  # the trainer's own forward and backward, then its optimizers
        optim.zero_grad()
        trainer.forward_backward_step(
            input_dict={"input": tokens[:, :-1]},
            labels=tokens[:, 1:],
            global_valid_tokens=torch.tensor(world_size * tokens[:, 1:].numel()),
        )
        optim.step()

    # get_model_state_dict cannot name wq/wk/wv (a save hook splits the fused wqkv into them):
    # the model's own state dict, gathered, is what torchtitan's ModelWrapper saves
    def full_model(m: nn.Module) -> dict[str, Any]:
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in m.state_dict().items()}

    _write_truth(rank, folder, model, optim.optimizers[0], step, batch=titan_batch(RESUME_BATCH_SEED), full_model=full_model)
    trainer.close()


def titan_plain_step(model_state: dict[str, Any], optim_state: dict[str, Any], batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """The single-process resume of the torchtitan run: its llama3 model built plainly (its load
    hook fuses ``wq``/``wk``/``wv`` into ``wqkv``), ``load_state_dict`` of both, one AdamW step on
    ``batch`` with the mean cross entropy; the new state dict (split into ``wq``/``wk``/``wv``
    again by its save hook)."""
    with torch.device("meta"):
        model = titan_model_config().build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # RoPE's buffers; the weights come from the checkpoint
    model.load_state_dict(model_state)
    optim = torch.optim.AdamW(model.parameters())
    optim.load_state_dict(optim_state)
    loss = _loss(model(batch[:, :-1]), batch, TITAN_VOCAB)
    loss.backward()
    optim.step()
    return {k: v.detach() for k, v in model.state_dict().items()}
