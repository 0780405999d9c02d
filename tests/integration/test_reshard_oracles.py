"""reshard of each producer's layout, checked against the training run itself, read by torch.

tests/integration/test_producers.py compares ``consolidate(reshard(x))`` with ``consolidate(x)``: the tool
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
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, _flatten_optim_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import fsdp_convert
from tests._compare import assert_same_state
from tests._dist import run_ranks
from tests._frameworks import TITAN_LAYERS, TITAN_SEQ, preload, titan_trainer
from tests._producers import CFG
from tests.integration.test_reshard import assert_torch_chunk_layout, torch_view

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


TITAN_CKPT, TITAN_TRUTH = "torchtitan/checkpoint/step-2", "torchtitan/truth.pt"


def _titan_truth(run: Path) -> dict[str, Any]:
    """The torchtitan run's truth: its model's own state dict, gathered (``wq``/``wk``/``wv`` as its
    save hook writes them), and torch's full optimizer state dict, keyed by the fused ``wqkv``."""
    return _truth(run / TITAN_TRUTH)


def _in_torchtitans_layout(truth: dict[str, Any]) -> dict[str, Any]:
    """The run's truth as torchtitan's CheckpointManager lays it out: the model's weights at the top
    level and, under ``optimizer``, the optimizer state flattened by torch's own
    ``_flatten_optim_state_dict`` (``state.<fqn>.<name>``, ``param_groups.<fqn>.<field>``) less
    ``param_names``, which torchtitan's flattening drops (the params list names the same FQNs)."""
    optim = copy.deepcopy(truth["optim"])
    for group in optim["param_groups"]:
        assert group.pop("param_names") == group["params"]
    return {**truth["model"], "optimizer": _flatten_optim_state_dict(optim)}


def _n_tensors(truth: dict[str, Any]) -> int:
    """Tensors in the run's checkpoint: the model's, and AdamW's step, exp_avg, exp_avg_sq per parameter."""
    return len(truth["model"]) + 3 * len(truth["optim"]["state"])


def _assert_is_the_run(got: dict[str, Any], source: dict[str, Any], truth: dict[str, Any]) -> None:
    """``got`` (torch's reading of a reshard) has the source's keys at both levels (torch reads a
    DCP folder in its ``.metadata``'s order, which is the saver's, so the order is not compared),
    the run's weights at the top level and its flattened optimizer state under ``optimizer``,
    and the trainer's other state (``lr_scheduler``, ``train_state``, ``dataloader``) as torch
    reads it in the source."""
    want = _in_torchtitans_layout(truth)
    assert sorted(got) == sorted(source)
    assert sorted(got["optimizer"]) == sorted(source["optimizer"]) == sorted(want["optimizer"])
    got_in_order = {**{k: got[k] for k in truth["model"]}, "optimizer": {k: got["optimizer"][k] for k in want["optimizer"]}}
    assert assert_same_state(got_in_order, want) == _n_tensors(truth)
    others = sorted(k for k in source if k not in want)
    assert others == ["dataloader", "lr_scheduler", "train_state"]
    assert_same_state({k: got[k] for k in others}, {k: source[k] for k in others})


def _chunks(meta: TensorStorageMetadata) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks)


def _assert_titan_layout(out: Path, source: Path, world_size: int) -> int:
    """``assert_torch_chunk_layout`` with docs/options.md's one exception, from torch's reading of both
    ``.metadata`` files: a tensor the source kept whole (one chunk, the whole tensor: the 0-dim
    ``step``s, and llama3's ``wq``/``wk``/``wv``, which torchtitan's save hook cuts whole out of
    every rank's fused ``wqkv``) stays one whole chunk in rank 0's file; every other tensor is cut on dim 0 as
    ``torch.chunk(world_size)`` cuts it, chunk r in ``__r_0.distcp``; bytes entries are in rank 0's
    file. Returns the number of tensors checked."""
    src = FileSystemReader(str(source)).read_metadata().state_dict_metadata
    md = FileSystemReader(str(out)).read_metadata()
    assert sorted(md.state_dict_metadata) == sorted(src)
    whole = {
        fqn: tuple(meta.size)
        for fqn, meta in src.items()
        if isinstance(meta, TensorStorageMetadata) and _chunks(meta) == [((0,) * len(meta.size), tuple(meta.size))]
    }
    fused = {f"layers.{i}.attention.qkv_linear.{w}.weight" for i in range(TITAN_LAYERS) for w in ("wq", "wk", "wv")}
    assert {fqn for fqn, shape in whole.items() if shape} == fused, "torchtitan's save hook writes wq, wk and wv whole"
    return assert_torch_chunk_layout(out, world_size, whole)


def test_torchtitan_reshard_is_the_run_in_torchtitans_layout(torchtitan_run: Path, tmp_path: Path) -> None:
    """docs/options.md: "a torchtitan checkpoint keeps its top-level weights and flattened optimizer state".
    torchtitan's own Trainer and CheckpointManager saved the run at 2 ranks; torch reads its
    reshard to 3 as the run's weights at the top level (llama3's ``wq``/``wk``/``wv``) and, under
    ``optimizer``, the run's optimizer state flattened (keyed by the fused ``wqkv``); the other
    entries are what torch reads in the source; every tensor is cut as ``torch.chunk(3)`` cuts
    it, except those the source kept whole, which stay whole on rank 0."""
    ckpt = torchtitan_run / TITAN_CKPT
    out = tmp_path / "ws3"
    fsdp_convert.reshard(ckpt, out, world_size=TARGET)
    truth = _titan_truth(torchtitan_run)
    _assert_is_the_run(torch_view(out, tmp_path), torch_view(ckpt, tmp_path), truth)
    assert _assert_titan_layout(out, ckpt, TARGET) == _n_tensors(truth)


def _load_as_torchtitan(rank: int, world_size: int, checkpoint: Path, truth_path: Path, work: Path) -> None:
    """What a torchtitan job resumed at this world size does: its Trainer's ``checkpointer.load()``
    (the newest ``step-N`` under its checkpoint folder: ``dcp.load`` of the model's own state dict
    at the top level beside the flattened ``optimizer``, ``lr_scheduler``, ``train_state`` and
    ``dataloader``, then the model's ``load_state_dict``, whose hook fuses ``wq``/``wk``/``wv``).
    Each rank's folder holds only ``.metadata``, its own data file and rank 0's. Every rank then
    holds the trainer's step, data position and LR schedule; rank 0 compares the full model (its
    own state dict, gathered) and optimizer state with the run's."""
    mine = work / f"rank{rank}"
    step = mine / "checkpoint" / checkpoint.name
    step.mkdir(parents=True)
    for name in {".metadata", f"__{rank}_0.distcp", "__0_0.distcp"}:
        if (checkpoint / name).exists():
            shutil.copy(checkpoint / name, step / name)
    trainer = titan_trainer(rank, mine, seed=4321, batches=None)  # another seed: only a load makes it the run
    model, optim = trainer.model_parts[0], trainer.optimizers.optimizers[0]
    before = model.lm_head.weight.full_tensor()
    assert trainer.checkpointer.load()
    assert (trainer.step, trainer.ntokens_seen) == (CFG.steps, 2 * TITAN_SEQ * CFG.steps)  # local batch 2
    assert trainer.dataloader.state_dict() == {"batches": CFG.steps}
    assert trainer.lr_schedulers.state_dict() == {"last_epoch": CFG.steps}
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    got = {
        "model": {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()},
        "optim": get_optimizer_state_dict(model, optim, options=full),
    }
    trainer.close()
    if rank == 0:
        truth = torch.load(truth_path, weights_only=True)
        assert not torch.equal(before, truth["model"]["lm_head.weight"]), "the seed must not give the run's weights"
        for optim_sd in (got["optim"], truth["optim"]):  # torchtitan's load rebuilds each group in its own key order
            optim_sd["param_groups"] = [dict(sorted(group.items())) for group in optim_sd["param_groups"]]
        assert assert_same_state(got, {"model": truth["model"], "optim": truth["optim"]}) == _n_tensors(truth)


def test_torchtitan_reshard_loads_the_way_torchtitan_loads_at_three_ranks(torchtitan_run: Path, tmp_path: Path) -> None:
    """docs/options.md: "a torchtitan checkpoint keeps its top-level weights and flattened optimizer
    state", so its producer's loader reads the result: torchtitan's own Trainer at 3 ranks resumes
    from the reshard of its 2-rank run with its CheckpointManager, each rank from its own file,
    and holds the run's full model and optimizer state, step, data position and LR schedule."""
    preload("torchtitan")
    out = tmp_path / "step-2"
    fsdp_convert.reshard(torchtitan_run / TITAN_CKPT, out, world_size=TARGET)
    work = tmp_path / "load"
    work.mkdir()
    run_ranks(_load_as_torchtitan, TARGET, out, torchtitan_run / TITAN_TRUTH, work)


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
def test_torchtitan_reshard_at_other_world_sizes(torchtitan_run: Path, tmp_path: Path, target: int) -> None:
    """The same, to 1 (one chunk each), 2 (the source's own world size) and 5 (``torch.chunk(5)``
    cuts the 16-row weights into 4 chunks of 4: rank 4 holds none of them)."""
    ckpt = torchtitan_run / TITAN_CKPT
    out = tmp_path / f"ws{target}"
    fsdp_convert.reshard(ckpt, out, world_size=target)
    truth = _titan_truth(torchtitan_run)
    _assert_is_the_run(torch_view(out, tmp_path), torch_view(ckpt, tmp_path), truth)
    assert _assert_titan_layout(out, ckpt, target) == _n_tensors(truth)
