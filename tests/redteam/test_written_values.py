"""Issue 37 N8 (and issue 34's bare tensor): tensors inside a DCP bytes entry are written as tensors a weights_only load reads.

``dcp.save`` traverses dicts and lists only: a tuple of tensors in the train state (an RNG state)
is one bytes entry, its payload a ``torch.save`` of the tuple. The tool read such a value with
torch's loader and pickled it into ``data.pkl`` with plain pickle, which reduces each tensor to
``torch.storage._load_from_bytes``: ``torch.load(weights_only=True)`` then refused the output.
A bytes entry holding a bare tensor ended in ``internal error: ValueError: no storage placed``.
Every output kind that can hold a value is checked: a ``.pt`` file, a Hugging Face folder's
``extra_state.pt``, and ``reshard``'s DCP, which ``dcp.load`` must read back bit for bit.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_bytesio

import fsdp_convert
from fsdp_convert.errors import CheckpointError

from ._attack import RSS_BOUND_BYTES, SECONDS_BOUND, attack

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _rng() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    base = torch.arange(6, dtype=torch.int64)
    # two views of one storage, as torch.save keeps them: one storage record, offsets kept
    return (base, base[2:5], torch.ones(2, dtype=torch.bfloat16))


class _BareTensorPlanner(DefaultSavePlanner):
    """Saves ``train.step`` (a tensor) as a bytes entry, as DCP stores a tensor it does not traverse to."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [i for i in plan.items if i.index.fqn != "train.step"]
        items.append(_create_write_item_for_bytesio("train.step", self.state_dict["train.step"]))
        return dataclasses.replace(plan, items=items)


def _save(root: Path, state: dict[str, Any], planner: DefaultSavePlanner | None = None) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=root, no_dist=True, planner=planner)
    return root


def _state() -> dict[str, Any]:
    return {"model": {"w": torch.randn(4, 3)}, "train": {"rng": _rng(), "epoch": 2}}


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(
            a.view(torch.uint8) if a.dtype.is_floating_point else a, b.view(torch.uint8) if b.dtype.is_floating_point else b
        )
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


def _dcp_train_rng(folder: Path) -> Any:
    """``train.rng`` as ``dcp.load`` reads it from ``folder``."""
    target: dict[str, Any] = {"model": {"w": torch.empty(4, 3)}, "train": {"rng": None, "epoch": None}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=folder, no_dist=True)
    return target["train"]["rng"]


def test_tuple_of_tensors_in_a_pt_loads_weights_only(tmp_path: Path) -> None:
    """The repro: a tuple of tensors in the train state; the .pt loads with weights_only=True, equal, views kept."""
    ckpt = _save(tmp_path / "ckpt", _state())
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(ckpt, out, nproc=1)
    loaded = torch.load(out, weights_only=True)
    _same(loaded["train"]["rng"], _rng())
    assert loaded["train"]["epoch"] == 2
    first, view = loaded["train"]["rng"][:2]
    assert view.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()  # one storage, as torch.save keeps it
    # torch's own reader of a DCP agrees
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt, tmp_path / "torch.pt")
    _same(loaded["train"], torch.load(tmp_path / "torch.pt", weights_only=True)["train"])


def test_tuple_of_tensors_cli(tmp_path: Path) -> None:
    """The command: exit 0, and the output loads with weights_only=True."""
    ckpt = _save(tmp_path / "ckpt", _state())
    result = attack(["consolidate", ckpt, tmp_path / "full.pt"])
    assert result.code == 0, result.stderr
    assert result.seconds < 3 * SECONDS_BOUND and result.max_rss_bytes < RSS_BOUND_BYTES
    _same(torch.load(tmp_path / "full.pt", weights_only=True)["train"]["rng"], _rng())


def test_bare_tensor_bytes_entry(tmp_path: Path) -> None:
    """Issue 34: a bytes entry holding a bare tensor is written as that tensor (was: internal error, no storage placed)."""
    state = {"model": {"w": torch.randn(4, 3)}, "train": {"step": torch.tensor(300, dtype=torch.int64)}}
    ckpt = _save(tmp_path / "ckpt", state, _BareTensorPlanner())
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(ckpt, out, nproc=1)
    _same(torch.load(out, weights_only=True)["train"]["step"], torch.tensor(300))


def test_hf_folder_extra_state_loads_weights_only(tmp_path: Path) -> None:
    """A Hugging Face folder holds the value in extra_state.pt: a weights_only load reads its tensors."""
    ckpt = _save(tmp_path / "ckpt", _state())
    out = tmp_path / "hf"
    fsdp_convert.consolidate(ckpt, out, nproc=1)
    _same(torch.load(out / "extra_state.pt", weights_only=True)["train"]["rng"], _rng())


def test_safetensors_file_leaves_the_value_out(tmp_path: Path) -> None:
    """A safetensors file holds model weights only: the train state is not written there, the weights are."""
    from safetensors.torch import load_file

    ckpt = _save(tmp_path / "ckpt", _state())
    fsdp_convert.consolidate(ckpt, tmp_path / "model.safetensors", nproc=1)
    assert set(load_file(tmp_path / "model.safetensors")) == {"w"}


def test_reshard_keeps_the_tensors(tmp_path: Path) -> None:
    """reshard to DCP: dcp.load reads the same tensors back, and the output consolidates to a weights_only file."""
    ckpt = _save(tmp_path / "ckpt", _state())
    fsdp_convert.reshard(ckpt, tmp_path / "out", world_size=2)
    _same(_dcp_train_rng(tmp_path / "out"), _rng())
    fsdp_convert.consolidate(tmp_path / "out", tmp_path / "again.pt", nproc=1)
    _same(torch.load(tmp_path / "again.pt", weights_only=True)["train"]["rng"], _rng())


def test_the_pt_written_is_read_back_by_verify_and_reshard(tmp_path: Path) -> None:
    """The .pt written from such a value is a source like any other: --verify passes, verify and reshard read it bit for bit."""
    ckpt = _save(tmp_path / "ckpt", _state())
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(ckpt, out, verify_output=True)
    assert fsdp_convert.verify(ckpt, out).equal
    fsdp_convert.reshard(out, tmp_path / "again", world_size=2)
    _same(_dcp_train_rng(tmp_path / "again"), _rng())


def test_a_pt_source_with_a_tensor_it_cannot_write_inside_a_value_is_refused(tmp_path: Path) -> None:
    """A sparse tensor inside a tuple cannot be written back: refused in one line naming the key, nothing written."""
    torch.save({"model": {"w": torch.ones(2)}, "train": {"rng": (torch.ones(2).to_sparse(), 1)}}, tmp_path / "src.pt")
    with pytest.raises(CheckpointError, match=r"train\.rng.*cannot write") as refused:
        fsdp_convert.reshard(tmp_path / "src.pt", tmp_path / "out", world_size=2)
    assert refused.value.exit_code not in (0, 70) and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_data_pkl_of_a_value_is_torch_saves() -> None:
    """The pickle of a value holding tensors (views, a dtype with no legacy storage class) is torch.save's byte for byte."""
    import io
    import zipfile

    from fsdp_convert.writers._torch_pickle import dumps, dumps_with_storages

    value = {"rng": (*_rng(), torch.zeros(3, dtype=torch.uint16), torch.tensor(3.0)), "lr": [1, 2.5, "a"]}
    buf = io.BytesIO()
    torch.save(value, buf)
    with zipfile.ZipFile(buf) as z:
        expected = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    pickled, storages = dumps_with_storages(value, 0)
    assert pickled == expected and list(storages) == ["0", "1", "2", "3"]
    with pytest.raises(ValueError, match="storage records"):
        dumps(value)  # the tensor-free writer never pickles a tensor through the storage's own reduce
