"""torchtune 0.6.1's own recipe components train a tiny Llama 3 on 2 gloo ranks and save through its ``CheckpointClient``.

``torchtune_run`` is what ``recipes/full_finetune_distributed.py`` does, with its components called
directly (``tune run`` needs a tokenizer and a data set from a hub): the model built on the meta
device, ``training.shard_model`` (FSDP2 per ``TransformerSelfAttentionLayer``), RoPE initialised,
the base checkpoint loaded by its ``FullModelTorchTuneCheckpointer`` through the client and
``training.load_from_full_model_state_dict``, a ``StatefulDataLoader`` with a
``DistributedSampler`` as its ``_setup_data``, AdamW, ``STEPS`` steps; then
``CheckpointClient.save_checkpoint`` of an intermediate epoch with ``enable_async_checkpointing``:
``DistributedCheckpointer`` writes ``output/dist_epoch_0/`` with ``async_save``
(``single_file_per_rank=False``). The truth is what the client saved, gathered in the same run:
the model by torchtune's own ``training.gather_cpu_state_dict``, ``optimizer.state_dict()`` (keyed
by id, as saved) with each DTensor's ``full_tensor()``.

``torchtune_load`` is its resume: ``CheckpointClient.load_distributed_checkpoint`` at any world size.
What is changed to run on CPU: FSDP2 sums gradients (gloo has no ``PREMUL_SUM``). What is changed
to import: see ``preload``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tests._producers import TRUTH

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, HIDDEN, SEQ = 64, 32, 4, 2, 2, 64, 8
SEED, STEPS, ROWS = 1234, 2, 16  # ROWS token rows; 2 ranks x 2 rows x STEPS batches of them
TOTAL_EPOCHS = 3  # epoch 0 of 3 is intermediate: the client saves it asynchronously, as DCP
OUTPUT = "output"  # the checkpointer's output_dir; the DCP folder is output/dist_epoch_0
BASE = "base"  # the base checkpoint the run starts from (base/model.pt)


def _gone(*_: Any, **__: Any) -> Any:
    raise NotImplementedError("not in this torchao; torchtune's quantization recipes are not tested here")


def preload() -> None:
    """Import torchtune here (the parent), once, so forked ranks share it.

    torchtune 0.6.1 imports ``torchao.dtypes.nf4tensor`` (gone in torchao 0.18) and, from
    ``torchtune.training.quantization``, torchao's ``int4_weight_only`` and
    ``int8_dynamic_activation_int4_weight`` (gone in 0.16; their ``*Config`` classes replace them).
    torchao 0.13-0.16 cannot be installed beside torchtitan 0.3.0 with triton 3.9 (torchtitan's
    import of ``torchao.prototype.moe_training`` fails on a triton autotune key), so the test extra
    pins torchao 0.17.0 and the two removed names are stand-ins that raise if called: only the
    quantization recipes, which no test runs, would call them.
    """
    import torchao.quantization

    for name in ("int4_weight_only", "int8_dynamic_activation_int4_weight"):
        if not hasattr(torchao.quantization, name):
            setattr(torchao.quantization, name, _gone)
    import torchdata.stateful_dataloader  # noqa: F401
    import torchtune.training  # noqa: F401
    import torchtune.training.checkpointing._checkpoint_client  # noqa: F401
    from torchtune.models.llama3 import llama3  # noqa: F401


def tiny_llama() -> nn.Module:
    """torchtune's ``llama3`` builder at a tiny size (grouped-query attention: 4 heads, 2 KV heads)."""
    from torchtune.models.llama3 import llama3

    return llama3(
        vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, embed_dim=DIM, max_seq_len=64,
        intermediate_dim=HIDDEN,
    )  # fmt: skip


def hf_config() -> dict[str, Any]:
    """``LlamaConfig`` fields of the same model (``llama3``'s defaults: RoPE base 500000, RMSNorm eps 1e-5, untied)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": DIM,
        "intermediate_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": DIM // HEADS,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def tokens(seed: int, batch: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, SEQ + 1), generator=gen)


def _client(root: Path, output_dir: Path) -> Any:
    """torchtune's ``CheckpointClient`` as a recipe config builds it: ``FullModelTorchTuneCheckpointer``
    over ``root/base/model.pt``, writing to ``output_dir``, with asynchronous checkpointing."""
    from omegaconf import OmegaConf
    from torchtune.training.checkpointing._checkpoint_client import CheckpointClient

    cfg = OmegaConf.create(
        {
            "device": "cpu",
            "enable_async_checkpointing": True,
            "checkpointer": {
                "_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
                "checkpoint_dir": str(root / BASE),
                "checkpoint_files": ["model.pt"],
                "model_type": "LLAMA3",
                "output_dir": str(output_dir),
            },
        }
    )
    return CheckpointClient(cfg)


def _setup(client: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The recipe's ``_setup_model`` and ``_setup_optimizer``: meta-device model, ``shard_model``,
    RoPE initialised, the base checkpoint loaded into the shards; AdamW over its parameters."""
    from torch.distributed.fsdp import FSDPModule
    from torchtune import training
    from torchtune.modules import TransformerSelfAttentionLayer

    with torch.device("meta"):
        model = tiny_llama()
    training.shard_model(model, [lambda _, m: isinstance(m, TransformerSelfAttentionLayer)], cpu_offload=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # gloo has no PREMUL_SUM: FSDP2 sums, then divides
            module.set_force_sum_reduction_for_comms(True)
    with torch.device("cpu"):
        for module in model.modules():
            if hasattr(module, "rope_init"):  # RoPE's cache is not in the state dict
                module.rope_init()
    base = client.load_base_checkpoint()
    training.load_from_full_model_state_dict(model, base[training.MODEL_KEY], torch.device("cpu"), strict=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full(model: nn.Module, optim: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    """What the client saves (``model.state_dict()``, ``optimizer.state_dict()``: keyed by id), gathered
    to full tensors on rank 0 (others get empty dicts): the model by torchtune's own
    ``gather_cpu_state_dict``, each optimizer DTensor by ``full_tensor()`` (called on every rank)."""
    from torchtune import training

    saved = optim.state_dict()
    state = {
        i: {k: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone() for k, v in s.items()}
        for i, s in saved["state"].items()
    }
    full = {
        "model": training.gather_cpu_state_dict(model, rank == 0),
        "optimizer": {"state": state, "param_groups": saved["param_groups"]},
    }
    return copy.deepcopy(full) if rank == 0 else {}


def torchtune_run(rank: int, world_size: int, out: Path) -> None:
    """Train ``STEPS`` steps and save ``out/output/dist_epoch_0`` through the client; rank 0 writes ``out/truth.pt``."""
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchtune.training.checkpointing._checkpoint_client import TrainingProgress

    if rank == 0:
        (out / BASE).mkdir(parents=True)
        torch.manual_seed(SEED)
        torch.save(tiny_llama().state_dict(), out / BASE / "model.pt")
    dist.barrier()
    client = _client(out, out / OUTPUT)
    model, optim = _setup(client)
    rows = list(tokens(SEED, ROWS))
    sampler = DistributedSampler(rows, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    loader = StatefulDataLoader(rows, batch_size=2, sampler=sampler)
    sampler.set_epoch(0)
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    progress = TrainingProgress(
        seed=SEED, epochs_run=1, total_epochs=TOTAL_EPOCHS, max_steps_per_epoch=STEPS, dataloader_state_dict=loader.state_dict()
    )
    client.save_checkpoint(model, optim, progress, epoch=0)
    # the save is asynchronous: wait for it, as the client's next save would
    client._get_dcp_checkpointer()._checkpoint_future.result()
    truth = _full(model, optim, rank)
    if rank == 0:
        torch.save({**truth, "progress": progress.state_dict()}, out / TRUTH)
    dist.barrier()


def torchtune_load(rank: int, world_size: int, root: Path, output_dir: Path) -> None:
    """torchtune's resume at this world size: the recipe's setup from the base checkpoint (not the
    run's weights), then ``CheckpointClient.load_distributed_checkpoint``, which reads the newest
    ``dist_epoch_<n>`` in ``output_dir``. Rank 0 compares the loaded progress and torchtune's own
    full model and optimizer state with the run's ``truth.pt``, bit for bit."""
    from tests._compare import assert_same_state

    client = _client(root, output_dir)
    model, optim = _setup(client)
    before = _full(model, optim, rank)
    loaded = client.load_distributed_checkpoint(model, optim)
    got = _full(model, optim, rank)
    if rank != 0:
        return
    truth = torch.load(root / TRUTH, weights_only=True)
    assert {k: loaded[k] for k in ("seed", "epochs_run", "total_epochs", "max_steps_per_epoch")} == {
        k: truth["progress"][k] for k in ("seed", "epochs_run", "total_epochs", "max_steps_per_epoch")
    }
    assert not torch.equal(before["model"]["output.weight"], truth["model"]["output.weight"]), "the base is the run's"
    n = assert_same_state(got, {"model": truth["model"], "optimizer": truth["optimizer"]})
    assert n == len(truth["model"]) + 3 * len(truth["optimizer"]["state"]), n
