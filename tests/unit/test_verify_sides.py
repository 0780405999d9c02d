"""verify finds each side once: its format decided and its index read once, and opened once when compared here."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from fsdp_convert import formats
from fsdp_convert.formats import dcp as dcp_format
from fsdp_convert.formats import open_checkpoint
from fsdp_convert.ops import _sources
from fsdp_convert.ops.verify import VerifyOptions, verify

W = torch.arange(8, dtype=torch.float32).reshape(4, 2)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often .metadata is read, a full file is indexed, and a reader of a full file is opened."""
    calls: Counter[str] = Counter()

    def counting(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(dcp_format, "read_dcp_index", counting("metadata", dcp_format.read_dcp_index))
    rows = tuple(
        dataclasses.replace(
            row, read_index=counting("full file", row.read_index), reader=counting("full file reader", row.reader)
        )
        if row.full
        else row
        for row in formats.FORMATS
    )
    monkeypatch.setattr(formats, "FORMATS", rows)
    return calls


def _sides(tmp_path: Path) -> tuple[Path, Path]:
    dcp.save({"model": {"w": W}}, checkpoint_id=tmp_path / "ck", no_dist=True)
    save_file({"w": W.clone()}, tmp_path / "w.safetensors")
    return tmp_path / "ck", tmp_path / "w.safetensors"


def test_weights_alone_against_dcp_reads_each_side_once(tmp_path: Path, counted: Counter[str]) -> None:
    """The DCP side is seen again as consolidate names weights (model.w), from the index already read."""
    ck, weights = _sides(tmp_path)
    result = verify(ck, weights)
    assert result.equal and result.compared == 1, result.differences
    assert counted == {"metadata": 1, "full file": 1, "full file reader": 1}


def test_a_changed_value_is_found_with_each_side_read_once(tmp_path: Path, counted: Counter[str]) -> None:
    ck, weights = _sides(tmp_path)
    save_file({"w": W + 1}, weights)
    result = verify(weights, ck, VerifyOptions(only="model"))
    assert [(d.key, d.kind) for d in result.differences] == [("model.w", "differs")]
    assert counted == {"metadata": 1, "full file": 1, "full file reader": 1}


def test_a_source_already_found_is_not_read_again(tmp_path: Path, counted: Counter[str]) -> None:
    ck, _ = _sides(tmp_path)
    source = open_checkpoint(ck, full_files=True)
    assert counted["metadata"] == 1
    result = verify(source, ck)
    assert result.equal and result.compared == 1 and result.a == ck
    assert counted["metadata"] == 2  # B's only


def test_workers_take_the_items_as_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A side opened again (a worker's) reads no param group value again: its items travel with it."""
    ck, weights = _sides(tmp_path)
    built: Counter[str] = Counter()
    prepare = _sources.prepare_items
    monkeypatch.setattr(_sources, "prepare_items", lambda *a, **k: built.update(["items"]) or prepare(*a, **k))
    sides, views = _sources.open_sides(_sources.find_source(ck), _sources.find_source(weights), None)
    for view in views:
        view.close()
    assert built["items"] == 2 and all(side.items is not None for side in sides)
    again = _sources.open_views(sides)
    assert [view.keys() for view in again] == [["model.w"], ["model.w"]]
    for view in again:
        view.close()
    assert built["items"] == 2


def test_a_flat_torch_save_file_keeps_its_keys_and_safetensors_under_any_name_is_weights_alone(tmp_path: Path) -> None:
    """A torch.save file of a flat state dict is seen as saved; a safetensors file, told by its bytes, as model.<FQN>."""
    ck, _ = _sides(tmp_path)
    torch.save({"w": W.clone()}, tmp_path / "flat.pt")
    save_file({"w": W.clone()}, tmp_path / "weights.pt")  # safetensors bytes under a torch.save name
    result = verify(ck, tmp_path / "flat.pt")
    assert [(d.key, d.kind) for d in result.differences] == [("model.w", "missing"), ("w", "extra")]
    assert verify(ck, tmp_path / "weights.pt").equal
