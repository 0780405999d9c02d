"""torch_compat.py: the private torch names it wraps still mean what the package takes them to mean."""

from __future__ import annotations

import dataclasses
import io
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import TensorProperties
from typer.testing import CliRunner

from fsdp_convert import torch_compat
from fsdp_convert.cli import app
from fsdp_convert.errors import TorchFeatureError
from fsdp_convert.torch_compat import (
    MEM_FORMAT_ENCODING,
    StorageInfo,
    open_torch_save_writer,
    storage_alignment,
    storage_type_for,
)
from fsdp_convert.zip_records import read_records


def test_storage_alignment_is_where_torch_save_puts_storages() -> None:
    alignment = storage_alignment()
    assert alignment > 1 and alignment & (alignment - 1) == 0
    buf = io.BytesIO()
    torch.save([torch.ones(3), torch.zeros(5, dtype=torch.int8)], buf)
    data = buf.getvalue()
    starts = [r.data_offset for r in read_records(lambda n, o: data[o : o + n], len(data)) if r.short_name.startswith("data/")]
    assert len(starts) == 2 and all(s % alignment == 0 for s in starts)


def test_torch_save_writer_on_a_stream_names_its_folder_archive() -> None:
    buf = io.BytesIO()
    writer = open_torch_save_writer(buf)
    writer.write_record("hello", b"world", 5)
    writer.write_end_of_file()
    del writer
    data = buf.getvalue()
    records = read_records(lambda n, o: data[o : o + n], len(data))
    hello = next(r for r in records if r.short_name == "hello")
    assert hello.name == "archive/hello" and data[hello.data_offset : hello.data_offset + 5] == b"world"


def test_storage_type_for_legacy_and_new_dtypes() -> None:
    assert storage_type_for(torch.float32) is torch.FloatStorage
    assert storage_type_for(torch.bfloat16) is torch.BFloat16Storage
    assert storage_type_for(torch.int64) is torch.LongStorage
    assert storage_type_for(torch.float8_e4m3fn) is None
    assert storage_type_for(torch.uint16) is None


def test_storage_info_is_what_dcp_save_records(tmp_path: Path) -> None:
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=tmp_path, no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own fresh file, trusted
    infos = list(metadata.storage_data.values())
    assert infos and all(type(info) is StorageInfo for info in infos)
    for info in infos:  # the fields formats/_dcp_metadata.py reads
        size = (tmp_path / info.relative_path).stat().st_size
        assert 0 <= info.offset and 0 < info.length and info.offset + info.length <= size


def test_tensor_properties_pickle_their_memory_format_as_mem_format_encoding() -> None:
    # .metadata's unpickler allows MEM_FORMAT_ENCODING because TensorProperties pickle through it
    data = pickle.dumps(TensorProperties(dtype=torch.float32, memory_format=torch.channels_last))
    assert MEM_FORMAT_ENCODING.__qualname__.encode() in data and MEM_FORMAT_ENCODING.__module__.encode() in data
    assert pickle.loads(data).memory_format == torch.channels_last


# --- feature checks: each private API, taken away as an older or newer torch would, is one line naming the version


@pytest.fixture
def fresh_features() -> object:
    torch_compat._resolve.cache_clear()
    torch_compat.storage_type_for.cache_clear()
    yield
    torch_compat._resolve.cache_clear()
    torch_compat.storage_type_for.cache_clear()


@dataclasses.dataclass
class _OldMetadata:  # torch 2.6's Metadata: no version field
    state_dict_metadata: dict[str, object]


class _TwoArgumentWriter:  # torch 2.6's PyTorchFileWriter: (stream, compute_crc32), no alignment
    def __init__(self, stream: object, compute_crc32: bool) -> None:
        pass


@dataclasses.dataclass
class _OldStorageInfo:  # before stream transforms
    relative_path: str
    offset: int
    length: int


BREAKS = {
    "storage_info": (dcp_filesystem, "_StorageInfo", _OldStorageInfo),
    "mem_format_encoding": (dcp_metadata, "_MEM_FORMAT_ENCODING", None),
    "metadata_version": (dcp_metadata, "Metadata", _OldMetadata),
    "torch_save_writer": (torch._C, "PyTorchFileWriter", _TwoArgumentWriter),
    "storage_alignment": (torch.serialization, "_get_storage_alignment", None),
    "storage_type_map": (torch.storage, "_dtype_to_storage_type_map", None),
    "rebuild_tensor_v2": (torch._utils, "_rebuild_tensor_v2", None),
    "rebuild_tensor_v3": (torch._utils, "_rebuild_tensor_v3", None),
}


def test_every_feature_is_checked_by_a_test() -> None:
    assert set(BREAKS) == set(torch_compat.FEATURES)


def test_this_torch_has_every_feature(fresh_features: object) -> None:
    torch_compat.check_torch()
    for feature in torch_compat.FEATURES.values():
        assert feature.get() is not None


@pytest.mark.parametrize("key", sorted(BREAKS))
def test_a_missing_feature_is_one_line_naming_the_torch_version(
    key: str, fresh_features: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, attr, replacement = BREAKS[key]
    if replacement is None:
        monkeypatch.delattr(module, attr)
    else:
        monkeypatch.setattr(module, attr, replacement)
    with pytest.raises(TorchFeatureError) as err:
        torch_compat.FEATURES[key].get()
    message = str(err.value)
    assert "\n" not in message
    assert f"torch {torch.__version__} lacks" in message and torch_compat.TESTED_TORCH in message
    with pytest.raises(TorchFeatureError):
        torch_compat.check_torch()


@pytest.mark.parametrize(
    ("key", "call"),
    [
        ("storage_alignment", lambda: torch_compat.storage_alignment()),
        ("torch_save_writer", lambda: torch_compat.open_torch_save_writer(io.BytesIO())),
        ("storage_type_map", lambda: torch_compat.storage_type_for(torch.float32)),
    ],
)
def test_the_wrappers_raise_the_feature_error_at_use(
    key: str, call: object, fresh_features: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, attr, replacement = BREAKS[key]
    if replacement is None:
        monkeypatch.delattr(module, attr)
    else:
        monkeypatch.setattr(module, attr, replacement)
    with pytest.raises(TorchFeatureError, match="lacks"):
        call()  # type: ignore[operator]


def test_the_cli_checks_torch_before_any_command(fresh_features: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delattr(torch.serialization, "_get_storage_alignment")
    result = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 1
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    want = f"error: torch {torch.__version__} lacks torch.serialization._get_storage_alignment"
    assert len(lines) == 1 and lines[0].startswith(want)
