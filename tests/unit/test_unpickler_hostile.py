"""formats/_safe_pickle.py through both of its users: no pickle changes a class, runs a call or crashes the process.

Each hostile pickle is written opcode by opcode and fed to the ``.metadata`` loader
(``metadata_from_bytes``) and to the per-rank file loader (``load_rank_file``, the pickle as a
torch.save zip's ``data.pkl``). Every one must be refused as unsafe, and the process must be as it
was: ``test_no_load_changes_an_admitted_class_or_module`` snapshots ``vars()`` of every admitted
class, function and module around all of them and a real load of each kind.
"""

from __future__ import annotations

import contextlib
import copyreg
import pickle
import pickletools
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_convert.errors import CorruptChunkError, NotADcpCheckpointError, UnsafeContentError
from fsdp_convert.formats import _dcp_metadata, _rank_unpickler, _safe_pickle
from fsdp_convert.formats._dcp_metadata import load_metadata, metadata_from_bytes
from fsdp_convert.formats._rank_unpickler import load_rank_file
from tests._samples import Sample

pytestmark = pytest.mark.redteam  # last rounds' attacks: part of `pytest -m redteam`

# --- writing pickles opcode by opcode -------------------------------------------------------------

PROTO = b"\x80\x02"
NONE, MARK, STOP, EMPTY_DICT, EMPTY_TUPLE = b"N", b"(", b".", b"}", b")"
TUPLE1, TUPLE2, BUILD, REDUCE, NEWOBJ = b"\x85", b"\x86", b"b", b"R", b"\x81"
SETITEM, SETITEMS, APPEND, APPENDS = b"s", b"u", b"a", b"e"


def text(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw if len(raw) < 256 else b"X" + len(raw).to_bytes(4, "little") + raw


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def stack_glob(module: str, name: str) -> bytes:
    return text(module) + text(name) + b"\x93"


def slot_state(**values: bytes) -> bytes:
    """BUILD's (None, {name: value}) state: ``setattr`` on whatever BUILD is applied to."""
    return NONE + EMPTY_DICT + MARK + b"".join(text(k) + v for k, v in values.items()) + SETITEMS + TUPLE2


def dict_state(**values: bytes) -> bytes:
    return EMPTY_DICT + MARK + b"".join(text(k) + v for k, v in values.items()) + SETITEMS


class Loader:
    """One of the two unpicklers, with classes it admits (the first for most cases, the rest for EXT codes)."""

    def __init__(self, name: str, admitted: list[tuple[str, str]], load: Callable[[Path, bytes], Any]) -> None:
        self.name, self.admitted_class, self.admitted, self._load = name, admitted[0], admitted, load

    def load(self, tmp_path: Path, data: bytes) -> Any:
        with self.extensions():
            return self._load(tmp_path, data)

    @contextlib.contextmanager
    def extensions(self) -> Iterator[None]:
        """Map the EXT codes to admitted classes in copyreg's process-wide registry, for one load."""
        pairs = [(cls, code) for cls, (_, code, _) in zip(self.admitted, EXT_CODES.values())]
        for (module, name), code in pairs:
            copyreg.add_extension(module, name, code)
        try:
            yield
        finally:
            for (module, name), code in pairs:
                copyreg.remove_extension(module, name, code)


def _load_metadata(tmp_path: Path, data: bytes) -> Any:
    return metadata_from_bytes(data, tmp_path / ".metadata")


def _load_rank_file(tmp_path: Path, data: bytes) -> Any:
    good = tmp_path / "good.pt"
    torch.save({"w": torch.zeros(2)}, good)
    bad = tmp_path / "rank_0.pt"
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, data if info.filename.endswith("/data.pkl") else zin.read(info))
    return load_rank_file(bad)


EXT_CODES = {"EXT1": (b"\x82", 0xF1, 1), "EXT2": (b"\x83", 0xF1F2, 2), "EXT4": (b"\x84", 0x0F1F2F3F, 4)}
_DCP, _PLACEMENTS = "torch.distributed.checkpoint.metadata", "torch.distributed.tensor.placement_types"
LOADERS = {
    ".metadata": Loader(
        ".metadata", [(_DCP, "Metadata"), (_DCP, "ChunkStorageMetadata"), ("pathlib", "PosixPath")], _load_metadata
    ),
    "rank file": Loader(
        "rank file", [(_PLACEMENTS, "Shard"), (_PLACEMENTS, "Replicate"), (_PLACEMENTS, "Partial")], _load_rank_file
    ),
}


def _hostile(loader: Loader) -> dict[str, bytes]:
    """Pickles that would change a class, call code or reach the copyreg registry, by opcode."""
    cls = loader.admitted_class
    cases = {
        "GLOBAL class, BUILD setattr": PROTO + glob(*cls) + slot_state(pwned=NONE) + BUILD + STOP,
        "STACK_GLOBAL class, BUILD setattr": PROTO + stack_glob(*cls) + slot_state(__eq__=NONE) + BUILD + STOP,
        "GLOBAL class, BUILD __dict__": PROTO + glob(*cls) + dict_state(pwned=NONE) + BUILD + STOP,
        "pathlib.PosixPath, BUILD parts": PROTO + glob("pathlib", "PosixPath") + slot_state(parts=NONE) + BUILD + STOP,
        "admitted function, BUILD setattr": PROTO
        + glob("torch.serialization", "_get_layout")
        + slot_state(__defaults__=EMPTY_TUPLE, pwned=NONE)
        + BUILD
        + STOP,
        "torch dtype, BUILD setattr": PROTO + glob("torch", "float32") + slot_state(pwned=NONE) + BUILD + STOP,
        "SETITEM on a class": PROTO + glob(*cls) + text("k") + NONE + SETITEM + STOP,
        "SETITEMS on an admitted callable": PROTO + glob("torch", "Size") + MARK + text("k") + NONE + SETITEMS + STOP,
        "SETITEM on OrderedDict the class": PROTO + glob("collections", "OrderedDict") + text("k") + NONE + SETITEM + STOP,
        "APPEND on a class": PROTO + glob(*cls) + NONE + APPEND + STOP,
        "APPENDS on an admitted callable": PROTO + glob("torch", "Size") + MARK + NONE + APPENDS + STOP,
        "REDUCE of os.system": PROTO + glob("os", "system") + text("touch pwned") + TUPLE1 + REDUCE + STOP,
        "REDUCE of a value that is not a callable admitted": PROTO + text("os.system") + EMPTY_TUPLE + REDUCE + STOP,
        "REDUCE of builtins.getattr": PROTO
        + glob("builtins", "getattr")
        + glob("torch", "Size")
        + text("__init__")
        + TUPLE2
        + REDUCE
        + STOP,
        "INST of os.system": PROTO + MARK + text("id") + b"i" + b"os\nsystem\n" + STOP,
        "INST of an admitted class": PROTO + MARK + b"i" + f"{cls[0]}\n{cls[1]}\n".encode() + STOP,
        "OBJ of an admitted class": PROTO + MARK + glob(*cls) + b"o" + STOP,
        "NEWOBJ of an admitted callable": PROTO + glob("torch", "Size") + EMPTY_TUPLE + NEWOBJ + STOP,
        "NEWOBJ of a non-record class": PROTO + glob("collections", "OrderedDict") + EMPTY_TUPLE + NEWOBJ + STOP,
        "NEWOBJ_EX of an admitted class": PROTO + glob(*cls) + EMPTY_TUPLE + EMPTY_DICT + b"\x92" + STOP,
        "PERSID": PROTO + b"P" + b"0\n" + STOP,
        "BINPERSID": PROTO + text("0") + b"Q" + STOP,
    }
    for name, (opcode, code, width) in EXT_CODES.items():  # the registry maps code -> the admitted class
        cases[f"{name}, BUILD setattr"] = PROTO + opcode + code.to_bytes(width, "little") + slot_state(pwned=NONE) + BUILD + STOP
    if loader.name == ".metadata":
        encoding = glob("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING") + b"K\x00" + TUPLE1 + REDUCE
        cases["enum member from a call, BUILD setattr"] = PROTO + encoding + slot_state(_value_=b"K\x05") + BUILD + STOP
        cases["enum member from a call, BUILD __dict__"] = PROTO + encoding + dict_state(_name_=text("x")) + BUILD + STOP
    else:  # a rank file's persistent ids name its storages: anything else is malformed, not unsafe
        del cases["BINPERSID"]
    return cases


CASES = [(loader, case) for loader in LOADERS for case in _hostile(LOADERS[loader])]


@pytest.mark.parametrize(("loader", "case"), CASES)
def test_hostile_pickle_is_refused_as_unsafe(loader: str, case: str, tmp_path: Path) -> None:
    with pytest.raises(UnsafeContentError, match="would run code") as refused:
        LOADERS[loader].load(tmp_path, _hostile(LOADERS[loader])[case])
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "pwned").exists()


# --- the process stays as it was ------------------------------------------------------------------


def _admitted_objects() -> list[Any]:
    objs: list[Any] = [*_dcp_metadata._RECORDS.values(), *_dcp_metadata._CALLS.values(), *_rank_unpickler._RECORDS.values()]
    objs += [*_rank_unpickler._FUNCTIONS.values(), *_dcp_metadata.MEM_FORMAT_ENCODING, _dcp_metadata.MEM_FORMAT_ENCODING]
    objs += [torch.Size, torch.device, torch.Tensor, torch.nn.Parameter, torch.storage.TypedStorage]
    import collections
    import os
    import pathlib

    objs += [
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        pathlib.Path,
        pathlib.PurePath,
        pathlib.WindowsPath,
        collections.OrderedDict,
    ]
    objs += [torch, torch.serialization, torch._utils, torch._tensor, pathlib, collections, os, copyreg]
    objs += [sys.modules["torch.distributed.checkpoint.metadata"], sys.modules["torch.distributed.checkpoint.filesystem"]]
    return objs


def _snapshot() -> dict[int, dict[str, int]]:
    """Each admitted object's attributes, by identity of their values (``==`` on torch values would run their code)."""
    snap = {}
    for obj in _admitted_objects():
        attrs = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
        attrs.update({k: getattr(obj, k) for k in ("__code__", "__defaults__", "__kwdefaults__") if hasattr(obj, k)})
        snap[id(obj)] = {k: id(v) for k, v in attrs.items()}
    return snap


def test_no_load_changes_an_admitted_class_or_module(tmp_path: Path, ws3_ckpt: Sample) -> None:
    real_rank_file = tmp_path / "real.pt"
    torch.save({"model": {"w": torch.arange(4.0)}, "step": 3}, real_rank_file)
    load_metadata(ws3_ckpt.checkpoint / ".metadata")  # warm: a first load may import what it uses
    load_rank_file(real_rank_file)
    before = _snapshot()
    hashes = {cls: cls.__hash__ for cls in _dcp_metadata._RECORDS.values()}
    for name, loader in LOADERS.items():
        for case, data in _hostile(loader).items():
            folder = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"
            folder.mkdir()
            with pytest.raises((UnsafeContentError, NotADcpCheckpointError, CorruptChunkError)):
                loader.load(folder, data)
            assert _snapshot() == before, f"{name}: {case} changed the process"
    assert load_metadata(ws3_ckpt.checkpoint / ".metadata").state_dict_metadata  # accepted loads too
    assert torch.equal(load_rank_file(real_rank_file)["model"]["w"], torch.arange(4.0))
    assert _snapshot() == before
    assert {cls: cls.__hash__ for cls in _dcp_metadata._RECORDS.values()} == hashes
    assert hash(Path("a")) == hash(Path("a"))  # pathlib works as it did


# --- what would crash the process or import modules: in a child --------------------------------


def test_crash_and_import_attempts_fail_cleanly_in_a_child(tmp_path: Path) -> None:
    """A dict key nested a million tuples deep (hashing it overflows CPython's C stack: SIGSEGV,
    whatever catches exceptions), directly or as a MetadataIndex's offset, and a global whose
    lookup by ``getattr(torch, name)`` would import ``torch._inductor``."""
    deep = EMPTY_TUPLE + TUPLE1 * 1_000_000
    index = stack_glob(_DCP, "MetadataIndex") + EMPTY_TUPLE + NEWOBJ + dict_state(fqn=text("w"), offset=deep) + BUILD
    cases = {
        "deep-key": b"\x80\x04" + EMPTY_DICT + deep + NONE + SETITEM + STOP,
        "deep-offset": b"\x80\x04" + EMPTY_DICT + index + NONE + SETITEM + STOP,
        "lazy-module": b"\x80\x04" + stack_glob("torch", "_inductor") + STOP,
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    script = textwrap.dedent(
        f"""
        import sys
        from fsdp_convert.errors import CheckpointError
        from fsdp_convert.formats._dcp_metadata import load_metadata
        for name in {sorted(cases)!r}:
            try:
                load_metadata({str(tmp_path)!r} + "/" + name)
                print(name, "loaded")
            except CheckpointError as e:
                print(name, "refused", type(e).__name__)
        print("torch._inductor imported:", "torch._inductor" in sys.modules)
        """
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout.splitlines() == [
        "deep-key refused NotADcpCheckpointError",
        "deep-offset refused NotADcpCheckpointError",
        "lazy-module refused UnsafeContentError",
        "torch._inductor imported: False",
    ]


# --- messages -------------------------------------------------------------------------------------


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_refusal_names_the_global_on_one_line_without_file_bytes(loader: str, tmp_path: Path) -> None:
    data = PROTO + stack_glob("os\n\x1b[2Jevil", "system") + STOP
    with pytest.raises(UnsafeContentError) as refused:
        LOADERS[loader].load(tmp_path, data)
    message = str(refused.value)
    assert "\n" not in message and "\x1b" not in message and "system" in message


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_bad_opcode_is_malformed_and_its_byte_is_not_printed(loader: str, tmp_path: Path) -> None:
    with pytest.raises((NotADcpCheckpointError, CorruptChunkError)) as bad:
        LOADERS[loader].load(tmp_path, PROTO + b"\xff" + STOP)
    assert "at byte 2" in str(bad.value) and "\\xff" not in str(bad.value) and "\xff" not in str(bad.value)


def test_interpreter_reads_what_the_c_unpickler_reads() -> None:
    """Every data opcode protocols 2 to 5 write, against pickle.loads (values whose pickle names a global: left out)."""
    values: list[Any] = [
        None, True, False, 0, 1, -1, 255, 256, 65535, 65536, -(2**31), 2**31, 2**64, -(2**200), 1.5, float("inf"),
        "", "x", "\u00e9" * 300, "\ud800", b"", b"\x00" * 300, bytearray(b"ab"), (), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4),
        [], [1], list(range(1500)), {}, {"a": 1}, {i: i for i in range(1500)}, {1, 2}, frozenset({3}), {(1, "a"): [None]},
    ]  # fmt: skip
    shared: list[Any] = [1]
    values += [[shared, shared], {"k": (shared, shared)}]
    checked = 0
    for protocol in (2, 3, 4, 5):
        for value in values:
            data = pickle.dumps(value, protocol=protocol)
            if any("GLOBAL" in op.name for op, _, _ in pickletools.genops(data)):
                continue  # bytes before protocol 3, sets before 4: through a global call
            got = _safe_pickle.SafeUnpickler(data).load()
            assert got == pickle.loads(data) and type(got) is type(value), (protocol, value)
            checked += 1
        got = _safe_pickle.SafeUnpickler(pickle.dumps([shared, shared], protocol=protocol)).load()
        assert got[0] is got[1]  # memo references stay shared
    assert checked > 130


def test_a_real_metadata_loads_as_pickle_loads_it(ws3_ckpt: Sample, tmp_path: Path) -> None:
    """Field for field what torch's own ``pickle.load`` makes of a real FSDP2 run's ``.metadata`` (trusted: ours)."""
    raw = (ws3_ckpt.checkpoint / ".metadata").read_bytes()
    ours, torchs = load_metadata(ws3_ckpt.checkpoint / ".metadata"), pickle.loads(raw)
    assert ours == torchs and list(ours.state_dict_metadata) == list(torchs.state_dict_metadata)
    assert list(ours.storage_data.items()) == list(torchs.storage_data.items())
    assert all(type(a) is type(b) for a, b in zip(ours.storage_data, torchs.storage_data))
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(torchs, protocol=2))  # protocol 2, as older savers wrote: BINPUT, GLOBAL
    assert load_metadata(path) == torchs


def _colliding_ints(n: int) -> list[int]:
    """``n`` ints that all hash to 1 (an int's hash is its value modulo 2**61 - 1)."""
    return [1 + i * (2**61 - 1) for i in range(n)]


def _long1(value: int) -> bytes:
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


@pytest.mark.parametrize("container", ["dict", "set", "frozenset"])
def test_keys_made_to_share_one_hash_are_refused(container: str) -> None:
    """100k such keys cost a dict quadratic time (minutes from a 1.3 MB planner_data); 65 are refused at once."""
    keys = b"".join(_long1(k) for k in _colliding_ints(_safe_pickle.MAX_SAME_HASH + 1))
    body = {
        "dict": b"}(" + b"".join(_long1(k) + b"N" for k in _colliding_ints(_safe_pickle.MAX_SAME_HASH + 1)) + b"u",
        "set": b"\x8f(" + keys + b"\x90",
        "frozenset": b"(" + keys + b"\x91",
    }[container]
    with pytest.raises(_safe_pickle.MalformedError, match="share one hash"):
        _safe_pickle.SafeUnpickler(b"\x80\x04" + body + b".").load()
    # as many keys with distinct hashes load, and so do colliding keys in separate containers
    plain = b"\x80\x04}(" + b"".join(_long1(k) + b"N" for k in range(1000)) + b"u."
    assert len(_safe_pickle.SafeUnpickler(plain).load()) == 1000
    few = b"".join(b"}(" + _long1(k) + b"Nu" for k in _colliding_ints(200))
    assert len(_safe_pickle.SafeUnpickler(b"\x80\x04(" + few + b"l.").load()) == 200
