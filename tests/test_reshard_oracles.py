"""reshard of each producer's layout, checked against the training run itself, read by torch.

tests/test_producers.py compares ``consolidate(reshard(x))`` with ``consolidate(x)``: the tool
checked by the tool. Here the reshard is read by torch alone (``dcp_to_torch_save``, and
``FileSystemReader.read_metadata`` for the layout) and compared with the run's own full state dict
(``truth.pt``), put in the producer's nesting with torch's own helpers.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _flatten_optim_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

import fsdp_convert
from fsdp_convert._sample import Transformer
from tests._compare import assert_same_state
from tests._dist import run_ranks
from tests._producers import CFG
from tests.test_reshard import assert_torch_chunk_layout, torch_view

TARGET = 3  # the producers saved at 2


def _truth(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def _as_dcp_keeps(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` after a DCP save and load by torch: its own flatten/unflatten, dict keys as strings."""
    return unflatten_state_dict(*flatten_state_dict(state))


def _by_id(optim: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict as ``torch.optim.Optimizer.state_dict()`` has it: ids in model order."""
    ids = {fqn: i for i, fqn in enumerate(order)}
    groups = [{**g, "params": sorted(ids[p] for p in g["params"])} for g in optim["param_groups"]]
    return {"state": {ids[fqn]: s for fqn, s in optim["state"].items()}, "param_groups": groups}


def test_torchtitan_reshard_is_the_run_in_torchtitans_layout(fsdp2_layouts: Path, tmp_path: Path) -> None:
    """README: "a torchtitan checkpoint keeps its top-level weights and flattened optimizer state".
    torch reads the reshard to 3 as the run's weights at the top level and, under ``optimizer``,
    the run's optimizer state flattened by torch's own ``_flatten_optim_state_dict`` (what
    ``flatten_optimizer_state_dict=True`` saves), in that order; the other entries are what torch
    reads in the source; and every tensor is cut as ``torch.chunk(3)`` cuts it."""
    ckpt = fsdp2_layouts / "torchtitan/step-2"
    out = tmp_path / "ws3"
    fsdp_convert.reshard(ckpt, out, world_size=TARGET)
    truth = _truth(fsdp2_layouts / "truth.pt")
    got, source = torch_view(out, tmp_path), torch_view(ckpt, tmp_path)
    want = {**truth["model"], "optimizer": _flatten_optim_state_dict(copy.deepcopy(truth["optim"]))}
    assert list(got) == list(source)
    assert assert_same_state({k: got[k] for k in want}, want) == 4 * len(truth["model"])
    others = [k for k in source if k not in want]
    assert others, "the torchtitan fixture saves lr_scheduler, train_state and dataloader beside the weights"
    assert_same_state({k: got[k] for k in others}, {k: source[k] for k in others})
    assert assert_torch_chunk_layout(out, TARGET) == 4 * len(truth["model"])


def _load_as_torchtitan(rank: int, world_size: int, checkpoint: Path, truth_path: Path, work: Path) -> None:
    """What torchtitan's checkpointer does at this world size: ``dcp.load`` into FSDP2 state dicts
    with the weights at the top level and the optimizer under ``optimizer``, flattened
    (``flatten_optimizer_state_dict=True``). Each rank sees only ``.metadata``, its own data file
    and rank 0's. Rank 0 compares the full state with the run's."""
    torch.manual_seed(4321)  # a different init: only the load can make the values right
    model = Transformer(CFG)  # the run's FQNs (its activation checkpointing names none)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd = get_model_state_dict(model)
    state = {**model_sd, "optimizer": get_optimizer_state_dict(model, optim, options=flat)}
    mine = work / f"rank{rank}"
    mine.mkdir()
    for name in {".metadata", f"__{rank}_0.distcp", "__0_0.distcp"}:
        if (checkpoint / name).exists():
            shutil.copy(checkpoint / name, mine / name)
    dcp.load(state, checkpoint_id=mine)
    set_model_state_dict(model, {k: state[k] for k in model_sd})
    set_optimizer_state_dict(model, optim, state["optimizer"], options=flat)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    got = {"model": get_model_state_dict(model, options=full), "optim": get_optimizer_state_dict(model, optim, options=full)}
    if rank == 0:
        truth = torch.load(truth_path, weights_only=True)
        assert_same_state(got, {"model": truth["model"], "optim": truth["optim"]})


def test_torchtitan_reshard_loads_the_way_torchtitan_loads_at_three_ranks(fsdp2_layouts: Path, tmp_path: Path) -> None:
    """README: "a torchtitan checkpoint keeps its top-level weights and flattened optimizer
    state", so its producer's loader reads the result: FSDP2 on 3 ranks loads it as torchtitan
    does, each rank from its own file, and holds the run's full model and optimizer state."""
    out = tmp_path / "ws3"
    fsdp_convert.reshard(fsdp2_layouts / "torchtitan/step-2", out, world_size=TARGET)
    work = tmp_path / "load"
    work.mkdir()
    run_ranks(_load_as_torchtitan, TARGET, out, fsdp2_layouts / "truth.pt", work)


def test_verl_reshard_is_the_run_as_dcp(fsdp2_layouts: Path, tmp_path: Path) -> None:
    """verl's per-rank torch.save files become a DCP folder for 3 ranks that torch reads as the
    run's weights under ``model``, its optimizer state keyed by id under ``optim`` (as
    ``optim.state_dict()`` keys it, through DCP's string keys) and rank 0's ``extra_state`` file."""
    src = fsdp2_layouts / "verl"
    out = tmp_path / "ws3"
    fsdp_convert.reshard(src, out, world_size=TARGET, nproc=2)
    truth = _truth(fsdp2_layouts / "truth.pt")
    extra = torch.load(src / "extra_state_world_size_2_rank_0.pt", weights_only=True)
    want = _as_dcp_keeps({"model": truth["model"], "optim": _by_id(truth["optim"], list(truth["model"])), "extra_state": extra})
    assert assert_same_state(torch_view(out, tmp_path), want) == 4 * len(truth["model"])
    assert assert_torch_chunk_layout(out, TARGET) == 4 * len(truth["model"])


def test_hf_storage_writer_reshard_is_the_run_as_dcp(fsdp2_layouts: Path, tmp_path: Path) -> None:
    """HuggingFaceStorageWriter shards (no .metadata) become a DCP folder for 3 ranks that torch
    reads as the run's model weights at the top level (in the shards' sorted order)."""
    out = tmp_path / "ws3"
    fsdp_convert.reshard(fsdp2_layouts / "hf_storage", out, world_size=TARGET, nproc=2)
    truth = _truth(fsdp2_layouts / "truth.pt")["model"]
    got = torch_view(out, tmp_path)
    assert list(got) == sorted(truth)
    assert assert_same_state({k: got[k] for k in truth}, truth) == len(truth)
    assert assert_torch_chunk_layout(out, TARGET) == len(truth)


def test_fsdp1_rank_files_reshard_is_the_run_as_dcp(fsdp1_layouts: Path, tmp_path: Path) -> None:
    """FSDP1's SHARDED_STATE_DICT saved rank by rank with torch.save (ShardedTensor values) becomes
    a DCP folder for 3 ranks that torch reads as the run's ``{"model", "optim"}``, FQN-keyed."""
    out = tmp_path / "ws3"
    fsdp_convert.reshard(fsdp1_layouts / "orig_params_true/rank_files", out, world_size=TARGET, nproc=2)
    truth = _truth(fsdp1_layouts / "orig_params_true/truth.pt")
    assert assert_same_state(torch_view(out, tmp_path), truth) == 4 * len(truth["model"])
    assert assert_torch_chunk_layout(out, TARGET) == 4 * len(truth["model"])


@pytest.mark.parametrize("target", [1, 2, 5])
def test_torchtitan_reshard_at_other_world_sizes(fsdp2_layouts: Path, tmp_path: Path, target: int) -> None:
    """The same, to 1 (one chunk each), 2 (the source's own world size) and 5 (more ranks than
    rows of the 1-row tensors)."""
    ckpt = fsdp2_layouts / "torchtitan/step-2"
    out = tmp_path / f"ws{target}"
    fsdp_convert.reshard(ckpt, out, world_size=target)
    truth = _truth(fsdp2_layouts / "truth.pt")
    got = torch_view(out, tmp_path)
    want = {**truth["model"], "optimizer": _flatten_optim_state_dict(copy.deepcopy(truth["optim"]))}
    assert assert_same_state({k: got[k] for k in want}, want) == 4 * len(truth["model"])
    assert assert_torch_chunk_layout(out, target) == 4 * len(truth["model"])
