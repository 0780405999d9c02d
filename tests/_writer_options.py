"""One FSDP2 training run saved once per ``FileSystemWriter`` option that changes what is on disk.

Runs on each rank of a gloo group (``tests._dist.run_ranks``). Every save is torch's own
``dcp.save`` (or ``dcp.async_save``) of ``{"model", "optim"}`` from ``get_state_dict``, through a
``FileSystemWriter`` built with one option (``WRITER_OPTIONS``); rank 0 writes ``truth.pt`` with the
full state dicts of the same run (``get_model_state_dict``/``get_optimizer_state_dict(full_state_dict=True)``).
The model is ``fsdp_convert._sample.Transformer(SampleConfig())``, the one
``tests.integration.test_reshard._load_at_new_world_size`` builds, so a reshard of any of these
loads into FSDP2 at a new world size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)
from torch.distributed.fsdp import fully_shard

from fsdp_convert._sample import SampleConfig, Transformer
from tests._producers import train_step

CFG = SampleConfig(steps=2)
TRUTH = "truth.pt"

# folder name -> FileSystemWriter keyword arguments ("async_save": dcp.async_save with default options)
WRITER_OPTIONS: dict[str, dict[str, Any]] = {
    "single_file_per_rank_false": {"single_file_per_rank": False},
    "thread_count_3": {"thread_count": 3},
    "sync_files_false": {"sync_files": False},
    "async_save": {},
    "zstd": {"_extensions": [ZStandard()]},
    "safetensors": {"serialization_format": SerializationFormat.SAFETENSORS},
}


def _batch(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (CFG.batch_size, CFG.seq_len + 1), generator=gen)


def writer_options_run(rank: int, world_size: int, out: Path) -> None:
    """Train FSDP2 for ``CFG.steps`` AdamW steps, then save ``out/<option>`` for each of ``WRITER_OPTIONS``.

    Called on every rank. ``out/truth.pt`` (rank 0): ``{"model", "optim"}``, full and FQN-keyed.
    """
    torch.manual_seed(CFG.seed)
    model = Transformer(CFG)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(CFG.steps):
        train_step(model, optim, _batch(100 * step + rank), CFG.vocab_size)

    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    for name, kwargs in WRITER_OPTIONS.items():
        writer = FileSystemWriter(out / name, **kwargs)
        if name == "async_save":
            dcp.async_save(state, storage_writer=writer).result()
        else:
            dcp.save(state, storage_writer=writer)

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    truth = {"model": get_model_state_dict(model, options=full), "optim": get_optimizer_state_dict(model, optim, options=full)}
    if rank == 0:
        torch.save(truth, out / TRUTH)
    dist.barrier()
