"""DCP payloads FileSystemWriter options change: tensors stored as safetensors (indexed from the header,
read by byte range) and zstd streams (decoded, CRC-checked, or refused naming the extra to install)."""

from __future__ import annotations

import io
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import MetadataIndex

from fsdp_convert.errors import CorruptChunkError, NotADcpCheckpointError, UnsupportedTransformError
from fsdp_convert.formats import open_checkpoint, read_index
from fsdp_convert.formats._dcp_payloads import payload_formats
from fsdp_convert.formats.index import BytesEntry, CheckpointIndex, TensorEntry
from fsdp_convert.zip_records import read_records
from tests._compare import tensor_bytes

zstandard = pytest.importorskip("zstandard")


def _state() -> dict[str, Any]:
    return {
        "model": {
            "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "b": torch.tensor([1.5, -0.0, 2.25, 3.0, -7.0], dtype=torch.bfloat16),
            "empty": torch.zeros(0, 4),
        },
        "step": torch.tensor(7),
        "lr": 0.5,
    }


def _save(path: Path, **writer: Any) -> dict[str, Any]:
    state = _state()
    dcp.save(state, storage_writer=FileSystemWriter(path, **writer), no_dist=True)
    return state


def _by_fqn(index: CheckpointIndex) -> dict[str, TensorEntry | BytesEntry]:
    return {e.fqn: e for e in index.entries}


def _rewrite_metadata(ck: Path, change: Any) -> None:
    meta = FileSystemReader(str(ck)).read_metadata()
    change(meta)
    (ck / ".metadata").write_bytes(pickle.dumps(meta))


@pytest.mark.parametrize("writer", [{}, {"thread_count": 2}, {"single_file_per_rank": False}])
def test_safetensors_chunks_are_placed_from_the_header_and_move_undecoded(tmp_path: Path, writer: dict[str, Any]) -> None:
    """torch gives every tensor of a data file the same offset; the index gives each its own range,
    whose bytes are its elements, and the reader locates them (no CRC-32: safetensors has none)."""
    state = _save(tmp_path, serialization_format=SerializationFormat.SAFETENSORS, **writer)
    md = FileSystemReader(str(tmp_path)).read_metadata()
    if not writer:  # one data file: every tensor's offset is where its safetensors file starts
        assert len({i.offset for k, i in md.storage_data.items() if k.offset is not None}) == 1
    source = open_checkpoint(tmp_path)
    index, reader = source.index, source.open_reader()
    entries = _by_fqn(index)
    want = {
        "model.w": state["model"]["w"],
        "model.b": state["model"]["b"],
        "model.empty": state["model"]["empty"],
        "step": state["step"],
    }
    spans = []
    with reader:
        for fqn, tensor in want.items():
            entry = entries[fqn]
            assert isinstance(entry, TensorEntry)
            (chunk,) = entry.chunks
            assert chunk.relative_path is not None
            raw = (tmp_path / chunk.relative_path).read_bytes()[chunk.offset_bytes : chunk.offset_bytes + chunk.length_bytes]
            assert raw == bytes(tensor_bytes(tensor).numpy()) if tensor.numel() else raw == b""
            stored = reader.locate(entry, chunk)
            assert stored is not None and stored.crc32 is None and stored.nbytes == len(raw)
            assert torch.equal(tensor_bytes(reader.read_tensor(entry)), tensor_bytes(tensor)), fqn
            spans.append((chunk.relative_path, chunk.offset_bytes, chunk.length_bytes))
        lr = entries["lr"]
        assert isinstance(lr, BytesEntry) and reader.read_value(lr) == 0.5
    spans.sort()
    assert all(a[0] != b[0] or a[1] + a[2] <= b[1] for a, b in zip(spans, spans[1:]))


def test_safetensors_header_that_disagrees_with_metadata_is_refused(tmp_path: Path) -> None:
    _save(tmp_path, serialization_format=SerializationFormat.SAFETENSORS)

    def transpose_w(meta: Any) -> None:  # same element count, other shape: still "bare elements"
        md = meta.state_dict_metadata["model.w"]
        md.size = torch.Size([4, 3])
        md.chunks[0].sizes = torch.Size([4, 3])

    _rewrite_metadata(tmp_path, transpose_w)
    with pytest.raises(
        NotADcpCheckpointError,
        match=r"__0_0\.distcp \(model\.w\): the safetensors header disagrees with \.metadata on the chunk's shape",
    ):
        read_index(tmp_path)


def test_unreadable_safetensors_header_is_corrupt_naming_the_file(tmp_path: Path) -> None:
    _save(tmp_path, serialization_format=SerializationFormat.SAFETENSORS)
    at = FileSystemReader(str(tmp_path)).read_metadata().storage_data[MetadataIndex("step", torch.Size([]))].offset
    data = tmp_path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[at : at + 8] = (2**40).to_bytes(8, "little")
    data.write_bytes(bytes(raw))
    with pytest.raises(
        CorruptChunkError,
        match=r"__0_0\.distcp \(.*\): the safetensors header at byte \d+ has a length that does not fit the file",
    ):
        read_index(tmp_path)


def _zstd_ckpt(path: Path) -> dict[str, Any]:
    return _save(path, _extensions=[ZStandard()])


def _read_all(path: Path | str) -> dict[str, Any]:
    source = open_checkpoint(path)
    index, reader = source.index, source.open_reader()
    with reader:
        return {
            e.fqn: reader.read_tensor(e) if isinstance(e, TensorEntry) else reader.read_value(e)
            for e in index.entries  # fmt: skip
        }


def test_zstd_payloads_decode_to_the_saved_values(tmp_path: Path) -> None:
    state = _zstd_ckpt(tmp_path)
    source = open_checkpoint(tmp_path)
    index, reader = source.index, source.open_reader()
    with reader:
        w = _by_fqn(index)["model.w"]
        assert isinstance(w, TensorEntry) and w.chunks[0].transform_descriptors == ("stream.zstd/1",)
        assert reader.locate(w, w.chunks[0]) is None  # decoded, not moved by byte range
        lr = _by_fqn(index)["lr"]
        assert isinstance(lr, BytesEntry)
        assert torch.load(io.BytesIO(reader.read_raw(lr)), weights_only=True) == 0.5  # the decoded torch.save zip
    got = _read_all(tmp_path)
    assert torch.equal(got["model.w"], state["model"]["w"]) and torch.equal(got["step"], state["step"]) and got["lr"] == 0.5


def test_zstd_decodes_through_zstandard_without_torch_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _zstd_ckpt(tmp_path)
    monkeypatch.setattr("fsdp_convert.formats._stream_transforms.stream_transform_from", lambda descriptors, stream: None)
    assert torch.equal(_read_all(tmp_path)["model.b"], state["model"]["b"])


def test_zstd_without_a_decoder_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _zstd_ckpt(tmp_path)
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now raises ImportError
    monkeypatch.setitem(sys.modules, "pyzstd", None)
    with pytest.raises(UnsupportedTransformError) as e:
        _read_all(tmp_path)
    assert str(e.value).endswith(
        "compressed with zstd (stream.zstd/1), and no zstd decoder is installed: pip install 'fsdp-convert[zstd]'"
    )
    assert str(tmp_path / "__0_0.distcp") in str(e.value)


def test_unknown_stream_transform_is_refused_naming_it(tmp_path: Path) -> None:
    _zstd_ckpt(tmp_path)

    def rot13(meta: Any) -> None:
        meta.storage_data[MetadataIndex("model.w", torch.Size([0, 0]))].transform_descriptors = ["stream.rot13/1"]

    _rewrite_metadata(tmp_path, rot13)
    with pytest.raises(
        UnsupportedTransformError, match=r"\(model\.w\): written through stream transform\(s\) \['stream\.rot13/1'\]"
    ):
        _read_all(tmp_path)


def _replace_payload(ck: Path, fqn: str, offsets: tuple[int, ...], payload: bytes) -> None:
    """Append ``payload`` (already compressed) to rank 0's file and point ``fqn``'s chunk at it."""
    data = ck / "__0_0.distcp"
    at = data.stat().st_size
    with open(data, "ab") as f:
        f.write(payload)

    def point(meta: Any) -> None:
        info = meta.storage_data[MetadataIndex(fqn, torch.Size(offsets))]
        info.offset, info.length = at, len(payload)

    _rewrite_metadata(ck, point)


def test_zstd_decoded_payload_crc_is_checked(tmp_path: Path) -> None:
    """A bit flipped in the tensor's storage record before compression: the zstd stream is valid,
    the decoded zip's CRC-32 is not."""
    _zstd_ckpt(tmp_path)
    info = FileSystemReader(str(tmp_path)).read_metadata().storage_data[MetadataIndex("model.w", torch.Size([0, 0]))]
    stored = (tmp_path / "__0_0.distcp").read_bytes()[info.offset : info.offset + info.length]
    zip_bytes = bytearray(zstandard.ZstdDecompressor().stream_reader(io.BytesIO(stored)).read())
    (storage,) = [
        r for r in read_records(lambda n, at: bytes(zip_bytes[at : at + n]), len(zip_bytes)) if r.short_name.startswith("data/")
    ]
    zip_bytes[storage.data_offset + 5] ^= 0x10
    _replace_payload(tmp_path, "model.w", (0, 0), zstandard.ZstdCompressor().compress(bytes(zip_bytes)))
    with pytest.raises(CorruptChunkError, match=r"\(model\.w\): CRC-32 mismatch in a record of its torch.save zip"):
        _read_all(tmp_path)


def test_zstd_payload_that_decodes_too_large_is_corrupt(tmp_path: Path) -> None:
    """A 48-byte tensor's payload that decodes to 40 MiB (zeros compress to almost nothing) is refused
    before it is written out whole."""
    _zstd_ckpt(tmp_path)
    _replace_payload(tmp_path, "model.w", (0, 0), zstandard.ZstdCompressor().compress(bytes(40 << 20)))
    with pytest.raises(CorruptChunkError, match=r"\(model\.w\): decodes to more than 65712 bytes; the payload is corrupt"):
        _read_all(tmp_path)


def test_broken_zstd_stream_is_corrupt(tmp_path: Path) -> None:
    _zstd_ckpt(tmp_path)
    _replace_payload(tmp_path, "model.w", (0, 0), b"not a zstd frame at all")
    with pytest.raises(CorruptChunkError, match=r"\(model\.w\): stream transform\(s\) \['stream\.zstd/1'\] do not decode"):
        _read_all(tmp_path)


@pytest.mark.parametrize(
    ("writer", "formats"),
    [
        ({}, ("torch_save",)),
        ({"_extensions": [ZStandard()]}, ("stream.zstd/1", "torch_save")),
        ({"serialization_format": SerializationFormat.SAFETENSORS}, ("safetensors", "torch_save")),
    ],
)
def test_object_storage_checkpoints_of_each_payload_format_read(
    tmp_path: Path, writer: dict[str, Any], formats: tuple[str, ...]
) -> None:
    """The same checkpoints through fsspec (memory://): safetensors headers by ranged reads, zstd
    payloads decoded from the fetched range; payload_formats names what is stored."""
    import fsspec

    state = _save(tmp_path, **writer)
    fs = fsspec.filesystem("memory")
    url = f"memory://payloads-{tmp_path.name}"
    for p in tmp_path.iterdir():
        fs.pipe(f"{url}/{p.name}", p.read_bytes())
    assert payload_formats(read_index(url)) == formats
    got = _read_all(url)
    assert torch.equal(got["model.w"], state["model"]["w"]) and torch.equal(got["model.b"], state["model"]["b"])
    assert got["lr"] == 0.5


def test_safetensors_with_zstd_together_is_refused_saying_why(tmp_path: Path) -> None:
    """Both options at once: torch writes an empty zstd frame per tensor and the safetensors file
    untransformed after them, which its own reader cannot load; the error says to save with one."""
    _save(tmp_path, _extensions=[ZStandard()], serialization_format=SerializationFormat.SAFETENSORS)
    with pytest.raises(NotADcpCheckpointError, match="overlap .* serialization_format=SAFETENSORS and _extensions together"):
        read_index(tmp_path)  # several tensors: their recorded ranges overlap
    one = tmp_path / "one"
    state = {"w": torch.ones(3, 4), "lr": 0.5}
    dcp.save(
        state,
        storage_writer=FileSystemWriter(one, _extensions=[ZStandard()], serialization_format=SerializationFormat.SAFETENSORS),
        no_dist=True,
    )
    with pytest.raises(
        CorruptChunkError, match=r"\(w\): stream transform.* serialization_format=SAFETENSORS and _extensions together"
    ):
        _read_all(one)  # one tensor: its payload does not decode
