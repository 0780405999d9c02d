"""formats/_rank_unpickler.py: a per-rank torch.save file loads without running anything it names.

The files are hand-made with torch.save: objects whose pickle names the real DTensor and DeviceMesh
classes (pickling never calls them), a global that would run code, and zips whose storages are
missing or short.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from fsdp_convert.errors import CorruptChunkError, UnsafeContentError
from fsdp_convert.formats._rank_unpickler import Record, kind, load_rank_file, local_value


class _PickledAs:
    """Pickles as ``cls(*args)`` followed by ``__setstate__(state)``, as the real class would."""

    def __init__(self, cls: type, args: tuple[Any, ...], state: Any = None) -> None:
        self.cls, self.args, self.state = cls, args, state

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.cls, self.args, self.state)


class _RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


def _dtensor(local: torch.Tensor) -> _PickledAs:
    mesh = _PickledAs(DeviceMesh, ("cpu", [0, 1]))
    spec = {"mesh": mesh, "placements": (_PickledAs(Shard, (0,)),)}
    return _PickledAs(DTensor, (), {"_local_tensor": local, "_spec": spec})


def test_dtensor_and_device_mesh_become_inert_records(tmp_path: Path) -> None:
    local = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    path = tmp_path / "rank0.pt"
    torch.save({"model": {"w": _dtensor(local)}, "step": torch.tensor(3)}, path)

    state = load_rank_file(path)

    w = state["model"]["w"]
    assert isinstance(w, Record) and kind(w) == "DTensor"
    mesh = w.fields["_spec"]["mesh"]
    assert kind(mesh) == "DeviceMesh" and mesh.args == ("cpu", [0, 1])
    assert kind(w.fields["_spec"]["placements"][0]) == "Shard"
    assert torch.equal(local_value(state, ("model", "w", "_local_tensor")), local)
    assert torch.equal(state["step"], torch.tensor(3))
    assert not dist.is_initialized()  # no mesh, no process group


@pytest.mark.parametrize("evil", [_RunsCode(), _PickledAs(eval, ("1 + 1",))], ids=["os.system", "builtins.eval"])
def test_unknown_globals_are_refused(tmp_path: Path, evil: object) -> None:
    path = tmp_path / "rank0.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "extra": evil}, path)
    with pytest.raises(UnsafeContentError, match="would run code"):
        load_rank_file(path)


def _rewrite(src: Path, dst: Path, rename: dict[str, str], cut: dict[str, int]) -> None:
    """Copy a torch.save zip, renaming records and keeping only the first ``cut[name]`` bytes of some
    (names without the archive folder: ``data/0``)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            folder, name = info.filename.split("/", 1)
            data = zin.read(info)
            data = data[: cut[name]] if name in cut else data
            zout.writestr(f"{folder}/{rename.get(name, name)}", data)


@pytest.mark.parametrize(
    ("rename", "cut", "message"),
    [
        ({"data/0": "data/7"}, {}, "is not in the file"),
        ({}, {"data/0": 12}, "does not fit in its record"),
    ],
    ids=["storage missing", "storage short"],
)
def test_storages_outside_the_file_are_refused(tmp_path: Path, rename: dict[str, str], cut: dict[str, int], message: str) -> None:
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32)}, good)
    assert torch.equal(load_rank_file(good)["w"], torch.arange(6, dtype=torch.float32))
    bad = tmp_path / "bad.pt"
    _rewrite(good, bad, rename, cut)
    with pytest.raises(CorruptChunkError, match=message):
        load_rank_file(bad)


@pytest.mark.parametrize("content", [b"", b"not a zip at all"], ids=["empty", "not a zip"])
def test_a_file_that_is_not_torch_save_is_corrupt(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "rank0.pt"
    path.write_bytes(content)
    with pytest.raises(CorruptChunkError, match="not a torch.save file"):
        load_rank_file(path)
