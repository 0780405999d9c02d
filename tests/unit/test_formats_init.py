"""formats/__init__.py: detect_format and open_checkpoint pick the reader for a path, and name what is not a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from fsdp_convert.errors import CheckpointNotFoundError, MissingDataFileError, NotADcpCheckpointError
from fsdp_convert.formats import check_data_files, detect_format, open_checkpoint, open_reader, read_index
from fsdp_convert.formats.dcp import DcpReader
from fsdp_convert.formats.full_file import FileBoxReader
from fsdp_convert.formats.hf_storage import HfStorageReader
from fsdp_convert.formats.index import TensorEntry
from fsdp_convert.formats.rank_files import RankFilesReader

W = torch.arange(8, dtype=torch.float32).reshape(4, 2)


def _dcp(root: Path) -> Path:
    dcp.save({"model": {"w": W}}, checkpoint_id=root, no_dist=True)
    return root


def _rank_files(root: Path) -> Path:
    root.mkdir()
    for rank in range(2):
        torch.save({"w": W}, root / f"model_world_size_2_rank_{rank}.pt")
    return root


def _hf_storage(root: Path) -> Path:
    """Two safetensors shards of W's rows, with DCP sharding info, as HuggingFaceStorageWriter writes them."""
    root.mkdir()
    for i, start in enumerate((0, 2)):
        save_file(
            {"model.w": W[start : start + 2].clone()},
            root / f"shard-0000{i + 1}-model-00001-of-00001.safetensors",
            metadata={"format": "pt", "DCP_SHARDING_INFO": json.dumps({"model.w": {"saved_offsets": [start, 0]}})},
        )
    return root


def _full_file(root: Path) -> Path:
    root.mkdir()
    torch.save({"model": {"w": W}}, root / "full.pt")
    return root / "full.pt"


@pytest.mark.parametrize(
    ("make", "fmt", "reader_type"),
    [
        (_dcp, "dcp", DcpReader),
        (_rank_files, "rank_files", RankFilesReader),
        (_hf_storage, "hf_storage", HfStorageReader),
        (_full_file, "full_file", FileBoxReader),
    ],
)
def test_each_format_gets_its_reader_and_reads_w(tmp_path: Path, make: object, fmt: str, reader_type: type) -> None:
    path = make(tmp_path / "ck")  # type: ignore[operator]
    assert detect_format(path, full_files=True) == fmt
    index, reader = open_checkpoint(path, full_files=True)
    with reader:
        assert type(reader) is reader_type
        (entry,) = index.tensors()
        assert isinstance(entry, TensorEntry) and entry.shape == (4, 2)
        assert torch.equal(reader.read_tensor(entry), W)


def test_a_full_file_is_refused_unless_full_files_are_asked_for(tmp_path: Path) -> None:
    path = _full_file(tmp_path / "ck")
    assert detect_format(path) == "dcp"
    with pytest.raises(NotADcpCheckpointError, match="not a folder"):
        open_checkpoint(path)


def test_a_dcp_folder_stays_dcp_with_full_files(tmp_path: Path) -> None:
    assert detect_format(_dcp(tmp_path / "ck"), full_files=True) == "dcp"


def test_paths_that_are_not_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        open_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError):
        open_checkpoint(tmp_path / "nope", full_files=True)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "plain.safetensors.txt").write_text("hello")
    assert detect_format(tmp_path) == "dcp"  # the DCP reader names what is wrong
    with pytest.raises(NotADcpCheckpointError, match="no .metadata"):
        open_checkpoint(tmp_path)


def test_check_data_files_names_a_missing_file(tmp_path: Path) -> None:
    index = read_index(_dcp(tmp_path / "ck"))
    check_data_files(index)
    (tmp_path / "ck" / index.data_files[0]).unlink()
    with pytest.raises(MissingDataFileError, match=index.data_files[0]):
        check_data_files(index)


def test_workers_read_a_full_file_the_index_accepted(tmp_path: Path) -> None:
    """consolidate's workers open the reader without full_files: a file or folder that read_index took is read as one."""
    path = tmp_path / "last.ckpt"
    torch.save({"model": {"w": W}}, path)
    assert detect_format(path, full_files=True) == "full_file"
    (entry,) = read_index(path, full_files=True).tensors()
    with open_reader(path) as reader:
        assert type(reader) is FileBoxReader
        assert torch.equal(reader.read_tensor(entry), W)
