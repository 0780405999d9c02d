"""formats/__init__.py: the format table and open_checkpoint pick the reader for a path, and name what is not a checkpoint."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from fsdp_convert.errors import CheckpointNotFoundError, MissingDataFileError, NotADcpCheckpointError, UnsafeContentError
from fsdp_convert.formats import (
    FORMATS,
    check_data_files,
    detect_format,
    full_file,
    open_checkpoint,
    open_reader,
    rank_files,
    read_index,
    source_format,
)
from fsdp_convert.formats import dcp as dcp_format
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
    source = open_checkpoint(path, full_files=True)
    assert source.format.name == fmt and source.checkpoint_id == source.index.checkpoint_id
    with source.open_reader() as reader:
        assert type(reader) is reader_type
        (entry,) = source.index.tensors()
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
    source = open_checkpoint(_dcp(tmp_path / "ck"))
    index = source.index
    check_data_files(index)
    source.check_data_files()
    (tmp_path / "ck" / index.data_files[0]).unlink()
    with pytest.raises(MissingDataFileError, match=index.data_files[0]):
        check_data_files(index)
    with pytest.raises(MissingDataFileError, match=index.data_files[0]):
        source.check_data_files()


@pytest.mark.parametrize(("make", "fmt"), [(_dcp, "dcp"), (_rank_files, "rank_files"), (_full_file, "full_file")])
def test_a_source_travels_to_workers_and_reads_without_detecting_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: object, fmt: str
) -> None:
    """A pickled Source keeps its format row (by name) and its index; its readers never ask the table again."""
    source = open_checkpoint(make(tmp_path / "ck"), full_files=True)  # type: ignore[operator]
    copy = pickle.loads(pickle.dumps(source))
    assert copy.format is FORMATS[[f.name for f in FORMATS].index(fmt)] and copy == source

    def no_detection(*args: object, **kwargs: object) -> None:
        raise AssertionError("a Source's reader detected the format again")

    # every detector asks one of these first: none may be called once the Source is made
    monkeypatch.setattr(full_file, "is_full_checkpoint", no_detection)
    monkeypatch.setattr(dcp_format, "metadata_subfolders", no_detection)
    monkeypatch.setattr(rank_files, "find_rank_files", no_detection)
    with pytest.raises(AssertionError, match="detected the format again"):
        source_format(copy.checkpoint_id, full_files=True)  # the patch bites
    (entry,) = copy.index.tensors()
    with copy.open_reader() as reader:
        assert torch.equal(reader.read_tensor(entry), W)


def test_the_format_table_is_tried_in_order_full_files_first(tmp_path: Path) -> None:
    assert [f.name for f in FORMATS] == ["full_file", "deepspeed", "dcp", "rank_files", "hf_storage"]
    assert [f.full for f in FORMATS] == [True, False, False, False, False]
    path = _full_file(tmp_path / "ck")
    assert source_format(path).name == "dcp"  # without full files: read as DCP, which names it
    assert source_format(path, full_files=True) is FORMATS[0]


def test_workers_read_a_full_file_the_index_accepted(tmp_path: Path) -> None:
    """consolidate's workers open the reader without full_files: a file or folder that read_index took is read as one."""
    path = tmp_path / "last.ckpt"
    torch.save({"model": {"w": W}}, path)
    assert detect_format(path, full_files=True) == "full_file"
    (entry,) = read_index(path, full_files=True).tensors()
    with open_reader(path) as reader:
        assert type(reader) is FileBoxReader
        assert torch.equal(reader.read_tensor(entry), W)


def test_a_source_keeps_its_follow_symlinks_setting_for_its_readers(tmp_path: Path) -> None:
    """open_checkpoint(follow_symlinks=...) holds for the Source's readers, wherever they are made (a worker too)."""
    ck = _dcp(tmp_path / "ck")
    (tmp_path / "store").mkdir()
    (entry,) = open_checkpoint(ck).index.tensors()
    (data_file,) = {c.relative_path for c in entry.chunks}
    assert data_file is not None
    (ck / data_file).rename(tmp_path / "store" / data_file)
    (ck / data_file).symlink_to(tmp_path / "store" / data_file)
    refused, followed = open_checkpoint(ck, follow_symlinks=False), open_checkpoint(ck, follow_symlinks=True)
    with pytest.raises(UnsafeContentError, match=data_file):
        refused.check_data_files()
    followed.check_data_files()
    with refused.open_reader() as reader, pytest.raises(UnsafeContentError, match=data_file):
        reader.read_tensor(entry)
    with pickle.loads(pickle.dumps(followed)).open_reader() as reader:
        assert torch.equal(reader.read_tensor(entry), W)
