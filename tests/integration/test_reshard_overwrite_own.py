"""``reshard --overwrite`` onto the tool's own earlier reshard output works without ``--force``, for every producer.

The output check takes the names the tool writes from the tables (``output_table.own_files()`` and
``producers.own_files()``): an earlier reshard of a Megatron-Core (``common.pt``,
``metadata.json``), OLMo-core (``model_and_optim/``, ``config.json``, ``.metadata.json``),
accelerate or Lightning checkpoint, or a DeepSpeed save (``latest``, the tag folder's states files),
holds only names of the producer's record, so ``--overwrite``
replaces it. Each case reshards a real checkpoint of the producer (the session fixtures of
``tests/_samples.py`` and ``tests/conftest.py``; torchtune's and OLMo-core's as their files are laid
out, their own runs being module fixtures of their tests) to 3 ranks, then over that output to 2
ranks, and compares the result with a fresh reshard to 2 ranks: the same files, byte for byte
(``.metadata`` but for its random save id).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import fsdp_convert
from tests._samples import Sample

# case: (fixture, the checkpoint inside it; "" for the fixture's path itself), its producer
CASES: dict[str, tuple[str, str, str]] = {
    "fsdp2": ("ws3_ckpt", "", "fsdp2"),
    "fsdp1": ("fsdp1_layouts", "orig_params_true/checkpoint", "fsdp1"),
    "fsdp1-rank-files": ("fsdp1_layouts", "orig_params_true/rank_files", "fsdp1"),
    "torchtitan": ("torchtitan_run", "torchtitan/checkpoint/step-2", "torchtitan"),
    "accelerate": ("accelerate_run", "accelerate", "accelerate"),
    "lightning": ("lightning_run", "lightning_fsdp2", "lightning"),
    "torchtune": ("torchtune_folder", "", "torchtune"),
    "olmo-core": ("olmo_core_folder", "", "olmo-core"),
    "megatron-core": ("megatron_run", "iter_0000003", "megatron-core"),
    "hf_storage": ("fsdp2_layouts", "hf_storage", "hf_storage"),
    "verl": ("fsdp2_layouts", "verl", "verl"),
    "deepspeed": ("deepspeed_save", "", "deepspeed"),
}


def _state() -> dict[str, object]:
    weight = torch.arange(24.0).reshape(6, 4)
    return {"model": {"w": weight, "b": torch.ones(3)}, "optimizer": {"state": {"w": {"step": torch.tensor(2.0)}}}}


def _save(state: dict[str, object], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: dcp.save warns it saves as one rank
        dcp.save(state, checkpoint_id=path, no_dist=True)


@pytest.fixture
def torchtune_folder(tmp_path: Path) -> Path:
    """A DCP folder as torchtune's ``CheckpointClient`` saves it: ``model``, ``optimizer`` and its progress keys."""
    path = tmp_path / "dist_epoch_0"
    _save({**_state(), "seed": 0, "epochs_run": 1, "total_epochs": 2, "max_steps_per_epoch": 4}, path)
    return path


@pytest.fixture
def olmo_core_folder(tmp_path: Path) -> Path:
    """OLMo-core's ``stepN/``: ``model_and_optim/`` (DCP), ``train/rank<r>.pt``, ``config.json``, ``.metadata.json``."""
    step = tmp_path / "step2"
    state = {"model": {"w": torch.arange(24.0).reshape(6, 4)}, "optim": {"state.w.step": torch.tensor(2.0)}}
    _save(state, step / "model_and_optim")
    (step / "train").mkdir()
    torch.save({"global_step": 2}, step / "train" / "rank0.pt")
    (step / "config.json").write_text(json.dumps({"model": {"d_model": 4}}))
    (step / ".metadata.json").write_text(json.dumps({"version": 1}))
    return step


@pytest.fixture
def deepspeed_save(deepspeed_runs: dict[int, Path]) -> Path:
    """DeepSpeed's own ZeRO-3 save at 2 ranks (the folder with ``latest``); reshard writes a DeepSpeed save again."""
    return deepspeed_runs[2] / "z3"


def _checkpoint(request: pytest.FixtureRequest, case: str) -> Path:
    fixture, inside, _ = CASES[case]
    value = request.getfixturevalue(fixture)
    root = value.checkpoint if isinstance(value, Sample) else Path(value)
    return root / inside if inside else root


def _same_output(out: Path, ref: Path) -> None:
    """``out`` and ``ref`` hold the same files, byte for byte; each ``.metadata`` the same but for its save id."""
    names = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert names == sorted(p.relative_to(ref) for p in ref.rglob("*"))
    for name in names:
        got, want = out / name, ref / name
        if got.is_dir():
            continue
        if got.name == ".metadata":
            a, b = (FileSystemReader(str(p.parent)).read_metadata() for p in (got, want))
            fields = ("state_dict_metadata", "storage_data", "planner_data")
            assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields], name
        else:
            assert got.read_bytes() == want.read_bytes(), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_reshard_overwrite_onto_its_own_output_needs_no_force(request: pytest.FixtureRequest, case: str, tmp_path: Path) -> None:
    ckpt = _checkpoint(request, case)
    assert fsdp_convert.inspect_checkpoint(ckpt).producer == CASES[case][2]
    out, ref = tmp_path / "out", tmp_path / "ref"
    first = fsdp_convert.reshard(ckpt, out, world_size=3, nproc=1)
    again = fsdp_convert.reshard(ckpt, out, world_size=2, nproc=1, overwrite=True)  # no force: the tool's own folder
    fresh = fsdp_convert.reshard(ckpt, ref, world_size=2, nproc=1)
    assert (again.copied, again.folders) == (first.copied, first.folders) == (fresh.copied, fresh.folders)
    _same_output(out, ref)
    info = fsdp_convert.inspect_checkpoint(out)
    assert (info.producer, info.world_size) == (fsdp_convert.inspect_checkpoint(ref).producer, 2)
