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
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader

import fsdp_convert
from fsdp_convert.formats import open_checkpoint
from fsdp_convert.formats.hf_storage import SHARDING_INFO_KEY
from fsdp_convert.producers import detect_producer
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
    "fsdp": ("fsdp_folder", "", "fsdp"),
    "dcp": ("dcp_folder", "", "dcp"),
    "torch_save": ("plain_files", "rank_files", "torch_save"),
    "safetensors": ("plain_files", "safetensors", "safetensors"),
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


@pytest.fixture
def dcp_folder(tmp_path: Path) -> Path:
    """A DCP folder of no producer's layout (``dcp``)."""
    _save({"weights": {"w": torch.arange(24.0).reshape(6, 4)}}, tmp_path / "dcp")
    return tmp_path / "dcp"


@pytest.fixture
def fsdp_folder(tmp_path: Path) -> Path:
    """``{"model", "optim"}`` at 2 ranks with no tensor smaller than the world size: FSDP1 or FSDP2 (``fsdp``)."""
    state = {"model": {"w": torch.arange(24.0).reshape(6, 4)}, "optim": {"state": {"w": {"exp_avg": torch.ones(6, 4)}}}}
    _save(state, tmp_path / "one")
    fsdp_convert.reshard(tmp_path / "one", tmp_path / "fsdp", world_size=2, nproc=1)
    return tmp_path / "fsdp"


@pytest.fixture
def plain_files(tmp_path: Path) -> Path:
    """Per-rank torch.save files of no producer (``torch_save``); safetensors with empty DCP sharding info (``safetensors``)."""
    weight = torch.arange(24.0).reshape(6, 4)
    (tmp_path / "rank_files").mkdir()
    for rank in range(2):
        torch.save({"w": weight, "step": 3}, tmp_path / "rank_files" / f"model_rank{rank}.pt")
    (tmp_path / "safetensors").mkdir()
    save_file({"w": weight}, tmp_path / "safetensors" / "model-00001-of-00001.safetensors", metadata={SHARDING_INFO_KEY: "{}"})
    return tmp_path


def _producer(ckpt: Path) -> str:
    """The producer ``reshard`` reads ``ckpt`` as."""
    return detect_producer(open_checkpoint(ckpt).index).name


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
    assert _producer(ckpt) == CASES[case][2]
    out, ref = tmp_path / "out", tmp_path / "ref"
    first = fsdp_convert.reshard(ckpt, out, world_size=3, nproc=1)
    again = fsdp_convert.reshard(ckpt, out, world_size=2, nproc=1, overwrite=True)  # no force: the tool's own folder
    fresh = fsdp_convert.reshard(ckpt, ref, world_size=2, nproc=1)
    assert (again.copied, again.folders) == (first.copied, first.folders) == (fresh.copied, fresh.folders)
    _same_output(out, ref)
    info, want = fsdp_convert.inspect_checkpoint(out), fsdp_convert.inspect_checkpoint(ref)
    assert (info.producer, info.world_size) == (want.producer, want.world_size)
    assert want.world_size == (1 if case == "torch_save" else 2)  # plain per-rank tensors are replicated: rank 0 writes them
