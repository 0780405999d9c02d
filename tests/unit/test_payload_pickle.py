"""formats/_payload_pickle.py: a chunk payload's data.pkl read without torch, checked against torch's own loader."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_convert.constants import STORAGE_DTYPE_NAMES
from fsdp_convert.formats._payload_pickle import PayloadTensor, contiguous, read_payload_tensor
from fsdp_convert.formats.index import DTYPE_ITEMSIZES
from tests._samples import Sample


def _pickle_of(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def _expected(t: torch.Tensor) -> PayloadTensor:
    return PayloadTensor(
        dtype_name=str(t.dtype).removeprefix("torch."),
        storage_key="0",
        storage_nbytes=t.untyped_storage().nbytes(),
        storage_offset=t.storage_offset(),
        sizes=tuple(t.shape),
        stride=tuple(t.stride()),
    )


def test_storage_classes_are_torchs() -> None:
    ours = {getattr(torch, name): dtype for name, dtype in STORAGE_DTYPE_NAMES.items()}
    theirs = {cls: str(dtype).removeprefix("torch.") for dtype, cls in torch.storage._dtype_to_storage_type_map().items()}
    assert {getattr(torch, cls): d for cls, d in theirs.items()} == ours


_DTYPES = [getattr(torch, n) for n in DTYPE_ITEMSIZES]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize(
    "make",
    [
        lambda d: torch.empty(5, 3, dtype=d),  # a DCP chunk as saved: its own storage
        lambda d: torch.empty(6, 4, dtype=d)[2:4],  # a view: storage offset, larger storage
        lambda d: torch.empty(4, 6, dtype=d).t(),  # not C order
        lambda d: torch.empty_strided((1, 3), (7, 1), dtype=d),  # size-1 dim, any stride: contiguous
        lambda d: torch.empty(0, 3, dtype=d),
        lambda d: torch.empty((), dtype=d),
    ],
    ids=["own", "offset", "transposed", "size1", "empty", "scalar"],
)
def test_agrees_with_torch_load(dtype: torch.dtype, make: Any) -> None:
    t = make(dtype)
    got = read_payload_tensor(_pickle_of(t))
    assert got == _expected(t)
    assert contiguous(got.sizes, got.stride) == t.is_contiguous()


@pytest.mark.parametrize(
    "obj",
    [
        lambda: torch.nn.Parameter(torch.zeros(2)),  # _rebuild_parameter: torch's loader decides
        lambda: torch.zeros(2, dtype=torch.int8).view(torch.uint8).reshape(2, 1).expand(2, 3),  # a zero stride
        lambda: {"a": torch.zeros(2)},
        lambda: [1, 2],
        lambda: torch.zeros(2).to_sparse(),
    ],
    ids=["parameter", "expanded", "dict", "list", "sparse"],
)
def test_anything_else_is_left_to_torch(obj: Any) -> None:
    value = obj()
    got = read_payload_tensor(_pickle_of(value))
    if isinstance(value, torch.Tensor) and got is not None:  # read, but not taken as its storage whole
        assert not contiguous(got.sizes, got.stride) and got == _expected(value)
    else:
        assert got is None


def test_hooks_or_hostile_globals_are_left_to_torch() -> None:
    t = torch.zeros(2)
    raw = _pickle_of(t)
    assert (
        read_payload_tensor(raw.replace(b"collections\nOrderedDict", b"os\nsystem\x00\x00\x00\x00\x00\x00\x00\x00\x00")) is None
    )
    assert read_payload_tensor(raw[:-5]) is None  # truncated
    assert read_payload_tensor(b"") is None
    assert read_payload_tensor(raw.replace(b"X\x03\x00\x00\x00cpu", b"X\x03\x00\x00\x00xpu")) is None  # not a CPU storage


def test_every_chunk_of_a_real_checkpoint_is_located_without_torch(ws3_bf16_ckpt: Sample) -> None:
    """locate() finds every chunk of a real FSDP2 checkpoint with torch never imported, where zipfile finds it."""
    script = f"""
import sys, json
from pathlib import Path
sys.modules["torch"] = None  # any import of torch fails
from fsdp_convert.formats import open_checkpoint
src = open_checkpoint(Path({str(ws3_bf16_ckpt.checkpoint)!r}))
out = []
with src.open_reader() as reader:
    for e in src.index.tensors():
        for c in e.chunks:
            s = reader.locate(e, c)
            out.append([e.fqn, c.relative_path, c.offset_bytes, c.length_bytes, s.offset, s.nbytes, s.crc32])
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    located = json.loads(done.stdout)
    assert len(located) > 20
    for fqn, rel, at, length, offset, nbytes, crc in located:
        data = (Path(ws3_bf16_ckpt.checkpoint) / rel).read_bytes()
        with zipfile.ZipFile(io.BytesIO(data[at : at + length])) as z:
            info = next(i for i in z.infolist() if "/data/" in i.filename)
            assert (info.CRC, info.file_size) == (crc, nbytes), fqn
            assert data[offset : offset + nbytes] == z.read(info), fqn  # the bytes located are the storage record's
