"""plan/items.py: prepare_items reads the param group values it needs and gives model, optimizer and other items in order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_convert.errors import CorruptChunkError, InvalidOptionError, UnsafeContentError, UnsupportedTransformError
from fsdp_convert.formats import open_checkpoint
from fsdp_convert.plan.items import prepare_items
from fsdp_convert.producers import detect_producer
from fsdp_convert.roles import GROUPS
from fsdp_convert.transform import TransformOptions
from tests._samples import Sample


def test_items_of_a_real_checkpoint_come_in_group_order(ws3_ckpt: Sample) -> None:
    source = open_checkpoint(ws3_ckpt.checkpoint, full_files=True)
    truth = ws3_ckpt.truth()
    items = prepare_items(source, TransformOptions(), ("model", "optim", "other"))
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
    source = open_checkpoint(tmp_path, full_files=True)
    items = prepare_items(source, TransformOptions(dtype=torch.bfloat16), ("model",))
    assert [(item.path, item.group, item.dtype) for item in items] == [(("model", "w"), "model", torch.bfloat16)]


def _lightning_folder(path: Path, meta: object) -> Path:
    """A DCP folder as Fabric's ``fabric.save`` writes it: modules and optimizers, and ``meta.pt`` beside."""
    dcp.save(
        {"model": {"w": torch.ones(2)}, "optimizer": {"state": {"w": {"step": torch.tensor(1.0)}}}},
        checkpoint_id=path,
        no_dist=True,
    )
    torch.save(meta, path / "meta.pt")
    return path


def test_lightning_meta_is_merged_at_the_top_level_in_the_producer_layout_only(tmp_path: Path) -> None:
    """As Lightning's own consolidate_checkpoint does (``checkpoint.update(meta)``): after the
    checkpoint's own items; not in the nested layout, nor for reshard, which copies the file."""
    source = open_checkpoint(_lightning_folder(tmp_path, {"step": 3, "hparams": {"lr": 0.1}}), full_files=True)
    index = source.index
    assert detect_producer(index).name == "lightning"
    items = prepare_items(source, TransformOptions(), GROUPS)
    meta = [(item.path, item.group, item.constant, item.value) for item in items if item.path[0] in ("step", "hparams")]
    assert meta == [(("step",), "other", True, 3), (("hparams",), "other", True, {"lr": 0.1})]
    assert items[-2:] == tuple(item for item in items if item.path[0] in ("step", "hparams"))
    assert {item.path[0] for item in items} == {"model", "optimizer", "step", "hparams"}
    for other in (
        prepare_items(source, TransformOptions(layout="nested"), GROUPS),
        prepare_items(source, TransformOptions(), GROUPS, keep_layout=True),
        prepare_items(source, TransformOptions(), ("model", "optim")),
    ):
        assert not any(item.path[0] in ("step", "hparams") for item in other)


@pytest.mark.parametrize(
    ("meta", "error", "message"),
    [
        (
            {"ema": torch.ones(262145)},  # a small tensor merges as itself (tests/unit/test_merged_tensors.py)
            UnsupportedTransformError,
            "'ema' holds a tensor of 1048580 bytes (at most 1048576), which this tool does not merge; use options.layout nested",
        ),
        (
            {"ema": (torch.ones(2), 1)},
            UnsupportedTransformError,
            "'ema' holds a tensor inside a tuple, which this tool does not merge; use options.layout nested",
        ),
        ({"model": 1}, InvalidOptionError, "meta.pt and the checkpoint both hold 'model'; use options.layout nested"),
        ([1, 2], CorruptChunkError, "expected a dict with string keys (Lightning's meta.pt), got list"),
    ],
)
def test_lightning_meta_that_cannot_merge_is_refused_naming_the_file(
    tmp_path: Path, meta: object, error: type[Exception], message: str
) -> None:
    source = open_checkpoint(_lightning_folder(tmp_path, meta), full_files=True)
    with pytest.raises(error, match=re.escape(message)) as caught:
        prepare_items(source, TransformOptions(), GROUPS)
    assert str(tmp_path) in str(caught.value)


def test_lightning_meta_that_would_run_code_is_never_run(tmp_path: Path) -> None:
    from tests.cli.test_bad_inputs import Evil

    marker = tmp_path / "pwned"
    source = open_checkpoint(_lightning_folder(tmp_path / "ck", {"step": Evil(marker)}), full_files=True)
    with pytest.raises(UnsafeContentError, match="meta.pt: would run code when loaded, refused"):
        prepare_items(source, TransformOptions(), GROUPS)
    assert not marker.exists()
