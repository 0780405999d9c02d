"""writers/dcp.py: stored-chunk records survive JSON, and the .metadata written is one torch reads and loads from."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.formats import open_checkpoint
from fsdp_convert.formats.index import BytesEntry, DictKey, TensorEntry
from fsdp_convert.writers import dcp as dcp_writer
from fsdp_convert.writers.dcp import (
    ZSTD_DESCRIPTOR,
    MetadataEntry,
    StoredChunk,
    compress_data_files,
    rank_filename,
    require_zstd,
    write_metadata,
)
from tests._dcp_files import RankFileWriter


@pytest.mark.parametrize(
    "chunk",
    [
        StoredChunk("model.w", (4, 0), "__1_0.distcp", 1234, 5678),
        StoredChunk("optim.param_groups.0.lr", None, "__0_0.distcp", 0, 99),
        StoredChunk("scalar", (), "__0_0.distcp", 7, 8),
        StoredChunk("model.w", (0, 0), "__0_0.distcp", 0, 42, ("stream.zstd/1",)),
    ],
)
def test_stored_chunk_json_round_trip(chunk: StoredChunk) -> None:
    row = json.loads(json.dumps(chunk.to_json()))
    assert StoredChunk.from_json(row) == chunk


def test_stored_chunk_from_a_foreign_row_fails() -> None:
    with pytest.raises(KeyError):
        StoredChunk.from_json({"fqn": "w", "offsets": [0]})


class _Box:
    def __init__(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        self.offsets, self.sizes = offsets, sizes


def _write_two_ranks(folder: Path, *, compress: bool = False) -> torch.Tensor:
    """A (5, 3) tensor split 3 + 2 rows over two rank files, and a bytes entry; returns the tensor.

    With ``compress``, the rank files go through ``compress_data_files`` before ``.metadata``."""
    w = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    stored: list[StoredChunk] = []
    for rank, (start, rows) in enumerate([(0, 3), (3, 2)]):
        writer = RankFileWriter(folder, rank)
        writer.add_box("model.w", (start, 0), w[start : start + rows])
        if rank == 0:
            writer.add_raw("optim.state.0.step", _torch_save_bytes(7))
        writer.finish()
        stored += [StoredChunk.from_json(c.to_json()) for c in writer.stored]  # as workers send them
    entries = [
        MetadataEntry(
            fqn="model.w", path=("model", "w"), dtype=w.dtype, shape=(5, 3), chunks=[_Box((0, 0), (3, 3)), _Box((3, 0), (2, 3))]
        ),
        MetadataEntry(fqn="optim.state.0.step", path=("optim", "state", DictKey(0), "step"), dtype=None, shape=None, chunks=[]),
    ]
    if compress:
        stored = compress_data_files(folder, stored, threads=2)
    write_metadata(folder, entries, stored, version=None)
    return w


def _torch_save_bytes(value: object) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def test_metadata_is_read_by_torch_and_loads_the_tensor(tmp_path: Path) -> None:
    w = _write_two_ranks(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".metadata", rank_filename(0), rank_filename(1)]
    meta = FileSystemReader(tmp_path).read_metadata()
    tensor_md = meta.state_dict_metadata["model.w"]
    assert isinstance(tensor_md, TensorStorageMetadata)
    assert tensor_md.size == torch.Size([5, 3]) and tensor_md.properties.dtype == torch.float32
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in tensor_md.chunks] == [((0, 0), (3, 3)), ((3, 0), (2, 3))]
    assert isinstance(meta.state_dict_metadata["optim.state.0.step"], BytesStorageMetadata)
    assert meta.planner_data["optim.state.0.step"] == ("optim", "state", "0", "step")  # dict key, not a list index
    info = meta.storage_data[MetadataIndex("model.w", torch.Size([3, 0]))]
    assert info.relative_path == "__1_0.distcp" and info.offset == 0
    # torch's own loader reads it back, each chunk from its rank file
    target = {"model": {"w": torch.zeros(5, 3)}}
    dcp.load(target, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(target["model"]["w"], w)
    # and so does ours, the bytes entry included
    source = open_checkpoint(tmp_path)
    index, reader = source.index, source.open_reader()
    with reader:
        w_entry, step_entry = index.entries
        assert isinstance(w_entry, TensorEntry) and isinstance(step_entry, BytesEntry)
        assert torch.equal(reader.read_tensor(w_entry), w) and reader.read_value(step_entry) == 7
    assert index.world_size == 2


def test_metadata_is_never_overwritten(tmp_path: Path) -> None:
    _write_two_ranks(tmp_path)
    with pytest.raises(FileExistsError):
        write_metadata(tmp_path, [], [], version=None)


def test_compressed_rank_files_load_with_torch_dcp_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compress_data_files: every payload becomes a zstd frame (read in 7-byte pieces here, so each
    payload takes many), .metadata says stream.zstd/1, torch's FileSystemReader decodes it all, and
    so does our reader; no temporary file is left."""
    pytest.importorskip("zstandard")
    monkeypatch.setattr(dcp_writer, "_COMPRESS_PIECE_BYTES", 7)
    w = _write_two_ranks(tmp_path, compress=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".metadata", rank_filename(0), rank_filename(1)]
    meta = FileSystemReader(tmp_path).read_metadata()
    assert {tuple(i.transform_descriptors) for i in meta.storage_data.values()} == {(ZSTD_DESCRIPTOR,)}
    target = {"model": {"w": torch.zeros(5, 3)}}
    dcp.load(target, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(target["model"]["w"], w)
    source = open_checkpoint(tmp_path)
    index, reader = source.index, source.open_reader()
    with reader:
        w_entry, step_entry = index.entries
        assert isinstance(w_entry, TensorEntry) and isinstance(step_entry, BytesEntry)
        assert torch.equal(reader.read_tensor(w_entry), w) and reader.read_value(step_entry) == 7


def test_compressed_rows_keep_their_order_and_tile_the_new_files(tmp_path: Path) -> None:
    pytest.importorskip("zstandard")
    (tmp_path / "a").write_bytes(b"0123456789" * 100)
    rows = [StoredChunk("x", (5,), "a", 500, 400), StoredChunk("y", None, "a", 0, 500)]  # out of file order
    out = compress_data_files(tmp_path, rows)
    assert [(c.fqn, c.offsets) for c in out] == [("x", (5,)), ("y", None)]
    assert out[1].offset_bytes == 0 and out[1].offset_bytes + out[1].length_bytes == out[0].offset_bytes
    assert out[0].offset_bytes + out[0].length_bytes == (tmp_path / "a").stat().st_size
    import zstandard

    data = (tmp_path / "a").read_bytes()
    x = data[out[0].offset_bytes : out[0].offset_bytes + out[0].length_bytes]
    assert zstandard.ZstdDecompressor().stream_reader(io.BytesIO(x)).read() == (b"0123456789" * 100)[500:900]
    with pytest.raises(ValueError, match="not yet stream-transformed"):
        compress_data_files(tmp_path, out)


def test_zstd_output_without_zstandard_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(InvalidOptionError, match=r"pip install 'fsdp-convert\[zstd\]'"):
        require_zstd()
    with pytest.raises(InvalidOptionError):
        compress_data_files(tmp_path, [])
