"""_torch.py: the private torch names it wraps still mean what the package takes them to mean."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorProperties

from fsdp_convert._torch import MEM_FORMAT_ENCODING, StorageInfo, open_torch_save_writer, storage_alignment, storage_type_for
from fsdp_convert._zip import read_records


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
