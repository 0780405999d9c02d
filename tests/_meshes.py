"""2-D mesh producers: FSDP2 x tensor parallel and HSDP, trained for real on 4 gloo ranks.

``two_d_meshes`` runs on each rank of a 4-rank gloo group (``tests._dist.run_ranks``) and writes,
for each mesh, ``<mesh>/checkpoint`` (``dcp.save`` of ``get_state_dict``: ``{"model", "optim"}``),
``<mesh>/rank_files`` (verl's layout: per-rank ``torch.save`` of ``model.state_dict()`` and
``optim.state_dict()``, DTensors with their placements) and, on rank 0, ``<mesh>/truth.pt``: the
full state dicts of the same run (``get_model_state_dict`` / ``get_optimizer_state_dict`` with
``full_state_dict=True, cpu_offload=True``), cloned.

- ``tp``: a (dp=2, tp=2) mesh. Each block's MLP is ``ColwiseParallel`` (``mlp.0``: weight and bias
  ``Shard(0)``) then ``RowwiseParallel`` (``mlp.2.weight``: ``Shard(1)``, so chunks are cut on
  dim 1), and the output head is ``ColwiseParallel`` (101 vocab rows: 51 and 50 per tp rank, so
  uneven); then ``fully_shard(..., mesh=mesh["dp"])`` adds FSDP's dim-0 shard: a tensor already
  cut on dim 0 by tp gets ``(_StridedShard(0, sf=2), Shard(0))``, ``mlp.2.weight`` gets
  ``(Shard(0), Shard(1))``, the rest ``Shard(0)`` on the dp sub-mesh. Ranks of one dp group train
  on the same batch, as tensor parallelism requires.
- ``hsdp``: ``fully_shard`` on a (replicate=2, shard=2) mesh: placements ``(Replicate(), Shard(0))``;
  each rank trains on its own batch.

- ``interleaved``: one tensor ``w`` (``arange(8 * 3)`` as 8 x 3) as a DTensor with placements
  ``(_StridedShard(0, sf=2), Replicate())`` on a (2, 2) mesh: mesh row 0 holds rows 0, 1, 4, 5,
  row 1 rows 2, 3, 6, 7, so no rank's shard is one box. Saved as rank files (``rank_files``)
  only: ``dcp.save`` records each shard as the box at its first row (rows 0-3 and 2-5), and its
  planner then refuses the save ("Failed to validate global plan: key:w has overlapping chunks").

The model is the sample ``Transformer`` at its default size (``SampleConfig()``, the size
``tests/integration/test_reshard.py`` loads), AdamW, 2 steps.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_convert._sample import SampleConfig, Transformer
from tests._producers import _batch, _clone, train_step

CFG = SampleConfig(steps=2)
MESHES = ("tp", "hsdp")  # the trained samples; "interleaved" is one tensor
WORLD_SIZE = 4
TRUTH = "truth.pt"


def _tp_model(mesh: DeviceMesh) -> Transformer:
    torch.manual_seed(CFG.seed)
    model = Transformer(CFG)
    # logits gathered back to every tp rank: the loss needs the whole vocabulary
    parallelize_module(model, mesh["tp"], {"output": ColwiseParallel(output_layouts=Replicate())})
    for layer in model.layers:
        parallelize_module(layer.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _hsdp_model(mesh: DeviceMesh) -> Transformer:
    torch.manual_seed(CFG.seed)
    model = Transformer(CFG)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train_and_save(model: Transformer, data_rank: int, rank: int, out: Path) -> None:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(CFG.steps):
        train_step(model, optim, _batch(CFG, 100 * step + data_rank), CFG.vocab_size)
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out / "checkpoint")
    files = out / "rank_files"
    files.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), files / f"model_world_size_{WORLD_SIZE}_rank_{rank}.pt")
    torch.save(optim.state_dict(), files / f"optim_world_size_{WORLD_SIZE}_rank_{rank}.pt")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # cloned: on CPU the "offloaded" state can share the live step tensors
    truth = _clone(
        {"model": get_model_state_dict(model, options=full), "optim": get_optimizer_state_dict(model, optim, options=full)}
    )
    if rank == 0:
        torch.save(truth, out / TRUTH)
    dist.barrier()


def two_d_meshes(rank: int, world_size: int, out: Path) -> None:
    """Train and save the ``tp`` and ``hsdp`` samples (see the module docstring) under ``out``.

    Called on every rank of a 4-rank gloo group.
    """
    if world_size != WORLD_SIZE:
        raise ValueError(f"two_d_meshes runs on {WORLD_SIZE} ranks, not {world_size}")
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _train_and_save(_tp_model(tp_mesh), tp_mesh["dp"].get_local_rank(), rank, out / "tp")
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _train_and_save(_hsdp_model(hsdp_mesh), rank, rank, out / "hsdp")
    _interleaved(tp_mesh, rank, out / "interleaved")


def _interleaved(mesh: DeviceMesh, rank: int, out: Path) -> None:
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    rows = [0, 1, 4, 5] if mesh.get_coordinate()[0] == 0 else [2, 3, 6, 7]  # type: ignore[index]
    w = DTensor.from_local(
        full[rows], mesh, [_StridedShard(0, split_factor=2), Replicate()], shape=full.shape, stride=full.stride()
    )
    files = out / "rank_files"
    files.mkdir(parents=True, exist_ok=True)
    torch.save({"w": w}, files / f"model_world_size_{WORLD_SIZE}_rank_{rank}.pt")
    dist.barrier()
