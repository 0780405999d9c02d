"""writers/_torch_zip.py, _serialization_id.py, _torch_pickle.py: torch.save's container and pickle, byte for byte, without torch.

The references are torch's own: its zip writer (``torch_compat.open_torch_save_writer``, what
``writers.torch_save`` drove before) and the pickler ``writers.torch_save`` used, kept below as it
was (``pickle.Pickler`` with torch's storage classes and rebuild functions).
"""

from __future__ import annotations

import collections
import ctypes
import io
import json
import math
import os
import pickle
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp_convert.writers.torch_save as torch_save
from fsdp_convert.formats.index import unflatten
from fsdp_convert.torch_compat import (
    REBUILD_TENSOR_V2,
    REBUILD_TENSOR_V3,
    open_torch_save_writer,
    reserve_record,
    storage_alignment,
    storage_type_for,
)
from fsdp_convert.writers._serialization_id import PRIME_LIST
from fsdp_convert.writers._torch_pickle import STORAGE_CLASS_NAMES, StorageRef, TensorRef, dumps, storage_class_name
from fsdp_convert.writers._torch_zip import STORAGE_ALIGNMENT, TorchZipWriter
from fsdp_convert.writers.torch_save import TensorSlot, _HeaderImage
from tests._compare import assert_same_state
from tests._dtypes import DTYPES as LOADABLE_DTYPES
from tests._dtypes import SHAPES
from tests._torch_free import Dtype, items_from_spec, storage_bytes, write_file, write_payload

ROOT = Path(__file__).resolve().parents[2]
ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)  # every dtype torch 2.13 has

# --- the references: torch's writer, and writers/torch_save.py's pickler as it was -------------------------


class _StorageRef:
    """Stands for the storage of record ``data/<key>``."""

    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class _TensorRef:
    """Pickles exactly as torch.save pickles a contiguous CPU tensor over its own storage."""

    __slots__ = ("storage", "shape")

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        args: tuple[Any, ...] = (
            self.storage,
            0,
            tuple(self.shape),  # as Tensor.__reduce_ex__ pickles it (a tuple, not a torch.Size)
            _contiguous_stride(self.shape),
            False,
            collections.OrderedDict(),
        )
        if storage_type_for(self.storage.dtype) is None:
            # dtypes without a legacy storage class: untyped storage, dtype passed explicitly
            return (REBUILD_TENSOR_V3, (*args, self.storage.dtype))
        return (REBUILD_TENSOR_V2, args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            storage_type = storage_type_for(obj.dtype)
            if storage_type is None:
                return ("storage", torch.storage.UntypedStorage, obj.key, "cpu", obj.numel * obj.dtype.itemsize)
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


def _reference_dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def _as_reference(obj: Any) -> Any:
    """The tree with each ``TensorRef`` as the old ``_TensorRef`` (dicts and lists rebuilt; tuples hold no tensors)."""
    if isinstance(obj, TensorRef):
        return _TensorRef(_StorageRef(obj.storage.key, obj.storage.dtype, obj.storage.numel), obj.shape)  # type: ignore[arg-type]
    if isinstance(obj, dict):
        return type(obj)((k, _as_reference(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_as_reference(v) for v in obj]
    return obj


def _torch_container(entries: Sequence[TensorSlot | None], pickled: bytes, extra: Sequence[tuple[str, int]] = ()) -> _HeaderImage:
    """``writers.torch_save._container`` as it was: torch's own zip writer, CRC-32s left 0."""
    image = _HeaderImage()
    writer = open_torch_save_writer(image, compute_crc32=False)  # type: ignore[arg-type]
    for j, slot in enumerate(entries):
        if slot is not None:
            reserve_record(writer, f"data/{j}", slot.nbytes)
    for key, nbytes in extra:
        reserve_record(writer, f"data/{key}", nbytes)
    records = [("data.pkl", pickled), (".format_version", b"1"), (".storage_alignment", str(storage_alignment()).encode())]
    for name, raw in [*records, ("byteorder", sys.byteorder.encode())]:
        writer.write_record(name, raw, len(raw))
    writer.write_end_of_file()
    del writer
    return image


# --- the zip container ----------------------------------------------------------------------------------

Op = tuple[str, int | bytes]  # (name, bytes to reserve) or (name, data to write)
_SMALL: list[Op] = [
    ("data.pkl", b"\x80\x02}q\x00."),
    (".format_version", b"1"),
    (".storage_alignment", b"64"),
    ("byteorder", b"little"),
]


def _image(ops: list[Op], ours: bool) -> tuple[int, list[tuple[int, bytes]]]:
    image = _HeaderImage()
    writer: Any = TorchZipWriter(image) if ours else open_torch_save_writer(image, compute_crc32=False)  # type: ignore[arg-type]
    for name, arg in ops:
        if isinstance(arg, int):
            writer.reserve_record(name, arg) if ours else reserve_record(writer, name, arg)
        else:
            writer.write_record(name, arg) if ours else writer.write_record(name, arg, len(arg))
    writer.write_end_of_file()
    del writer
    return image.size, [(offset, bytes(part)) for offset, part in image.parts()]


def _reserved(sizes: Sequence[int]) -> list[Op]:
    return [(f"data/{j}", size) for j, size in enumerate(sizes)]


GiB4 = 1 << 32
GRID: dict[str, list[Op]] = {
    "no records": [],
    "small records only": _SMALL,
    **{f"one record of {n} bytes": [*_reserved([n]), *_SMALL] for n in (0, 1, 63, 64, 65, 1 << 20)},
    "sizes mixed": [*_reserved([0, 1, 63, 64, 65, 3, 0, 100_000, 7]), *_SMALL],
    # 13, 29, 59 and 127 buckets: the name set's rehashes, which reorder the serialization id's hash
    **{f"{n} records": [*_reserved([j % 130 for j in range(n)]), *_SMALL] for n in (12, 13, 14, 29, 30, 60, 200, 1000)},
    "a record of 4 GiB - 1 (zip64 from 0xFFFFFFFF)": [*_reserved([GiB4 - 1]), *_SMALL],
    "a record of 4 GiB - 2, then one past 4 GiB": [*_reserved([GiB4 - 2, 1]), *_SMALL],
    "headers crossing 4 GiB": [*_reserved([GiB4 - 3000, *range(1, 300)]), *_SMALL],
    "a 4.5 GiB record, then small and empty ones": [*_reserved([9 << 29, 12, 0]), *_SMALL],
    "two records past 4 GiB each": [*_reserved([5 * GiB4, GiB4 + 5]), *_SMALL],
    "70000 records (past 65535: zip64 counts)": [*_reserved([j % 3 for j in range(70_000)]), *_SMALL],
    # torch's writer takes any write that starts like a data descriptor for one (its CRC into the id)
    "data that starts like a data descriptor": [("data.pkl", b"PK\x07\x08\x01\x02\x03\x04rest"), *_SMALL[1:]],
    "version and byteorder written by the caller": [*_reserved([5]), ("version", b"3\n"), ("byteorder", b"big")],
}


@pytest.mark.parametrize("case", list(GRID))
def test_zip_is_torchs_writers_byte_for_byte(case: str) -> None:
    """Headers, FB padding, data descriptors, zip64 fields, central directory, end records and
    ``.data/serialization_id``: every byte written and every range skipped as torch's writer."""
    want = _image(GRID[case], ours=False)
    got = _image(GRID[case], ours=True)
    assert got[0] == want[0]
    assert got[1] == want[1]


def test_storage_alignment_is_torchs() -> None:
    assert STORAGE_ALIGNMENT == storage_alignment() == 64


def test_bucket_counts_are_libstdcxxs() -> None:
    """The serialization id's record order follows libstdc++'s hash table, which grows through this list."""
    lib = ctypes.CDLL("libstdc++.so.6")
    exported = (ctypes.c_ulong * (len(PRIME_LIST) + 1)).in_dll(lib, "_ZNSt8__detail12__prime_listE")
    assert tuple(exported)[: len(PRIME_LIST)] == PRIME_LIST
    assert exported[len(PRIME_LIST)] == PRIME_LIST[-1]  # the sentinel: the list ends there


def test_writer_refuses_a_record_twice_or_after_the_end() -> None:
    writer = TorchZipWriter(_HeaderImage())
    writer.reserve_record("data/0", 4)
    with pytest.raises(ValueError, match="twice"):
        writer.write_record("data/0", b"x")
    writer.write_end_of_file()
    with pytest.raises(ValueError, match="after the end"):
        writer.reserve_record("data/1", 4)


# --- the pickle -----------------------------------------------------------------------------------------


def test_storage_class_table_is_torchs_for_every_dtype() -> None:
    assert len(ALL_DTYPES) > 40
    for dtype in ALL_DTYPES:
        storage_type = storage_type_for(dtype)
        assert storage_class_name(dtype) == (None if storage_type is None else storage_type.__name__), dtype
        if storage_type is not None:
            assert getattr(torch, storage_type.__name__) is storage_type
        # what _rebuild_tensor_v3's dtype argument pickles as: GLOBAL torch <name>
        assert getattr(torch, str(dtype).removeprefix("torch.")) is dtype
    assert set(STORAGE_CLASS_NAMES) <= {str(d).removeprefix("torch.") for d in ALL_DTYPES}


def _tree_items(ref: bool) -> list[tuple[tuple[str | int, ...], Any]]:
    """Every torch dtype in 0-dim, empty, 1-d and 3-d shapes, shared dtypes and strings, and optimizer values."""
    items: list[tuple[tuple[str | int, ...], Any]] = []
    shapes: list[tuple[int, ...]] = [(), (0, 3), (5,), (2, 3, 4)]
    for i, dtype in enumerate(ALL_DTYPES):
        for k, shape in enumerate(shapes):
            key, numel = str(4 * i + k), math.prod(shape)
            value = _TensorRef(_StorageRef(key, dtype, numel), shape) if ref else TensorRef(StorageRef(key, dtype, numel), shape)
            items.append((("model", f"{dtype}.{k}".removeprefix("torch.")), value))
    items += [
        (("optim", "param_groups", 0, "lr"), 0.01),
        (("optim", "param_groups", 0, "betas"), (0.9, 0.95)),
        (("optim", "param_groups", 0, "params"), ["a", "b", 3, -(1 << 40), 1 << 70]),
        (("optim", "param_groups", 0, "fused"), None),
        (("optim", "param_groups", 0, "amsgrad"), False),
        (("optim", "param_groups", 1, "nested"), collections.OrderedDict([("x", [1.5, float("nan"), -0.0]), ("y", {"z": True})])),
        (("train_state", "step"), 7),
        (("train_state", "name"), "ünïcode"),
        (("train_state", "long list"), list(range(-1200, 1300))),  # past pickle's batches of 1000
        (("train_state", "wide dict"), {f"k{i}": i * 0.5 for i in range(1500)}),
    ]
    return items


def test_pickle_is_the_torch_based_picklers_byte_for_byte() -> None:
    """Nested dicts of every dtype torch has, through the stand-ins, as the pickler with torch's own classes writes them."""
    got = dumps(unflatten(_tree_items(ref=False)))
    assert got == _reference_dumps(unflatten(_tree_items(ref=True)))
    assert b"ctorch\nFloatStorage\n" in got and b"ctorch.storage\nUntypedStorage\n" in got


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_one_tensor_pickle_is_the_torch_based_picklers(dtype: torch.dtype) -> None:
    """A one-tensor payload's ``data.pkl`` (what DCP stores per chunk), each dtype on its own (no memo shared)."""
    assert dumps(TensorRef(StorageRef("0", dtype, 6), (2, 3))) == _reference_dumps(_TensorRef(_StorageRef("0", dtype, 6), (2, 3)))


# --- whole files: torch loads them; written without torch, they are the files torch's writer makes -------


def _loadable_items(dtype_of: Any) -> list[tuple[tuple[str | int, ...], Any]]:
    items: list[tuple[tuple[str | int, ...], Any]] = [
        (("model", f"{name}.{shape_name}"), TensorSlot(dtype_of(dtype), shape))
        for name, dtype in LOADABLE_DTYPES.items()
        for shape_name, shape in SHAPES.items()
    ]
    return [*items, (("optim", "param_groups", 0, "lr"), 0.01), (("step",), 3)]


def test_a_file_written_through_the_torch_free_path_loads_with_torch(tmp_path: Path) -> None:
    """Storage bytes filled, CRC-32s patched: ``torch.load(weights_only=True)`` gives every tensor back, bit for bit."""
    items = _loadable_items(lambda d: Dtype(str(d).removeprefix("torch."), d.itemsize))
    want: list[tuple[tuple[str | int, ...], Any]] = []
    for j, ((path, value), (_, real)) in enumerate(zip(items, _loadable_items(lambda d: d), strict=True)):
        if isinstance(value, TensorSlot):
            flat = (
                torch.frombuffer(bytearray(storage_bytes(j, value)), dtype=torch.uint8)
                if value.nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
            value = flat.view(real.dtype).reshape(real.shape)
        want.append((path, value))
    out = tmp_path / "x.pt"
    write_file(out, items)
    for mmap in (False, True):
        assert assert_same_state(torch.load(out, weights_only=True, mmap=mmap), unflatten(want)) == len(LOADABLE_DTYPES) * len(
            SHAPES
        )


_NO_TORCH_SCRIPT = """
import json, sys
sys.modules["torch"] = None  # any import of torch fails
sys.path[:0] = [sys.argv[1]]
from pathlib import Path
from tests._torch_free import Dtype, items_from_spec, write_file, write_payload
spec = json.loads(sys.argv[2])
write_file(Path(sys.argv[3]), items_from_spec(spec["items"], Dtype))
write_payload(Path(sys.argv[3] + ".payload"), items_from_spec(spec["payload"], Dtype)[0][1])
assert sys.modules["torch"] is None and not any(m.startswith("torch.") for m in sys.modules), "torch was imported"
"""


def test_headers_and_payloads_are_written_without_importing_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch_save_offsets``, ``write_torch_save_headers`` and the one-tensor payload functions in a process
    where ``import torch`` fails, on torch-free dtype records: the same file bytes as torch's writer and the
    torch-based pickler make of the same items."""

    def spec(items: list[tuple[tuple[str | int, ...], Any]]) -> list[Any]:
        def value(v: Any) -> Any:
            return [[str(v.dtype).removeprefix("torch."), v.dtype.itemsize], list(v.shape)] if isinstance(v, TensorSlot) else v

        return [[list(p), value(v)] for p, v in items]

    spec_json = json.dumps(
        {"items": spec(_loadable_items(lambda d: d)), "payload": spec([(("p",), TensorSlot(torch.float8_e4m3fn, (3, 5)))])}
    )
    ours = tmp_path / "ours.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _NO_TORCH_SCRIPT, str(ROOT), spec_json, str(ours)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    monkeypatch.setattr(torch_save, "_container", _torch_container)
    monkeypatch.setattr(torch_save, "dumps", lambda tree: _reference_dumps(_as_reference(tree)))
    theirs = tmp_path / "theirs.pt"
    # the same items from the same JSON (so shared and unshared objects alike: the pickle's memo
    # follows object identity), with torch's dtypes
    with_torch = json.loads(spec_json)
    write_file(theirs, items_from_spec(with_torch["items"], lambda name, _: getattr(torch, name)))
    write_payload(
        tmp_path / "theirs.pt.payload", items_from_spec(with_torch["payload"], lambda name, _: getattr(torch, name))[0][1]
    )
    assert ours.read_bytes() == theirs.read_bytes()
    assert (tmp_path / "ours.pt.payload").read_bytes() == (tmp_path / "theirs.pt.payload").read_bytes()
    assert torch.load(ours, weights_only=True)["step"] == 3
