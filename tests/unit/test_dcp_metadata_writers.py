"""Index: ``.metadata`` as other DCP writers pickle it (OLMo-core 3.0, Megatron-Core 0.15 and 0.16).

Each pickle is made as its writer makes it: a real torch ``Metadata`` of a real FSDP2 checkpoint,
holding stand-ins of the writer's classes registered in ``sys.modules`` under the writer's module
and qualified name (so the pickle names them exactly as the writer's would), pickled by the C
pickler and unregistered before the package reads it: the package never imports the writer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import shutil
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.distributed.checkpoint.planner as dcp_planner
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import fsdp_convert
from fsdp_convert.errors import NotADcpCheckpointError, UnsafeContentError
from fsdp_convert.formats import _dcp_records, read_index
from fsdp_convert.formats._dcp_metadata import load_metadata, metadata_from_bytes
from fsdp_convert.formats.index import CheckpointIndex
from tests._compare import assert_same_state
from tests._samples import Sample
from tests.unit.test_unpickler_hostile import (
    BUILD,
    EMPTY_DICT,
    EMPTY_TUPLE,
    MARK,
    NEWOBJ,
    NONE,
    PROTO,
    REDUCE,
    SETITEMS,
    STOP,
    TUPLE1,
    _snapshot,
    dict_state,
    glob,
    slot_state,
    text,
)

OLMO = "olmo_core.distributed.checkpoint.filesystem"
MCORE = "megatron.core.dist_checkpointing.strategies.torch"
PLANNER = "torch.distributed.checkpoint.planner"
FILESYSTEM = "torch.distributed.checkpoint.filesystem"


# --- the writers' classes, as stand-ins under their real names ------------------------------------


def _stand_in(module: str, qualname: str, fields: list[tuple[str, Any]], base: type | None = None) -> type:
    """A dataclass named ``module.qualname``; fields default to None, like the writers' optional ones."""
    frozen = base is dcp_planner.SavePlan  # a frozen dataclass's subclasses are frozen too
    specs = [(n, t, dataclasses.field(default=None)) for n, t in fields]
    cls = dataclasses.make_dataclass(qualname, specs, bases=(base,) if base else (), frozen=frozen)
    cls.__module__ = module
    return cls


OlmoStorageInfo = _stand_in(OLMO, "_StorageInfo", [("relative_path", str), ("offset", int), ("length", int)])
OlmoStoragePrefix = _stand_in(OLMO, "_StoragePrefix", [("prefix", str)])  # OLMo-core's: not admitted
MCoreMetadata = _stand_in(MCORE, "MCoreMetadata", [("mcore_data", Any)], dcp_metadata.Metadata)
MCoreSavePlan = _stand_in(MCORE, "MCoreSavePlan", [("mcore_data", Any)], dcp_planner.SavePlan)


@contextlib.contextmanager
def _registered(*classes: type) -> Iterator[None]:
    """``classes`` importable under their ``__module__`` for the block: each in a fresh module, parents added if absent."""
    saved: dict[str, types.ModuleType | None] = {}
    try:
        for cls in classes:
            parts = cls.__module__.split(".")
            for name in [".".join(parts[:i]) for i in range(1, len(parts) + 1)]:
                if name not in saved and (name == cls.__module__ or name not in sys.modules):
                    saved[name] = sys.modules.get(name)
                    sys.modules[name] = types.ModuleType(name)
            setattr(sys.modules[cls.__module__], cls.__qualname__, cls)
        yield
    finally:
        for name, was in saved.items():
            if was is None:
                del sys.modules[name]
            else:
                sys.modules[name] = was


@contextlib.contextmanager
def _imports_nothing_from(package: str) -> Iterator[None]:
    before = set(sys.modules)
    yield
    assert not [m for m in set(sys.modules) - before if m.partition(".")[0] == package]


def _copy(sample: Sample, tmp_path: Path) -> tuple[Path, dcp_metadata.Metadata]:
    ck = tmp_path / "ck"
    shutil.copytree(sample.checkpoint, ck)
    return ck, load_metadata(ck / ".metadata")


def _write(ck: Path, meta: object, *classes: type) -> bytes:
    with _registered(*classes):
        data = pickle.dumps(meta, protocol=pickle.DEFAULT_PROTOCOL)
    (ck / ".metadata").write_bytes(data)
    return data


def _same_index(got: CheckpointIndex, want: CheckpointIndex) -> None:
    assert got.entries == want.entries and got.data_files == want.data_files and got.version == want.version


def _plans(state_dict: dict[str, Any]) -> list[dcp_planner.SavePlan]:
    """Two ranks' local plans as torch's planner makes them (Megatron-Core's gathers these)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=True)
    flattened = planner.create_local_plan()  # planner_data: {fqn: key path}
    unflattened = DefaultSavePlanner(flatten_state_dict=False)
    unflattened.set_up_planner({"w": torch.ones(2, 3), "note": io.BytesIO(b"x")}, is_coordinator=True)
    prefixed = FileSystemWriter("unused").prepare_global_plan([unflattened.create_local_plan()])  # _StoragePrefix
    return [flattened, *prefixed]


def _small_state() -> dict[str, Any]:
    return {"model": {"w": torch.ones(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "extra": {"note": io.BytesIO(b"x")}}


# --- what each writer's .metadata reads as ----------------------------------------------------------


def test_olmo_core_storage_info_reads_as_torchs(ws3_ckpt: Sample, tmp_path: Path) -> None:
    ck, meta = _copy(ws3_ckpt, tmp_path)
    want = read_index(ck)
    meta.storage_data = {k: OlmoStorageInfo(v.relative_path, v.offset, v.length) for k, v in meta.storage_data.items()}
    data = _write(ck, meta, OlmoStorageInfo)
    assert OLMO.encode() in data and b"_StorageInfo" in data and FILESYSTEM.encode() not in data
    with _imports_nothing_from("olmo_core"):
        _same_index(read_index(ck), want)
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(ck, out)
    assert_same_state(torch.load(out, weights_only=True, mmap=True), ws3_ckpt.truth())


def test_megatron_core_0_16_plans_are_read_and_ignored(ws3_ckpt: Sample, tmp_path: Path) -> None:
    ck, meta = _copy(ws3_ckpt, tmp_path)
    want = read_index(ck)
    plans = _plans(_small_state())
    meta.all_local_plans = plans  # type: ignore[attr-defined]  # as Megatron-Core's save_state_dict_async_plan
    data = _write(ck, meta)
    for name in (b"SavePlan", b"WriteItem", b"WriteItemType", b"TensorWriteData", b"_StoragePrefix"):
        assert name in data
    _same_index(read_index(ck), want)
    loaded = load_metadata(ck / ".metadata").all_local_plans  # type: ignore[attr-defined]
    assert [p.planner_data for p in loaded] == [p.planner_data for p in plans]
    assert [[(i.index.fqn, i.type, i.tensor_data and i.tensor_data.size) for i in p.items] for p in loaded] == [
        [(i.index.fqn, i.type, i.tensor_data and i.tensor_data.size) for i in p.items] for p in plans
    ]
    assert loaded[1].storage_data == _dcp_records.StoragePrefix("__0_")


def test_megatron_core_0_15_mcore_metadata_reads_as_metadata(ws3_ckpt: Sample, tmp_path: Path) -> None:
    ck, meta = _copy(ws3_ckpt, tmp_path)
    want = read_index(ck)
    mcore_data = {"model.w": {"nd_reformulated_orig_global_shape": (4, 6)}, "model.b": {}}
    plans = [MCoreSavePlan(items=p.items, planner_data=p.planner_data, mcore_data=mcore_data) for p in _plans(_small_state())]
    mcore = MCoreMetadata(mcore_data=mcore_data, **vars(meta))
    mcore.all_local_plans = plans  # type: ignore[attr-defined]
    data = _write(ck, mcore, MCoreMetadata, MCoreSavePlan)
    assert MCORE.encode() in data and b"MCoreMetadata" in data and b"MCoreSavePlan" in data
    with _imports_nothing_from("megatron"):
        _same_index(read_index(ck), want)
        loaded = load_metadata(ck / ".metadata")
    assert type(loaded) is _dcp_records.MCoreMetadata and loaded.mcore_data == mcore_data
    assert [type(p) for p in loaded.all_local_plans] == [_dcp_records.MCoreSavePlan] * 2  # type: ignore[attr-defined]
    assert loaded.all_local_plans[0].mcore_data == mcore_data  # type: ignore[attr-defined]


# --- a class no writer table knows: refused, naming its writer ---------------------------------------


@pytest.mark.parametrize(
    ("module", "name", "says"),
    [
        (OLMO, "_StoragePrefix", "a class of OLMo-core's that fsdp-convert does not know yet"),
        ("megatron.core.dist_checkpointing.mapping", "ShardedObject", "a class of Megatron-Core's that fsdp-convert"),
        ("torchtune.training.checkpointing", "Info", "a class of torchtune's that fsdp-convert does not know yet"),
        ("nemo.lightning.io", "Info", "a class of NeMo's that fsdp-convert does not know yet"),
        (PLANNER, "LoadPlan", "a class of PyTorch's that fsdp-convert does not know yet"),
        ("acme_trainer.ckpt", "Info", "from package acme_trainer, which fsdp-convert does not know yet"),
        ("subprocess", "Popen", "of Python's standard library, which a DCP writer does not pickle"),
    ],
)
def test_an_unknown_class_is_refused_naming_its_writer(module: str, name: str, says: str, tmp_path: Path) -> None:
    meta = dcp_metadata.Metadata(state_dict_metadata={})
    if module == OLMO:  # as OLMo-core would pickle one: a real instance of its class
        meta.storage_data = OlmoStoragePrefix("__0_")
        data = _write(tmp_path, meta, OlmoStoragePrefix)
    else:
        data = PROTO + glob(module, name) + STOP
    with pytest.raises(UnsafeContentError) as refused, _imports_nothing_from(module.partition(".")[0]):
        metadata_from_bytes(data, tmp_path / ".metadata")
    message = str(refused.value)
    assert f"refusing global {module}.{name}" in message and says in message and "\n" not in message


# --- hostile pickles naming an admitted writer class: refused in one line, nothing runs -------------------


def _new(module: str, name: str, state: bytes) -> bytes:
    """A fresh instance of ``module.name`` (NEWOBJ) given ``state`` (BUILD)."""
    return glob(module, name) + EMPTY_TUPLE + NEWOBJ + state + BUILD


def _metadata_holding(value: bytes) -> bytes:
    """A Metadata whose ``all_local_plans`` is ``value``: refusals come from the value, not the top."""
    return (
        PROTO
        + _new(
            "torch.distributed.checkpoint.metadata", "Metadata", dict_state(state_dict_metadata=EMPTY_DICT, all_local_plans=value)
        )
        + STOP
    )


# per admitted class: (state with a field of the wrong type, that field), (state with a callable in a field, that field)
_WRONG_FIELDS = {
    (PLANNER, "SavePlan"): (
        (dict_state(items=text("x")), "items"),
        (dict_state(items=b"]" + glob("torch", "Size") + b"a"), "items"),
    ),
    (PLANNER, "WriteItem"): ((dict_state(type=b"K\x01"), "type"), (dict_state(index=glob("torch", "Size")), "index")),
    (PLANNER, "TensorWriteData"): (
        (dict_state(size=b"K\x01K\x02\x86"), "size"),
        (dict_state(chunk=glob("torch.serialization", "_get_layout")), "chunk"),
    ),
    (PLANNER, "BytesIOWriteData"): (
        (dict_state(nbytes=text("1")), "nbytes"),
        (dict_state(nbytes=glob("pathlib", "Path")), "nbytes"),
    ),
    (FILESYSTEM, "_StoragePrefix"): (
        (dict_state(prefix=b"K\x01"), "prefix"),
        (dict_state(prefix=glob("collections", "OrderedDict")), "prefix"),
    ),
    (MCORE, "MCoreSavePlan"): (
        (dict_state(mcore_data=b"]"), "mcore_data"),
        (dict_state(mcore_data=EMPTY_DICT + text("w") + glob("torch", "Size") + b"s"), "mcore_data"),
    ),
    (MCORE, "MCoreMetadata"): (
        (dict_state(mcore_data=text("x")), "mcore_data"),
        (dict_state(all_local_plans=glob(PLANNER, "WriteItemType")), "all_local_plans"),
    ),
}
_STRICT = [key for key in _WRONG_FIELDS if key != (MCORE, "MCoreMetadata")]  # they keep no field but their own
ADMITTED = [*_WRONG_FIELDS, (OLMO, "_StorageInfo")]
Case = tuple[bytes, type[Exception], str]


def _record_cases(module: str, name: str) -> dict[str, Case]:
    cls, record = glob(module, name), _dcp_records.RECORDS[(module, name)].__name__
    cases: dict[str, Case] = {
        "BUILD setattr on the class": (PROTO + cls + slot_state(pwned=NONE) + BUILD + STOP, UnsafeContentError, "state of class"),
        "BUILD __dict__ on the class": (
            PROTO + cls + dict_state(pwned=NONE) + BUILD + STOP,
            UnsafeContentError,
            "state of class",
        ),
        "REDUCE the class": (PROTO + cls + EMPTY_TUPLE + REDUCE + STOP, UnsafeContentError, "refusing to call class"),
        "NEWOBJ with arguments": (
            PROTO + cls + text("x") + TUPLE1 + NEWOBJ + STOP,
            NotADcpCheckpointError,
            "created with arguments",
        ),
        "slot state": (
            _metadata_holding(_new(module, name, slot_state(pwned=NONE))),
            NotADcpCheckpointError,
            f"state of a {record} is not a dict of its fields",
        ),
        "a dunder field": (
            _metadata_holding(_new(module, name, dict_state(__reduce_ex__=glob("torch", "Size")))),
            NotADcpCheckpointError,
            f"state of a {record} has a field __reduce_ex__",
        ),
    }
    if (module, name) in _WRONG_FIELDS:
        for what, (state, field) in zip(("a field of the wrong type", "a callable in a field"), _WRONG_FIELDS[(module, name)]):
            cases[what] = (_metadata_holding(_new(module, name, state)), NotADcpCheckpointError, f"{record}.{field} is a ")
    if (module, name) in _STRICT:
        cases["an extra field"] = (
            _metadata_holding(_new(module, name, dict_state(extra=NONE))),
            NotADcpCheckpointError,
            f"state of a {record} has a field extra",
        )
    return {f"{name}: {what}": case for what, case in cases.items()}


def hostile_records() -> dict[str, Case]:
    """Pickles naming each newly admitted class: bytes, the error, a phrase of its message."""
    cases = {k: v for module, name in ADMITTED for k, v in _record_cases(module, name).items()}
    kind = glob(PLANNER, "WriteItemType")
    member = kind + b"K\x01" + TUPLE1 + REDUCE
    return cases | {
        "WriteItemType: BUILD on a member": (
            PROTO + member + slot_state(_value_=b"K\x05") + BUILD + STOP,
            UnsafeContentError,
            "state of a",
        ),
        "WriteItemType: NEWOBJ": (
            PROTO + kind + EMPTY_TUPLE + NEWOBJ + STOP,
            UnsafeContentError,
            "refusing to create an instance",
        ),
        "WriteItemType: a str value": (
            PROTO + kind + text("1") + TUPLE1 + REDUCE + STOP,
            NotADcpCheckpointError,
            "value is not an int",
        ),
        "WriteItemType: out of range": (PROTO + kind + b"K\x63" + TUPLE1 + REDUCE + STOP, NotADcpCheckpointError, "ValueError"),
        "WriteItemType: SETITEMS": (
            PROTO + kind + MARK + text("k") + NONE + SETITEMS + STOP,
            UnsafeContentError,
            "refusing to set items",
        ),
    }


@pytest.mark.parametrize("case", sorted(hostile_records()))
def test_hostile_pickle_naming_an_admitted_writer_class_is_refused(case: str, tmp_path: Path) -> None:
    data, error, says = hostile_records()[case]
    before = _snapshot(), {m: dict(vars(m)) for m in dcp_planner.WriteItemType}, dict(vars(dcp_planner.WriteItemType))
    with pytest.raises(error) as refused:
        metadata_from_bytes(data, tmp_path / ".metadata")
    message = str(refused.value)
    assert says in message and "\n" not in message, message
    assert (_snapshot(), {m: dict(vars(m)) for m in dcp_planner.WriteItemType}, dict(vars(dcp_planner.WriteItemType))) == before
    assert not any(hasattr(cls, "pwned") for cls in _dcp_records.RECORDS.values())


@pytest.mark.parametrize("field", ["relative_path", "offset"])
def test_olmo_storage_info_with_wrong_fields_is_refused_by_the_index(field: str, ws3_ckpt: Sample, tmp_path: Path) -> None:
    ck, meta = _copy(ws3_ckpt, tmp_path)
    bad = {"relative_path": torch.Size, "offset": "0"}[field]  # a callable; a str
    meta.storage_data = {k: OlmoStorageInfo(v.relative_path, v.offset, v.length) for k, v in meta.storage_data.items()}
    next(iter(meta.storage_data.values())).__dict__[field] = bad
    _write(ck, meta, OlmoStorageInfo)
    with pytest.raises(NotADcpCheckpointError, match="storage record of") as refused:
        read_index(ck)
    assert "\n" not in str(refused.value)
