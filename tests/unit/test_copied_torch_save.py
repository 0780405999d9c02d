"""writers/copied_torch_save.py: torch.save files whose storages are byte ranges copied from other files load back exactly.

Each output tensor is a ``CopiedTensor``: copies from source files at any byte offset, gaps
between them that must read as zeros; beside them the files hold small tensors rank 0 writes
itself, nested dicts with int keys (``DictKey``), lists, and ``Reduced`` stand-ins for classes of
another package (here the stdlib's, so ``torch.load(weights_only=False)`` can rebuild them: these
are files the test made). ``torch.load`` must give exactly the expected tensors and objects, and
``zipfile.testzip`` must find every CRC-32 right.
"""

from __future__ import annotations

import argparse
import os
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_convert.errors import CorruptChunkError
from fsdp_convert.formats.index import DictKey, ObjPath
from fsdp_convert.writers.copied_torch_save import ByteCopy, CopiedTensor, write_copied_files
from fsdp_convert.writers.torch_save import Reduced, TensorSlot
from tests._compare import assert_same_state

F32 = torch.float32
BF16 = torch.bfloat16
A_AT = 7  # source "a": float32 values after 7 junk bytes (copies start at unaligned offsets)
BIG = (9 << 20) // 4 + 123  # float32 elements of the big source: one copy past the writer's 8 MiB buffer


class Sources:
    """Source files by the names copies use, opened read-only; each one's tensor as the bytes were written."""

    def __init__(self, root: Path) -> None:
        gen = torch.Generator().manual_seed(0)
        self.a = torch.randn(100, generator=gen)
        self.b = torch.randn(64, generator=gen).to(BF16)
        self.big = torch.randn(BIG, generator=gen)
        (root / "dir").mkdir()
        (root / "a.bin").write_bytes(b"junk!!!" + self.a.numpy().tobytes())
        (root / "dir" / "b.bin").write_bytes(self.b.view(torch.int16).numpy().tobytes())
        (root / "big.bin").write_bytes(self.big.numpy().tobytes())
        self.fds = {name: os.open(root / name, os.O_RDONLY) for name in ("a.bin", "dir/b.bin", "big.bin")}

    def fd(self, name: str) -> int:
        return self.fds[name]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


@pytest.fixture
def sources(tmp_path: Path) -> Iterator[Sources]:
    (tmp_path / "src").mkdir()
    opened = Sources(tmp_path / "src")
    yield opened
    opened.close()


def _a(lo: int, hi: int, dst: int) -> ByteCopy:
    """Elements ``[lo, hi)`` of source ``a`` to element ``dst`` of a float32 storage."""
    return ByteCopy("a.bin", A_AT + lo * 4, (hi - lo) * 4, dst * 4)


def _files(s: Sources) -> tuple[list[list[tuple[ObjPath, Any]]], list[dict[str, Any]]]:
    """Two files' items (``write_copied_files``'s input) and what ``torch.load`` must give for each."""
    w = torch.zeros(20)
    w[0:6], w[9:14], w[17:20] = s.a[4:10], s.a[50:55], s.a[0:3]  # gaps at 6..9 and 14..17
    b = torch.zeros(3, 8, dtype=BF16)
    b.view(-1)[2:10], b.view(-1)[10:24] = s.b[0:8], s.b[40:54]  # a gap at 0..2, two copies back to back
    big = torch.zeros(BIG + (3 << 20) // 4 + 5)
    big[:BIG] = s.big  # then a 3 MiB gap of zeros, then a copy of a's last elements
    big[-5:] = s.a[95:]
    first: list[tuple[ObjPath, Any]] = [
        (("module", "w"), CopiedTensor(TensorSlot(F32, (4, 5)), (_a(4, 10, 0), _a(50, 55, 9), _a(0, 3, 17)))),
        (
            ("module", "b"),
            CopiedTensor(TensorSlot(BF16, (3, 8)), (ByteCopy("dir/b.bin", 0, 16, 4), ByteCopy("dir/b.bin", 80, 28, 20))),
        ),
        (("module", "zeros"), CopiedTensor(TensorSlot(F32, (2, 3)), ())),
        (("module", "empty"), CopiedTensor(TensorSlot(F32, (0, 4)), ())),
        (("module", "step"), torch.tensor(3.0)),
        (("optimizer_state_dict", "state", DictKey(0), "exp_avg"), CopiedTensor(TensorSlot(F32, (6,)), (_a(20, 26, 0),))),
        (("optimizer_state_dict", "state", DictKey(0), "step"), torch.tensor(2.0)),
        (("optimizer_state_dict", "state", DictKey(1), "exp_avg"), CopiedTensor(TensorSlot(F32, (3,)), (_a(30, 32, 1),))),
        (("optimizer_state_dict", "param_groups", 0, "lr"), 0.01),
        (("optimizer_state_dict", "param_groups", 0, "params"), [0, 1]),
        (("optimizer_state_dict", "args"), Reduced("argparse", "Namespace", (), {"lr": 0.5, "names": ["x", "y"]}, newobj=True)),
        (("optimizer_state_dict", "ratio"), Reduced("fractions", "Fraction", (3, 4), None, newobj=False)),
        (("mappings",), [OrderedDict([("emb", Reduced("fractions", "Fraction", (1, 2), None, newobj=False))])]),
        (("ints",), torch.tensor([1, 2, 3])),
        (("global_steps",), 2),
    ]
    want_first = {
        "module": {
            "w": w.reshape(4, 5),
            "b": b,
            "zeros": torch.zeros(2, 3),
            "empty": torch.zeros(0, 4),
            "step": torch.tensor(3.0),
        },
        "optimizer_state_dict": {
            "state": {
                0: {"exp_avg": s.a[20:26].clone(), "step": torch.tensor(2.0)},
                1: {"exp_avg": torch.cat([torch.zeros(1), s.a[30:32]])},
            },
            "param_groups": [{"lr": 0.01, "params": [0, 1]}],
            "args": argparse.Namespace(lr=0.5, names=["x", "y"]),
            "ratio": Fraction(3, 4),
        },
        "mappings": [OrderedDict([("emb", Fraction(1, 2))])],
        "ints": torch.tensor([1, 2, 3]),
        "global_steps": 2,
    }
    second: list[tuple[ObjPath, Any]] = [
        (
            ("big",),
            CopiedTensor(
                TensorSlot(F32, tuple(big.shape)), (ByteCopy("big.bin", 0, BIG * 4, 0), _a(95, 100, BIG + (3 << 20) // 4))
            ),
        ),
        (("w_again",), CopiedTensor(TensorSlot(F32, (5,)), (_a(4, 9, 0),))),  # the same source bytes as another file's
        (("state", DictKey(7)), 1.5),
    ]
    want_second = {"big": big, "w_again": s.a[4:9].clone(), "state": {7: 1.5}}
    return [first, second], [want_first, want_second]


def _write(tmp_path: Path, sources: Sources, files: list[list[tuple[ObjPath, Any]]], workers: int) -> tuple[list[Path], int]:
    paths = [tmp_path / f"out{i}.pt" for i in range(len(files))]
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644) for p in paths]
    try:
        total = write_copied_files(list(zip(fds, files, strict=True)), sources.fd, workers)
    finally:
        for fd in fds:
            os.close(fd)
    return paths, total


def _int_keys_are_ints(obj: Any) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            assert type(key) in (str, int), f"key {key!r} is a {type(key).__name__}"
            _int_keys_are_ints(value)
    elif isinstance(obj, list):
        for value in obj:
            _int_keys_are_ints(value)


@pytest.mark.parametrize("workers", [1, 3])
def test_copied_files_load_back_exactly(tmp_path: Path, sources: Sources, workers: int) -> None:
    files, wants = _files(sources)
    paths, total = _write(tmp_path, sources, files, workers)
    assert total == sum(p.stat().st_size for p in paths)
    for path, want in zip(paths, wants, strict=True):
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None, f"{path.name}: a record's CRC-32 is wrong"
        got = torch.load(path, weights_only=False)  # the Reduced values are stdlib classes; the test made the file
        assert_same_state(got, want)
        _int_keys_are_ints(got)
    got = torch.load(paths[0], weights_only=False)
    assert type(got["optimizer_state_dict"]["args"]) is argparse.Namespace
    assert type(got["optimizer_state_dict"]["ratio"]) is Fraction
    assert type(got["mappings"][0]) is OrderedDict and type(got["mappings"][0]["emb"]) is Fraction


def test_a_file_of_tensors_and_plain_values_loads_with_weights_only_and_mmap(tmp_path: Path, sources: Sources) -> None:
    """Without Reduced values the file is plain torch.save: torch's restricted loader reads it, storages mapped in place."""
    files, wants = _files(sources)
    paths, _ = _write(tmp_path, sources, [files[1]], workers=2)
    assert_same_state(torch.load(paths[0], weights_only=True, mmap=True), wants[1])


def test_a_source_shorter_than_a_copy_is_corrupt(tmp_path: Path, sources: Sources) -> None:
    """Source ``a`` holds 100 float32 values after its junk: a copy of elements 98..102 reads past its end."""
    short: list[list[tuple[ObjPath, Any]]] = [[(("w",), CopiedTensor(TensorSlot(F32, (4,)), (_a(98, 102, 0),)))]]
    with pytest.raises(CorruptChunkError, match=r"a\.bin: short read at byte .*truncated"):
        _write(tmp_path, sources, short, workers=2)


def test_a_copy_starting_past_the_source_end_is_corrupt(tmp_path: Path, sources: Sources) -> None:
    past: list[list[tuple[ObjPath, Any]]] = [
        [(("w",), CopiedTensor(TensorSlot(F32, (2,)), (ByteCopy("dir/b.bin", 10_000, 8, 0),)))]
    ]
    with pytest.raises(CorruptChunkError, match=r"dir/b\.bin: short read at byte 10000"):
        _write(tmp_path, sources, past, workers=1)
