"""reshard's pickles without torch (issue 26): ``.metadata`` and bytes entries' payloads are torch's own bytes.

``writers._dcp_pickle`` pickles stand-ins of torch's ``Metadata`` records; here its bytes are
compared with ``pickle.dumps`` of torch's objects built from the same entries and rows (the writer
as it was before), for real reshards of the FSDP2 samples and for made-up indexes at the pickler's
batch edges; a plain value's payload with ``torch.save``'s.
"""

from __future__ import annotations

import collections
import io
import pickle
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from fsdp_convert import reshard
from fsdp_convert.dtypes import ITEMSIZES, as_dtype
from fsdp_convert.formats.index import DictKey, plain_path
from fsdp_convert.ops import _reshard_rank
from fsdp_convert.outputs import dcp_folder
from fsdp_convert.transform import TransformOptions
from fsdp_convert.writers import dcp
from fsdp_convert.writers._dcp_pickle import is_plain, value_payload
from fsdp_convert.writers._torch_pickle import PurePickler
from fsdp_convert.writers.dcp import MetadataEntry, StoredChunk, write_metadata
from tests._cli_probe import cli_probe
from tests._samples import Sample

SAVE_ID = uuid.UUID("0b5f1c2e-7d4a-4e8b-9c3d-2a1f6e5d4c3b")


def _torch_metadata_bytes(entries: Sequence[MetadataEntry], stored: Sequence[StoredChunk], version: str | None) -> bytes:
    """``.metadata`` as write_metadata wrote it with torch's classes (before issue 26), the same objects passed."""
    state_dict_metadata: dict[str, Any] = {}
    for e in entries:
        if e.dtype is None or e.shape is None:
            state_dict_metadata[e.fqn] = BytesStorageMetadata()
        else:
            chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in e.chunks]
            state_dict_metadata[e.fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=as_dtype(e.dtype).torch), size=torch.Size(e.shape), chunks=chunks
            )
    storage_data = {
        MetadataIndex(c.fqn, c.offsets): _StorageInfo(
            relative_path=c.relative_path,
            offset=c.offset_bytes,
            length=c.length_bytes,
            transform_descriptors=list(c.transform_descriptors) or None,
        )
        for c in stored
    }
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data={e.fqn: plain_path(e.path) for e in entries},
        storage_data=storage_data,
        storage_meta=StorageMeta(save_id=str(SAVE_ID)),
        version=version or "1.0.0",
    )
    return pickle.dumps(metadata)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, list[MetadataEntry], list[StoredChunk], str | None]]:
    """Every ``write_metadata`` call's arguments, the save id fixed."""
    calls: list[tuple[Path, list[MetadataEntry], list[StoredChunk], str | None]] = []
    original = dcp.write_metadata

    def recording(folder: Path, entries: Any, stored: Any, version: str | None) -> None:
        calls.append((folder, list(entries), list(stored), version))
        original(folder, entries, stored, version)

    monkeypatch.setattr(dcp_folder, "write_metadata", recording)  # what reshard's DCP folder row calls
    monkeypatch.setattr(uuid, "uuid4", lambda: SAVE_ID)
    return calls


@pytest.mark.parametrize(("world_size", "compress"), [(1, None), (2, None), (4, None), (2, "zstd")])
def test_resharded_metadata_is_torchs_pickle_byte_for_byte(
    ws3_ckpt: Sample, tmp_path: Path, captured: list[Any], world_size: int, compress: str | None
) -> None:
    if compress:
        pytest.importorskip("zstandard")
    out = tmp_path / "out"
    reshard(ws3_ckpt.checkpoint, out, world_size=world_size, nproc=1, compress=compress)
    ((folder, entries, stored, version),) = captured
    written = (out / ".metadata").read_bytes()
    assert written == _torch_metadata_bytes(entries, stored, version)
    assert any(e.dtype is None for e in entries) and any(e.dtype is not None for e in entries)
    # torch's reader takes it, and pickling what it read gives the same bytes again
    read = FileSystemReader(str(out)).read_metadata()
    assert set(read.state_dict_metadata) == {e.fqn for e in entries}
    assert pickle.dumps(pickle.loads(written)) == written
    if compress:
        assert all(i.transform_descriptors == ["stream.zstd/1"] for i in read.storage_data.values())


def test_resharded_bf16_optim_ids_metadata_is_torchs_pickle(ws3_bf16_ckpt: Sample, tmp_path: Path, captured: list[Any]) -> None:
    out = tmp_path / "out"
    reshard(ws3_bf16_ckpt.checkpoint, out, world_size=2, nproc=1, transform=TransformOptions(optim_keys="ids"))
    ((_, entries, stored, version),) = captured
    assert (out / ".metadata").read_bytes() == _torch_metadata_bytes(entries, stored, version)
    assert {str(e.dtype) for e in entries if e.dtype is not None} >= {"torch.bfloat16"}


@dataclass(frozen=True)
class _Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _made_up(n_tensors: int, n_values: int, *, chunks_each: int = 1) -> tuple[list[MetadataEntry], list[StoredChunk]]:
    """An index with every dtype, 0-dim tensors, offsets past 2**31 and 2**32, shared and unshared FQN strings."""
    dtypes = sorted(ITEMSIZES)
    entries, stored = [], []
    at = 2**31 - 100
    for i in range(n_tensors):
        path: tuple[Any, ...] = (f"w{i}",) if i % 3 == 0 else ("model", "layers", DictKey(i) if i % 3 == 1 else i, "weight")
        fqn = ".".join(str(p) for p in path)
        shape = () if i % 7 == 0 else (chunks_each * 2, 3)
        boxes = [_Box((), ())] if not shape else [_Box((2 * k, 0), (2, 3)) for k in range(chunks_each)]
        entries.append(MetadataEntry(fqn=fqn, path=path, dtype=as_dtype(dtypes[i % len(dtypes)]), shape=shape, chunks=boxes))
        for b in boxes:
            descriptors = ("stream.zstd/1",) if i % 2 else ()
            key = fqn if i % 5 else "".join(fqn)  # an FQN as the same str object, or an equal one
            stored.append(StoredChunk(key, b.offsets, f"__{i % 3}_0.distcp", at, 1234 + i, descriptors))
            at += 2**20 + i
    for j in range(n_values):
        path = ("optim", "param_groups", j % 4, "lr")
        fqn = ".".join(str(p) for p in path) + f"_{j}"
        entries.append(MetadataEntry(fqn=fqn, path=(*path[:-1], f"lr_{j}"), dtype=None, shape=None, chunks=()))
        stored.append(StoredChunk(fqn, None, "__0_0.distcp", at, 500))
        at += 700
    return entries, stored


@pytest.mark.parametrize(
    ("n_tensors", "n_values", "chunks_each"),
    [(0, 0, 1), (1, 0, 1), (0, 1, 1), (5, 3, 2), (999, 1, 1), (1000, 0, 1), (1000, 1000, 1), (1001, 0, 1), (3, 0, 1001)],
)
def test_made_up_metadata_is_torchs_pickle_at_the_batch_edges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n_tensors: int, n_values: int, chunks_each: int
) -> None:
    monkeypatch.setattr(uuid, "uuid4", lambda: SAVE_ID)
    entries, stored = _made_up(n_tensors, n_values, chunks_each=chunks_each)
    write_metadata(tmp_path, entries, stored, "1.0.0" if n_values % 2 else None)
    assert (tmp_path / ".metadata").read_bytes() == _torch_metadata_bytes(entries, stored, "1.0.0" if n_values % 2 else None)


def test_metadata_takes_a_torch_dtype_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uuid, "uuid4", lambda: SAVE_ID)
    entries = [MetadataEntry(fqn="w", path=("w",), dtype=torch.float16, shape=(2,), chunks=[_Box((0,), (2,))])]  # type: ignore[arg-type]
    stored = [StoredChunk("w", (0,), "__0_0.distcp", 0, 10)]
    write_metadata(tmp_path, entries, stored, None)
    assert (tmp_path / ".metadata").read_bytes() == _torch_metadata_bytes(entries, stored, None)


def test_save_id_is_a_new_uuid4_each_time(tmp_path: Path) -> None:
    ids = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_metadata(tmp_path / name, [], [], None)
        with open(tmp_path / name / ".metadata", "rb") as f:
            ids.append(uuid.UUID(pickle.load(f).storage_meta.save_id))
    assert ids[0] != ids[1] and all(u.version == 4 for u in ids)


_PLAIN_VALUES: list[Any] = [
    0,
    -(2**70),
    1e-3,
    float("inf"),
    1 + 2j,
    None,
    True,
    "",
    "é" * 300,
    b"",
    b"\x00\xff" * 40,
    (0.9, 0.999),
    {"lr": 1e-3, "betas": (0.9, 0.999), "params": ["a", "b"], "foreach": None, "amsgrad": False},
    [f"model.layers.{i}.w" for i in range(1001)],
    {str(i): [i, (i,)] for i in range(1000)},
    {i: i for i in range(2001)},
    [[], {}, ()],
]


@pytest.mark.parametrize("value", _PLAIN_VALUES, ids=range(len(_PLAIN_VALUES)))
def test_plain_value_payload_is_torch_save_byte_for_byte(value: Any) -> None:
    buf = io.BytesIO()
    torch.save(value, buf)
    assert is_plain(value)
    assert value_payload(value) == buf.getvalue() == _reshard_rank._payload(value)


def test_shared_objects_in_a_plain_value_stay_shared() -> None:
    shared = ["x", "y"]
    value = {"a": shared, "b": shared, "c": (shared, shared)}
    buf = io.BytesIO()
    torch.save(value, buf)
    assert value_payload(value) == buf.getvalue()


@pytest.mark.parametrize(
    "value",
    [torch.zeros(2), {"w": [torch.ones(1)]}, collections.OrderedDict(a=1), {1, 2}, torch.float32, (torch.Size([2]),)],
    ids=["tensor", "nested-tensor", "ordered-dict", "set", "dtype", "size"],
)
def test_values_not_plain_go_through_torch_save(value: Any) -> None:
    assert not is_plain(value)
    with pytest.raises(ValueError, match="not a plain value"):
        value_payload(value)
    buf = io.BytesIO()
    torch.save(value, buf)
    assert _reshard_rank._payload(value) == buf.getvalue()


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("n", [0, 1, 2, 999, 1000, 1001, 2000, 2001])
def test_pure_pickler_batches_as_the_c_pickler(protocol: int, n: int) -> None:
    for value in (
        [f"s{i}" for i in range(n)],
        {f"k{i}": [i] for i in range(n)},
        set(range(n)),
        collections.OrderedDict.fromkeys(range(n)),
    ):
        buf = io.BytesIO()
        PurePickler(buf, protocol=protocol).dump(value)
        assert buf.getvalue() == pickle.dumps(value, protocol=protocol), (type(value), n)


def test_reshard_of_a_dcp_folder_imports_no_torch(ws3_ckpt: Sample, tmp_path: Path) -> None:
    out = tmp_path / "out"
    report, stderr = cli_probe(["reshard", str(ws3_ckpt.checkpoint), str(out), "--world-size", "2", "--nproc", "1", "--json"])
    assert report["code"] == 0, stderr
    assert report["modules"] == []
    assert (out / ".metadata").is_file()
