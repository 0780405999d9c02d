"""items.py: prepare_items reads the param group values it needs and gives model, optimizer and other items in order."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from fsdp_convert.formats import read_index
from fsdp_convert.items import prepare_items
from fsdp_convert.transform import TransformOptions
from tests._samples import Sample


def test_items_of_a_real_checkpoint_come_in_group_order(ws3_ckpt: Sample) -> None:
    index = read_index(ws3_ckpt.checkpoint)
    truth = ws3_ckpt.truth()
    items = prepare_items(index, TransformOptions(), ("model", "optim", "other"))
    groups = [item.group for item in items]
    assert groups == sorted(groups, key=["model", "optim", "other"].index)
    assert set(groups) == {"model", "optim", "other"}
    model = [item.path for item in items if item.group == "model"]
    assert model == [("model", fqn) for fqn in truth["model"]]  # every weight, in the producer's order
    # optimizer state keyed by parameter name, and each group's params list read from the checkpoint
    optim = {item.path: item for item in items if item.group == "optim"}
    some_fqn = next(iter(truth["model"]))
    assert ("optim", "state", some_fqn, "exp_avg") in optim
    params = optim[("optim", "param_groups", 0, "params")]
    assert params.constant and params.value == truth["optim"]["param_groups"][0]["params"]
    assert {item.path for item in items if item.group == "other"} == {("train_state", k) for k in truth["train_state"]}


def test_only_the_groups_asked_for_become_items_with_their_cast(tmp_path: Path) -> None:
    dcp.save({"model": {"w": torch.ones(2)}, "train_state": {"step": 3}}, checkpoint_id=tmp_path, no_dist=True)
    index = read_index(tmp_path)
    items = prepare_items(index, TransformOptions(dtype=torch.bfloat16), ("model",))
    assert [(item.path, item.group, item.dtype) for item in items] == [(("model", "w"), "model", torch.bfloat16)]
