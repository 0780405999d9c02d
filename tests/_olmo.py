"""OLMo-core (``ai2-olmo-core`` 3.0.0) trains, saves and loads with its own code, on CPU gloo ranks.

``olmo_run`` runs on every rank of a 2-rank group (``tests._dist.run_ranks``, forked): a tiny OLMo-2
model (``TransformerBlockType.reordered_norm`` with QK norm, ``model_config``) in OLMo-core's
``TransformerTrainModule`` (its FSDP2 ``parallelize_model``, AdamW), trained ``STEPS`` steps by its
``Trainer`` on seeded random tokens; its ``CheckpointerCallback`` saves ``out/olmo/step<STEPS>/`` with
``save_async=False`` and the trainer runs with ``async_bookkeeping=False`` (OLMo-core's async paths
hung on gloo here; the files are the same). Rank 0 then writes ``out/olmo/truth.pt``: the full state
taken in the same run, as OLMo-core saves it (``model``; ``optim`` flattened, the train module's
default ``flatten_optimizer_state_dict=True``) and nested (``optim_nested``), and a ``batch`` of tokens.

``olmo_load`` is OLMo-core's own resume at another world size: ``load_model_and_optim_state`` of a
step folder's ``model_and_optim/`` and ``Checkpointer.load`` of the step folder, each into a freshly
initialised train module; each must then hold the run's state, bit for bit. Nothing is patched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tests._compare import assert_same_state
from tests._producers import _clone

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 16, 4, 2, 8
FFN = 48  # llama_like's hidden size: int(8 * 16 / 3) = 42, up to a multiple of 16
EPS, THETA = 1e-6, 500_000
STEPS = 2
RANK_BATCH = 2  # instances per rank and step
RUN_SEED, LOAD_SEED = 1234, 4321
CKPT, TRUTH = f"olmo/step{STEPS}", "olmo/truth.pt"


def preload() -> None:
    """Import OLMo-core here (the parent), once, so forked ranks share it."""
    import olmo_core.distributed.checkpoint  # noqa: F401
    import olmo_core.train  # noqa: F401
    import olmo_core.train.train_module  # noqa: F401


def model_config(seed: int = RUN_SEED) -> Any:
    """OLMo-core's ``TransformerConfig.llama_like`` at a tiny size with OLMo-2's blocks (as its ``olmo2_*`` presets)."""
    from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig

    return TransformerConfig.llama_like(
        d_model=DIM,
        vocab_size=VOCAB,
        n_layers=LAYERS,
        n_heads=HEADS,
        qk_norm=True,
        block_name=TransformerBlockType.reordered_norm,
        hidden_size_multiple_of=16,
        layer_norm_eps=EPS,
        rope_theta=THETA,
        init_seed=seed,
    )


def hf_config() -> dict[str, Any]:
    """The ``Olmo2Config`` of ``model_config``'s model (what OLMo-core's ``get_hf_config`` gives for it)."""
    return {
        "architectures": ["Olmo2ForCausalLM"],
        "model_type": "olmo2",
        "vocab_size": VOCAB,
        "hidden_size": DIM,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "max_position_embeddings": 4096,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def batch(seed: int, instances: int = RANK_BATCH) -> torch.Tensor:
    """``instances`` sequences of ``SEQ`` random token ids, from ``seed``."""
    return torch.randint(0, VOCAB, (instances, SEQ), generator=torch.Generator().manual_seed(seed))


def _data_loader(rank: int, world_size: int, work: Path) -> Any:
    """An OLMo-core ``TextDataLoaderBase`` over seeded random tokens: ``STEPS`` batches an epoch, each rank its own."""
    from olmo_core.data import DataCollator
    from olmo_core.data.data_loader import TextDataLoaderBase

    class RandomTokens(TextDataLoaderBase):
        @property
        def total_batches(self) -> int:
            return STEPS

        def state_dict(self) -> dict[str, Any]:
            return {"batches_processed": self.batches_processed, "epoch": self._epoch}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.batches_processed, self._epoch = state_dict["batches_processed"], state_dict["epoch"]

        def reshuffle(self, epoch: int | None = None, **_: Any) -> None:
            self._epoch = epoch or 1

        def _iter_batches(self) -> Any:
            for i in range(self.batches_processed, STEPS):
                yield {"input_ids": batch(1000 * i + self.dp_rank)}

        def get_mock_batch(self) -> dict[str, Any]:
            return {"input_ids": batch(0)}

    return RandomTokens(
        collator=DataCollator(pad_token_id=0),
        work_dir=work,
        global_batch_size=world_size * RANK_BATCH * SEQ,
        dp_world_size=world_size,
        dp_rank=rank,
    )


def _train_module(seed: int) -> Any:
    """OLMo-core's ``TransformerTrainModule``: the model (initialised from ``seed``) under its FSDP2, AdamW, fp32."""
    from olmo_core.config import DType
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.optim import AdamWConfig
    from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig

    model = model_config(seed).build(init_device="meta")
    config = TransformerTrainModuleConfig(
        rank_microbatch_size=RANK_BATCH * SEQ,
        max_sequence_length=SEQ,
        optim=AdamWConfig(lr=1e-2),
        dp_config=TransformerDataParallelConfig(name=DataParallelType.fsdp, param_dtype=DType.float32),
    )
    return config.build(model, device=torch.device("cpu"))


def full_state(train_module: Any, *, flatten: bool = True) -> dict[str, Any]:
    """The full model and optimizer state (cloned), optimizer flattened as OLMo-core saves it.

    Called on every rank; with ``cpu_offload`` only rank 0's holds the values (the others' are empty).
    """
    full = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=flatten)
    model, optim = train_module.model, train_module.optim
    return _clone(
        {"model": get_model_state_dict(model, options=full), "optim": get_optimizer_state_dict(model, optim, options=full)}
    )


def _set_full_state(train_module: Any, state: dict[str, Any]) -> None:
    """Put a ``full_state(..., flatten=False)`` back into the train module's sharded model and optimizer. Called on every rank."""
    full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)  # only rank 0's full_state holds values
    set_model_state_dict(train_module.model, _clone(state["model"]), options=full)
    set_optimizer_state_dict(train_module.model, train_module.optim, _clone(state["optim"]), options=full)


def olmo_run(rank: int, world_size: int, out: Path) -> None:
    """OLMo-core's Trainer trains ``STEPS`` steps and its Checkpointer saves ``out/olmo/step<STEPS>``; rank 0 writes truth.pt."""
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import CheckpointerCallback, ConfigSaverCallback

    os.environ["OLMO_SHARED_FS"] = "1"  # the ranks share this machine's filesystem (OLMo-core asks to be told)
    folder = out / "olmo"
    train_module = _train_module(RUN_SEED)
    trainer = TrainerConfig(
        save_folder=str(folder),
        max_duration=Duration.steps(STEPS),
        async_bookkeeping=False,
        metrics_collect_interval=1,
        callbacks={
            "checkpointer": CheckpointerCallback(save_interval=STEPS, save_async=False),
            "config_saver": ConfigSaverCallback(),  # each step folder's config.json, as OLMo-core's scripts write it
        },
    ).build(train_module, _data_loader(rank, world_size, out / "olmo_data"))
    trainer.callbacks["config_saver"].config = {"model": model_config().as_config_dict()}
    trainer.fit()
    truth = full_state(train_module)
    nested = full_state(train_module, flatten=False)["optim"]
    if rank == 0:
        torch.save({**truth, "optim_nested": nested, "batch": batch(999, 3)}, out / TRUTH)
    dist.barrier()


def olmo_load(rank: int, world_size: int, step_dir: Path, truth_path: Path, work: Path) -> None:
    """OLMo-core's own loaders on ``step_dir`` at ``world_size`` ranks: ``load_model_and_optim_state`` of its
    ``model_and_optim/`` into a freshly initialised train module, then, the module set back to that
    initialisation, ``Checkpointer.load`` of the step folder; rank 0 checks each load gave the run's state."""
    from olmo_core.distributed.checkpoint import load_model_and_optim_state
    from olmo_core.train.checkpoint import Checkpointer

    os.environ["OLMO_SHARED_FS"] = "1"
    loaded = []
    train_module = _train_module(LOAD_SEED)  # OLMo-core builds its world mesh once a process: one train module
    before, before_nested = full_state(train_module), full_state(train_module, flatten=False)
    load_model_and_optim_state(step_dir / "model_and_optim", train_module.model, train_module.optim, flatten_optimizer_state=True)
    loaded.append(full_state(train_module))
    _set_full_state(train_module, before_nested)  # back to the fresh initialisation, then OLMo-core's resume
    assert_same_state(full_state(train_module)["model"], before["model"])
    trainer_state = Checkpointer(work_dir=work).load(step_dir, train_module)
    loaded.append(full_state(train_module))
    if rank == 0:
        truth = torch.load(truth_path, weights_only=True)
        want = {"model": truth["model"], "optim": truth["optim"]}
        assert not torch.equal(before["model"]["lm_head.w_out.weight"], want["model"]["lm_head.w_out.weight"])
        for got in loaded:
            assert assert_same_state(got, want) == len(want["model"]) + 3 * len(want["model"])
        assert trainer_state is None  # train/ was left out: model and optimizer only
    dist.barrier()
