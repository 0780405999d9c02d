"""Small tensors of a merged file (Lightning's ``meta.pt``, Megatron's ``common.pt``): items of their own,
written as tensors bit for bit by every output kind that holds them (issue 25)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fsdp_convert
from fsdp_convert.formats import open_checkpoint
from fsdp_convert.outputs import output_kind, value_tensor
from fsdp_convert.plan.consolidate import plan_consolidate
from fsdp_convert.plan.items import prepare_items
from fsdp_convert.roles import GROUPS
from fsdp_convert.transform import TransformOptions
from tests._compare import assert_same_state

CHECKPOINT = {"model": {"w": torch.arange(4.0)}, "optimizer": {"state": {"w": {"step": torch.tensor(1.0)}}}}


def _meta() -> dict[str, object]:
    """A ``meta.pt`` as ``fabric.save`` writes one with a 0-dim step tensor, and tensors nested in a dict and a list."""
    return {
        "step": torch.tensor(3.0),
        "counters": {
            "tokens": torch.tensor(123456789, dtype=torch.int64),
            "seen": [torch.tensor([-0.0, float("nan")], dtype=torch.bfloat16), 2],
        },
        "lr": 0.5,
    }


@pytest.fixture
def lightning_folder(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    dcp.save(CHECKPOINT, checkpoint_id=ckpt, no_dist=True)
    torch.save(_meta(), ckpt / "meta.pt")
    return ckpt


def test_a_meta_tensor_is_an_item_of_its_own_holding_that_tensor(lightning_folder: Path) -> None:
    items = prepare_items(open_checkpoint(lightning_folder, full_files=True), TransformOptions(), GROUPS)
    merged = {item.path: item for item in items if item.path[0] in _meta()}
    assert list(merged) == [("step",), ("counters", "tokens"), ("counters", "seen", 0), ("counters", "seen", 1), ("lr",)]
    step = value_tensor(merged[("step",)])
    assert step is not None and step.dtype == torch.float32 and step.shape == () and step.item() == 3.0
    assert value_tensor(merged[("lr",)]) is None and merged[("lr",)].value == 0.5
    assert all(item.constant and not item.is_tensor for item in merged.values())  # rank 0 writes them


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_meta_tensor_is_written_as_that_tensor_and_verifies(lightning_folder: Path, tmp_path: Path, nproc: int) -> None:
    """torch.save output: ``meta.pt``'s tensors come back as tensors (dtype, shape, bits), each in a
    storage record of its own placed by the plan, and ``--verify`` passes."""
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(lightning_folder, out, nproc=nproc, verify_output=True)
    got = torch.load(out, weights_only=True)
    assert_same_state(got, {**CHECKPOINT, **_meta()})
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None
        assert len([n for n in z.namelist() if "/data/" in n]) == 5  # w, its step, and meta.pt's three tensors
    source = open_checkpoint(lightning_folder, full_files=True)
    index = source.index
    plan = plan_consolidate(index, prepare_items(source, TransformOptions(), GROUPS), out, kind=output_kind(out))
    (file,) = plan.files
    placed = [o for o in file.data_offsets if o is not None]
    assert len(placed) == 5 and file.data_end(plan.items) == placed[-1] + 2 * 2  # the bf16 pair's storage ends the data


def test_a_meta_tensor_goes_into_a_folders_extra_state_as_that_tensor(lightning_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    fsdp_convert.consolidate(lightning_folder, out, nproc=1)
    assert_same_state(torch.load(out / "extra_state.pt", weights_only=True), _meta())
    assert_same_state(torch.load(out / "optimizer.pt", weights_only=True), CHECKPOINT["optimizer"])
