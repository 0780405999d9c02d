"""Index: .metadata read through the restricted unpickler into checked dataclasses."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_convert.errors import CheckpointNotFoundError, NotADcpCheckpointError, UnsafeContentError
from fsdp_convert.formats import read_index
from fsdp_convert.formats.dcp import load_metadata
from fsdp_convert.formats.index import BytesEntry, TensorEntry
from tests._samples import Sample


def _save_ws1(path: Path) -> dict[str, object]:
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "extra": {"epoch": 4}}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return state


def test_index_of_real_fsdp2_checkpoint_matches_truth(ws3_ckpt: Sample) -> None:
    index = read_index(ws3_ckpt.checkpoint)
    truth = ws3_ckpt.truth()
    assert index.world_size == 3
    assert index.data_files == ("__0_0.distcp", "__1_0.distcp", "__2_0.distcp")
    tensors = {e.path: e for e in index.tensors()}
    for fqn, t in truth["model"].items():
        entry = tensors[("model", fqn)]
        assert entry.shape == tuple(t.shape) and entry.dtype == t.dtype
        assert sum(c.numel for c in entry.chunks) == t.numel()
    # entries come in the producer's (flattening) order: model first, then optimizer, then the rest
    tops = [e.path[0] for e in index.entries]
    assert tops == sorted(tops, key=["model", "optim", "train_state"].index)
    assert any(isinstance(e, BytesEntry) and e.path == ("optim", "param_groups", 0, "params") for e in index.entries)


def test_index_of_no_dist_save(tmp_path: Path) -> None:
    _save_ws1(tmp_path / "ck")
    index = read_index(tmp_path / "ck")
    assert index.world_size == 1
    by_fqn = {e.fqn: e for e in index.entries}
    w = by_fqn["model.w"]
    assert isinstance(w, TensorEntry) and w.shape == (2, 3) and w.dtype == torch.float32 and len(w.chunks) == 1
    assert isinstance(by_fqn["extra.epoch"], BytesEntry)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _save_ws1(ck)
    marker = tmp_path / "pwned"
    meta = pickle.load(open(ck / ".metadata", "rb"))  # our own fresh file, trusted
    meta.planner_data = {"x": _Evil(marker)}
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafeContentError, match=r"posix\.system|os\.system"):
        read_index(ck)
    assert not marker.exists()


def test_metadata_of_wrong_type_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"hello": 1}))
    with pytest.raises(NotADcpCheckpointError, match="dict"):
        read_index(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(NotADcpCheckpointError, match=".metadata"):
        read_index(tmp_path)


def test_data_file_outside_the_folder_is_refused(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _save_ws1(ck)
    meta = load_metadata(ck / ".metadata")
    for info in meta.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(NotADcpCheckpointError, match="outside the checkpoint"):
        read_index(ck)


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        read_index(tmp_path / "nope")
    with pytest.raises(NotADcpCheckpointError, match="no .metadata"):
        read_index(tmp_path)


def test_metadata_over_the_cap_is_refused_before_it_is_read(tmp_path: Path) -> None:
    from fsdp_convert.formats._dcp_metadata import METADATA_MAX_BYTES

    meta = tmp_path / ".metadata"
    with open(meta, "wb") as f:
        f.truncate(METADATA_MAX_BYTES + 1)  # sparse: no disk used; reading it would take 8 GiB of memory
    with pytest.raises(NotADcpCheckpointError) as refused:
        read_index(tmp_path)
    assert str(refused.value) == f"{meta} is over 8 GiB, far more than a DCP .metadata holds; not reading it"


def test_bytes_after_the_metadata_pickle_are_refused(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _save_ws1(ck)
    good = (ck / ".metadata").read_bytes()
    (ck / ".metadata").write_bytes(good + b"\x00")
    with pytest.raises(NotADcpCheckpointError, match=rf"data after the end of its pickle \(at byte {len(good)}\)"):
        read_index(ck)
    (ck / ".metadata").write_bytes(good + good)  # two pickles, as a careless append would leave
    with pytest.raises(NotADcpCheckpointError, match="a DCP .metadata is one pickle"):
        read_index(ck)


@pytest.mark.parametrize(
    ("where", "value"),
    [("fqn", "model.w\nerror: all good"), ("data file", "__0_0\x1b[2J.distcp"), ("planner path", "model\r")],
)
def test_names_that_would_break_the_error_line_are_refused(tmp_path: Path, where: str, value: str) -> None:
    ck = tmp_path / "ck"
    _save_ws1(ck)
    meta = load_metadata(ck / ".metadata")
    if where == "fqn":
        meta.state_dict_metadata[value] = meta.state_dict_metadata.pop("model.w")
    elif where == "data file":
        for info in meta.storage_data.values():
            info.relative_path = value
    else:
        meta.planner_data["model.w"] = (value, "w")
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(NotADcpCheckpointError, match="printable") as refused:
        read_index(ck)
    assert str(refused.value).isprintable()
