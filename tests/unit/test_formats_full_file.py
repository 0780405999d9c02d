"""formats/full_file.py: a full checkpoint opens by what it holds (file bytes, folder files); what is malformed is named."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fsdp_convert.constants import SAFETENSORS_DTYPES
from fsdp_convert.errors import CheckpointNotFoundError, CorruptChunkError, NotADcpCheckpointError
from fsdp_convert.formats.full_file import FileBoxReader, file_index, open_full_file
from fsdp_convert.formats.index import TensorEntry
from tests._compare import same_bits
from tests._dtypes import DTYPES, FLOAT4, adversarial


def _file(header: dict[str, object], data_bytes: int) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(data_bytes)


def test_a_safetensors_file_opens_with_its_tensors(tmp_path: Path) -> None:
    save_file({"w": torch.arange(6.0).reshape(2, 3)}, tmp_path / "model.safetensors")
    f = open_full_file(tmp_path / "model.safetensors")
    try:
        assert f.keys() == ["model.w"]  # a lone safetensors file holds model weights
        assert torch.equal(f.get("model.w"), torch.arange(6.0).reshape(2, 3))
    finally:
        f.close()


@pytest.mark.parametrize(
    "content",
    [
        struct.pack("<Q", 1000) + b"{}",  # header length past the end
        struct.pack("<Q", 2) + b"[]",  # header not an object
        b"\x01\x02",  # no header length
        _file({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, 4),  # unknown dtype
        _file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 4),  # offsets past the end of the file
    ],
    ids=["bad header length", "not an object", "truncated", "unknown dtype", "offsets outside the file"],
)
def test_a_bad_safetensors_file_is_corrupt(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CorruptChunkError, match="not a readable safetensors file"):
        open_full_file(path)


def test_an_unknown_file_type_is_not_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "model.npz"
    path.write_bytes(b"PK")
    with pytest.raises(NotADcpCheckpointError, match="unknown checkpoint file type '.npz'"):
        open_full_file(path)


def test_every_safetensors_dtype_indexes_and_reads_back_its_bytes(tmp_path: Path) -> None:
    """A file safetensors itself wrote, in every dtype of the table: ``file_index`` gives torch's
    dtype and shape (float4's header counts 4-bit values), and each box read is the tensor's slice."""
    tensors = {
        name: adversarial(dtype, (5, 4), seed=i) for i, (name, dtype) in enumerate(DTYPES.items()) if dtype in SAFETENSORS_DTYPES
    }
    save_file(tensors, tmp_path / "model.safetensors")
    index = file_index(tmp_path / "model.safetensors")
    entries = {e.fqn: e for e in index.entries if isinstance(e, TensorEntry)}
    assert {k: (e.dtype, e.shape) for k, e in entries.items()} == {k: (t.dtype, (5, 4)) for k, t in tensors.items()}
    with FileBoxReader(tmp_path / "model.safetensors") as reader:
        for name, t in tensors.items():
            assert same_bits(reader.read_tensor(entries[name]), t), name
            assert same_bits(reader.read_box(entries[name], (1, 0), (3, 4)), t[1:4]), name


@pytest.mark.skipif(FLOAT4 is None, reason="this torch has no float4_e2m1fn_x2")
def test_a_float4_header_of_half_an_element_is_not_a_checkpoint(tmp_path: Path) -> None:
    """F4 [2, 5] is a valid safetensors tensor (10 values, 5 bytes) that no float4_e2m1fn_x2 shape holds."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(_file({"w": {"dtype": "F4", "shape": [2, 5], "data_offsets": [0, 5]}}, 5))
    with pytest.raises(NotADcpCheckpointError, match=r"model\.safetensors: w: its shape does not hold whole float4"):
        file_index(path)


W = torch.arange(6.0).reshape(3, 2)


def _index_and_values(path: Path) -> dict[str, object]:
    """``file_index``'s fqn -> what ``FileBoxReader`` reads for it (a tensor or a plain value), in index order."""
    index = file_index(path)
    with FileBoxReader(path) as reader:
        return {e.fqn: reader.read_tensor(e) if isinstance(e, TensorEntry) else reader.read_value(e) for e in index.entries}


@pytest.mark.parametrize("name", ["last.ckpt", "weights"])
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_torch_save_file_is_read_by_its_bytes_whatever_its_name(tmp_path: Path, name: str, legacy: bool) -> None:
    path = tmp_path / name
    torch.save({"model": {"w": W}, "step": 3}, path, _use_new_zipfile_serialization=not legacy)
    got = _index_and_values(path)
    assert list(got) == ["model.w", "step"] and torch.equal(got["model.w"], W) and got["step"] == 3  # type: ignore[arg-type]


def test_a_safetensors_file_is_read_by_its_bytes_whatever_its_name(tmp_path: Path) -> None:
    save_file({"w": W}, tmp_path / "weights.bin")
    got = _index_and_values(tmp_path / "weights.bin")
    assert list(got) == ["w"] and torch.equal(got["w"], W)  # type: ignore[arg-type]


def test_integer_dict_keys_stay_integers(tmp_path: Path) -> None:
    """optimizer.state_dict() keys its state by int id: the index's path says so, so a consolidation writes ints back."""
    from fsdp_convert.formats.index import DictKey, unflatten

    torch.save({"optim": {"state": {0: {"exp_avg": W}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}, tmp_path / "o.pt")
    index = file_index(tmp_path / "o.pt")
    paths = {e.fqn: e.path for e in index.entries}
    assert paths["optim.state.0.exp_avg"] == ("optim", "state", 0, "exp_avg")
    assert isinstance(paths["optim.state.0.exp_avg"][2], DictKey)
    assert list(unflatten((p, None) for p in paths.values())["optim"]["state"]) == [0]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([W], "holds a list, not a state dict"),
        ({"model": {1.5: W}}, "key 1.5 under model is a float, not a string or integer"),
        ({"a.b": W, "a": {"b": W}}, "two entries flatten to the key 'a.b'"),
        ({"model": {"w": W.to_sparse()}}, "model.w is a torch.float32 torch.sparse_coo tensor"),
        ({"model": {"w": W}, "extra": (W.to_sparse(), 1)}, "extra holds a tensor inside a tuple that this tool cannot write"),
    ],
    ids=["a list", "a float key", "keys that flatten alike", "a sparse tensor", "a sparse tensor in a tuple"],
)
def test_a_torch_save_file_that_is_no_state_dict_is_named(tmp_path: Path, content: object, message: str) -> None:
    torch.save(content, tmp_path / "x.pt")
    with pytest.raises(NotADcpCheckpointError, match=f"x.pt.*{re.escape(message)}"):
        file_index(tmp_path / "x.pt")


@pytest.mark.parametrize("content", [b"", b"hello", b"PK\x03\x04" + bytes(60)], ids=["empty", "text", "a broken zip"])
def test_a_file_of_neither_format_is_an_error_naming_it(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "x.ckpt").write_bytes(content)
    with pytest.raises((NotADcpCheckpointError, CorruptChunkError), match="x.ckpt"):
        file_index(tmp_path / "x.ckpt")


def _folder(root: Path, optimizer: object | None = None, extra: object | None = None) -> Path:
    root.mkdir()
    save_file({"w": W, "b": W[0].clone()}, root / "model.safetensors")
    if optimizer is not None:
        torch.save(optimizer, root / "optimizer.pt")
    if extra is not None:
        torch.save(extra, root / "extra_state.pt")
    return root


def test_a_folder_with_optimizer_state_is_indexed_as_model_and_optim(tmp_path: Path) -> None:
    """consolidate's folder: the weights go under model beside optimizer.pt (optim) and extra_state.pt (top level);
    reshard of it once failed with KeyError: 'optim.state....step'."""
    optim = {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": W + 1}}, "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]}
    folder = _folder(tmp_path / "hf", optim, {"train_state": {"step": 3}})
    got = _index_and_values(folder)
    assert set(list(got)[:2]) == {"model.w", "model.b"}  # in save_file's data order
    assert list(got)[2:] == [
        "optim.state.w.step",
        "optim.state.w.exp_avg",
        "optim.param_groups.0.lr",
        "optim.param_groups.0.params",
        "train_state.step",
    ]
    assert torch.equal(got["optim.state.w.exp_avg"], W + 1) and got["optim.param_groups.0.params"] == ["w", "b"]  # type: ignore[arg-type]
    assert {e.fqn: e.path for e in file_index(folder).entries}["model.w"] == ("model", "w")


def test_weights_alone_keep_their_names_in_file_order(tmp_path: Path) -> None:
    """A folder without side files, or a PEFT adapter folder, is model.state_dict(): names alone, in data order."""
    from fsdp_convert.formats import detect_format
    from fsdp_convert.writers.safetensors import safetensors_placement

    folder = tmp_path / "adapter"
    folder.mkdir()
    tensors = {"z": W, "a": W[:1].clone(), "m": W[:, :1].clone()}
    placement = safetensors_placement([((name,), t.dtype, tuple(t.shape)) for name, t in tensors.items()])
    (folder / "adapter_model.safetensors").write_bytes(placement.header + b"".join(t.numpy().tobytes() for t in tensors.values()))
    assert detect_format(folder, full_files=True) == "full_file"
    got = _index_and_values(folder)
    assert list(got) == ["z", "a", "m"]  # as written, not sorted
    assert all(torch.equal(got[k], t) for k, t in tensors.items())  # type: ignore[arg-type]


def test_a_folder_of_optimizer_state_alone_is_read(tmp_path: Path) -> None:
    (tmp_path / "o").mkdir()
    torch.save({"state": {"w": {"exp_avg": W}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}, tmp_path / "o" / "optimizer.pt")
    assert list(_index_and_values(tmp_path / "o")) == [
        "optim.state.w.exp_avg",
        "optim.param_groups.0.lr",
        "optim.param_groups.0.params",
    ]


def _sharded(root: Path, weight_map: object, shards: dict[str, dict[str, torch.Tensor]]) -> Path:
    root.mkdir()
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for name, tensors in shards.items():
        save_file(tensors, root / name)
    return root


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda d: _sharded(d, 5, {}), NotADcpCheckpointError, "has no weight_map"),
        (lambda d: _sharded(d, {"w": "a.safetensors", "v": "a.safetensors"}, {"a.safetensors": {"w": W}}), NotADcpCheckpointError,
         "maps v to a.safetensors, which does not hold it"),
        (lambda d: _sharded(d, {"w": "../a.safetensors"}, {}), CheckpointNotFoundError, "is missing"),
        (lambda d: _folder(d, extra={"model": 3}), NotADcpCheckpointError, "extra_state.pt holds 'model'"),
        (lambda d: _folder(d, optimizer=[1]), NotADcpCheckpointError, "optimizer.pt holds a list"),
    ],
    ids=["no weight_map", "a tensor its shard lacks", "a shard outside the folder", "a side file's key clash", "not a dict"],
)  # fmt: skip
def test_a_malformed_folder_is_named(tmp_path: Path, make: Any, error: type[Exception], message: str) -> None:
    folder = make(tmp_path / "hf")
    with pytest.raises(error, match=re.escape(message)):
        file_index(folder)
    with pytest.raises(error, match=re.escape(message)):
        FileBoxReader(folder)
