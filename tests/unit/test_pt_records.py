"""A torch.save file read without torch (issue 36): its pickle as records of where each tensor lies, and verify on those bytes.

``formats._pt_records`` reads a torch.save zip's ``data.pkl`` as ``StoredTensor`` records;
``FileBoxReader.locate`` then gives a contiguous tensor's bytes. Checked against ``torch.load``:
the same keys, dtypes, shapes and bytes, for every dtype, views of one storage and parameters;
what the records leave to torch's loader is read as before. ``verify`` of a DCP folder and its
consolidated .pt compares those bytes (``ops._compare.same_stored_bytes``) and imports no torch,
and still names the key of a flipped byte.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import sys
import warnings
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp_convert
from fsdp_convert.errors import CorruptChunkError
from fsdp_convert.formats.file_views import TorchSaveRecords
from fsdp_convert.formats.full_file import FileBoxReader, file_index
from fsdp_convert.formats.index import TensorEntry, flatten_with_paths
from fsdp_convert.formats.reader import StoredBytes
from fsdp_convert.ops import _compare
from fsdp_convert.ops._compare import ByteBuffers, same_stored_bytes
from fsdp_convert.transform import TransformOptions
from tests._cli_probe import cli_probe
from tests._compare import same_bits, tensor_bytes
from tests._dtypes import DTYPES, adversarial
from tests._samples import Sample

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def _located(path: Path) -> dict[str, bytes | None]:
    """Each tensor of ``file_index`` -> its bytes where ``FileBoxReader.locate`` finds them (None: not located)."""
    found: dict[str, bytes | None] = {}
    with FileBoxReader(path) as reader:
        for entry in file_index(path).entries:
            if isinstance(entry, TensorEntry):
                stored = reader.locate(entry, entry.chunks[0])
                found[entry.fqn] = None if stored is None else os.pread(stored.fd, stored.nbytes, stored.offset)
    return found


def _read_back(path: Path) -> dict[str, Any]:
    """Each entry of ``file_index`` -> what ``FileBoxReader`` reads for it (a tensor or a plain value)."""
    with FileBoxReader(path) as reader:
        return {
            e.fqn: reader.read_tensor(e) if isinstance(e, TensorEntry) else reader.read_value(e) for e in file_index(path).entries
        }


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_dtype_is_indexed_and_located_at_its_bytes(tmp_path: Path, name: str) -> None:
    dtype = DTYPES[name]
    tensors = {"odd": adversarial(dtype, (7, 5), 0), "scalar": adversarial(dtype, (), 1), "empty": adversarial(dtype, (0, 3), 2)}
    state = {"model": {**tensors, "param": torch.nn.Parameter(adversarial(dtype, (2, 3), 3), requires_grad=False)}, "step": 7}
    torch.save(state, tmp_path / "x.pt")
    records = TorchSaveRecords.open(tmp_path / "x.pt")
    assert records is not None
    records.close()
    entries = {e.fqn: e for e in file_index(tmp_path / "x.pt").entries}
    want = {f"model.{k}": t for k, t in state["model"].items()}  # type: ignore[attr-defined]
    assert list(entries) == [*want, "step"]
    for fqn, t in want.items():
        entry = entries[fqn]
        assert isinstance(entry, TensorEntry) and (entry.dtype_name, entry.shape) == (name, tuple(t.shape))
    located = _located(tmp_path / "x.pt")
    assert {fqn: located[fqn] for fqn in want} == {fqn: bytes(tensor_bytes(t).tolist()) for fqn, t in want.items()}
    got = _read_back(tmp_path / "x.pt")
    assert got["step"] == 7 and all(same_bits(got[fqn], t) for fqn, t in want.items())


def test_views_of_one_storage_are_located_where_their_elements_lie(tmp_path: Path) -> None:
    """torch.save keeps a view with its base's storage: a contiguous one is located at its offset, a strided one is not."""
    base = torch.arange(24, dtype=torch.int64)
    grid = base.view(4, 6)
    state = {"whole": base, "tail": base[8:], "rows": grid[1:3], "cols": grid[:, 1:3], "transposed": grid.t()}
    torch.save(state, tmp_path / "x.pt")
    located = _located(tmp_path / "x.pt")
    assert {k: v is not None for k, v in located.items()} == {
        "whole": True,
        "tail": True,
        "rows": True,
        "cols": False,
        "transposed": False,
    }
    for key in ("whole", "tail", "rows"):
        assert located[key] == bytes(tensor_bytes(state[key]).tolist())
    got = _read_back(tmp_path / "x.pt")  # the strided ones through torch's loader
    assert all(same_bits(got[k], t.contiguous()) for k, t in state.items())


@pytest.mark.parametrize(
    ("content", "kwargs"),
    [
        ({"model": {"w": torch.ones(3)}}, {"_use_new_zipfile_serialization": False}),
        ({"model": {"w": torch.ones(3)}, "extra": [torch.zeros(2), torch.ones(1)]}, {}),
        ({"model": {"w": torch.ones(3)}, "size": torch.Size([2, 3])}, {}),
        ({"model": {"w": torch.ones(3)}}, {"pickle_protocol": 4}),
    ],
    ids=["legacy format", "a list of tensors", "a torch.Size value", "pickle protocol 4"],
)
def test_what_the_records_do_not_cover_is_read_by_torch_as_before(tmp_path: Path, content: Any, kwargs: Any) -> None:
    torch.save(content, tmp_path / "x.pt", **kwargs)
    assert TorchSaveRecords.open(tmp_path / "x.pt") is None
    try:
        want = torch.load(tmp_path / "x.pt", weights_only=True)
    except Exception:  # protocol 4: torch's weights_only loader may refuse it, and so does this tool then
        with pytest.raises(fsdp_convert.CheckpointError):
            file_index(tmp_path / "x.pt")
        return
    got = _read_back(tmp_path / "x.pt")
    assert list(got) == list(flatten_with_paths(want))
    assert same_bits(got["model.w"], want["model"]["w"])


def _write(path: Path, chunks: list[tuple[int, bytes]]) -> int:
    """A file holding each chunk's bytes at its offset; its open descriptor."""
    with open(path, "wb") as f:
        for at, data in chunks:
            f.seek(at)
            f.write(data)
    return os.open(path, os.O_RDONLY)


@pytest.mark.parametrize(("block", "small"), [(64, 16), (64, 0), (4096, 64 << 10)], ids=["copies", "whole-buffer", "one-block"])
def test_stored_bytes_compare_across_pieces_and_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int, small: int
) -> None:
    """Pieces split differently on each side, blocks across their edges: every flipped byte found, equal after each."""
    monkeypatch.setattr(_compare, "BLOCK_BYTES", block)
    monkeypatch.setattr(_compare, "_SMALL_BYTES", small)
    data = os.urandom(1000)
    fd_a = _write(tmp_path / "a", [(10, data[:300]), (400, data[300:])])
    a = [
        (0, StoredBytes(fd=fd_a, offset=10, nbytes=300, crc32=zlib.crc32(data[:300]), where="a0")),
        (300, StoredBytes(fd=fd_a, offset=400, nbytes=700, crc32=zlib.crc32(data[300:]), where="a1")),
    ]
    buffers = ByteBuffers()
    with ThreadPoolExecutor(2) as pool:
        for flip in (None, 0, 63, 64, 299, 300, 999):
            raw = bytearray(data)
            if flip is not None:
                raw[flip] ^= 0x10
            fd_b = _write(tmp_path / "b", [(7, bytes(raw))])
            b = [(0, StoredBytes(fd=fd_b, offset=7, nbytes=1000, crc32=None, where="b"))]
            try:
                assert same_stored_bytes(a, b, pool, buffers) is (flip is None), flip
                assert same_stored_bytes(
                    a[:1], [(0, StoredBytes(fd=fd_b, offset=7, nbytes=300, crc32=None, where="b"))], pool, buffers
                ) is (flip is None or flip >= 300)
            finally:
                os.close(fd_b)
        bad = [(0, StoredBytes(fd=fd_a, offset=10, nbytes=300, crc32=zlib.crc32(data[:300]) ^ 1, where="a0 (w)"))]
        with pytest.raises(CorruptChunkError, match=r"a0 \(w\): CRC-32 mismatch"):
            same_stored_bytes(bad, a[:1], pool, buffers)
    os.close(fd_a)


@pytest.fixture(scope="module")
def consolidated_ws3(ws3_ckpt: Sample, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pt_records") / "full.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, out, nproc=1)
    return out


def test_verify_of_a_dcp_folder_and_its_consolidated_pt_imports_no_torch(ws3_ckpt: Sample, consolidated_ws3: Path) -> None:
    argv = ["verify", str(ws3_ckpt.checkpoint), str(consolidated_ws3), "--as-consolidated", "--nproc", "1", "--json"]
    report, stderr = cli_probe(argv)
    assert report["code"] == 0, stderr
    assert report["modules"] == []


def test_a_flipped_byte_in_the_pt_is_reported_with_its_key(ws3_ckpt: Sample, consolidated_ws3: Path, tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    out.write_bytes(consolidated_ws3.read_bytes())
    entry = max((e for e in file_index(out).entries if isinstance(e, TensorEntry)), key=lambda e: e.nbytes)
    with FileBoxReader(out) as reader:
        stored = reader.locate(entry, entry.chunks[0])
        assert stored is not None
        at = stored.offset + stored.nbytes // 2 + 1
    with open(out, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))
    result = fsdp_convert.verify(ws3_ckpt.checkpoint, out, transform=TransformOptions(), nproc=1)
    assert [(d.key, d.kind) for d in result.differences] == [(entry.fqn, "differs")]
    assert result.differences[0].detail.startswith("values differ"), result.differences
    assert result.compared == len(file_index(out).entries)


class _Storage:
    """A storage reference as torch.save pickles it: a persistent id ``("storage", class, key, "cpu", numel)``."""

    def __init__(self, cls: type, key: str, numel: int) -> None:
        self.pid = ("storage", cls, key, "cpu", numel)


class _Tensor:
    """A tensor as torch.save pickles it: ``_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())``."""

    def __init__(self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self) -> tuple[Any, ...]:
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _Storage) else None


def _crafted(path: Path, state: dict[str, Any], storages: dict[str, bytes], *, twice: str | None = None) -> None:
    """A torch.save zip written by hand: ``state`` pickled (protocol 2), each storage a record (``twice``: that one two times)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(state)
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        warnings.simplefilter("ignore", UserWarning)  # zipfile: "Duplicate name"
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", sys.byteorder)
        for key, data in storages.items():
            z.writestr(f"archive/data/{key}", data)
            if key == twice:
                z.writestr(f"archive/data/{key}", bytes(len(data)))
        z.writestr("archive/version", "3\n")


def _torch_reads(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in torch.load(path, weights_only=True).items()}


def test_a_crafted_file_is_read_as_torch_reads_it(tmp_path: Path) -> None:
    """A zip written by hand, storages shared and offset: the records agree with torch.load, byte for byte."""
    data = torch.arange(8, dtype=torch.float32)
    floats = _Storage(torch.FloatStorage, "0", 8)
    _crafted(
        tmp_path / "x.pt",
        {"a": _Tensor(floats, 0, (2, 4), (4, 1)), "b": _Tensor(floats, 2, (3,), (1,))},
        {"0": data.numpy().tobytes()},
    )
    assert TorchSaveRecords.open(tmp_path / "x.pt") is not None
    want = _torch_reads(tmp_path / "x.pt")
    assert _located(tmp_path / "x.pt") == {k: bytes(tensor_bytes(t).tolist()) for k, t in want.items()}


@pytest.mark.parametrize("fault", ["a storage as two classes", "a storage as two lengths", "a record twice", "past its storage"])
def test_a_crafted_file_the_records_could_read_otherwise_than_torch_is_left_to_torch(tmp_path: Path, fault: str) -> None:
    data = torch.arange(8, dtype=torch.float32).numpy().tobytes()
    first = _Storage(torch.FloatStorage, "0", 8)
    second = {
        "a storage as two classes": _Storage(torch.HalfStorage, "0", 16),
        "a storage as two lengths": _Storage(torch.FloatStorage, "0", 4),
    }.get(fault, first)
    size = (9,) if fault == "past its storage" else (4,)
    state = {"a": _Tensor(first, 0, (8,), (1,)), "b": _Tensor(second, 0, size, (1,))}
    _crafted(tmp_path / "x.pt", state, {"0": data}, twice="0" if fault == "a record twice" else None)
    assert TorchSaveRecords.open(tmp_path / "x.pt") is None
    try:
        want = _torch_reads(tmp_path / "x.pt")
    except Exception:
        with pytest.raises(fsdp_convert.CheckpointError):
            _read_back(tmp_path / "x.pt")
        return
    got = _read_back(tmp_path / "x.pt")
    assert list(got) == list(want) and all(same_bits(got[k], t) for k, t in want.items())
