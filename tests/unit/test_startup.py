"""Start-up (issue 26): reading a DCP folder's index imports neither torch.distributed.checkpoint nor, where it can, torch.

Each probe runs in a fresh interpreter and reports which modules it imported; no test asserts a time.
The records ``.metadata`` is read into mirror torch's classes field for field, and the torch-free
tables mirror torch's own: checked here against torch.
"""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.distributed.checkpoint.planner as dcp_planner

from fsdp_convert import constants
from fsdp_convert.dtypes import DType
from fsdp_convert.formats import _dcp_classes
from fsdp_convert.formats._dcp_metadata import load_metadata, load_records
from fsdp_convert.formats.index import DTYPE_ITEMSIZES, TensorEntry
from tests._cli_probe import cli_probe
from tests._samples import Sample


def _run(argv: list[str]) -> dict[str, object]:
    report, stderr = cli_probe(argv)
    assert report["code"] == 0, stderr
    return report


def test_inspect_of_a_dcp_folder_leaves_torch_distributed_checkpoint_out(ws3_ckpt: Sample) -> None:
    modules = _run(["inspect", str(ws3_ckpt.checkpoint), "--json"])["modules"]
    assert isinstance(modules, list)
    assert not [m for m in modules if m.startswith("torch.distributed.checkpoint")], modules


def test_inspect_of_a_dcp_folder_imports_no_torch(ws3_ckpt: Sample) -> None:
    assert _run(["inspect", str(ws3_ckpt.checkpoint), "--json"])["modules"] == []


def test_reading_the_index_leaves_torch_distributed_checkpoint_out(ws3_ckpt: Sample) -> None:
    code = (
        "import sys; from fsdp_convert.formats import read_index; read_index(sys.argv[1]); "
        "print(any(m.startswith('torch.distributed.checkpoint') for m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(ws3_ckpt.checkpoint)], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["False"], proc.stderr


# --- the inert records and tables mirror torch's ---------------------------------------------------------


@pytest.mark.parametrize(
    "ours",
    [cls for cls in _dcp_classes.TORCH_TWINS],
    ids=lambda cls: cls.__name__,
)
def test_each_record_has_its_torch_twins_name_and_fields(ours: type) -> None:
    module = _dcp_classes.TORCH_TWINS[ours]
    theirs = getattr({m.__name__: m for m in (dcp_metadata, dcp_planner, dcp_filesystem)}[module], ours.__name__)
    assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]
    assert ours.__dataclass_params__.frozen == theirs.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_enums_and_tables_are_torchs() -> None:
    assert {m.name: m.value for m in _dcp_classes.MEM_FORMAT_ENCODING} == {
        m.name: m.value for m in dcp_metadata._MEM_FORMAT_ENCODING
    }
    assert {m.name: m.value for m in _dcp_classes.WriteItemType} == {m.name: m.value for m in dcp_planner.WriteItemType}
    assert constants.TORCH_DTYPE_NAMES == {
        n: str(v).removeprefix("torch.") for n, v in vars(torch).items() if isinstance(v, torch.dtype)
    }
    assert DTYPE_ITEMSIZES == {str(d).removeprefix("torch."): d.itemsize for d in constants.SUPPORTED_DTYPES}
    layouts = {str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.layout)}
    assert _dcp_classes._LAYOUTS == layouts


def test_records_read_as_torchs_objects_and_index_as_before(ws3_ckpt: Sample) -> None:
    path = ws3_ckpt.checkpoint / ".metadata"
    records, theirs = load_records(path), pickle.loads(path.read_bytes())  # our own fresh file, trusted
    assert type(records) is _dcp_classes.Metadata and load_metadata(path) == theirs
    for fqn, md in records.state_dict_metadata.items():
        want = theirs.state_dict_metadata[fqn]
        if isinstance(md, _dcp_classes.TensorStorageMetadata):
            assert type(md.size) is _dcp_classes.Size and md.size == want.size
            assert type(md.properties.dtype) is _dcp_classes.TorchDtype and md.properties.dtype == str(want.properties.dtype)[6:]


def test_a_tensor_entry_keeps_its_dtype_by_name() -> None:
    entry = TensorEntry(fqn="w", path=("w",), shape=(2, 3), dtype=torch.bfloat16, chunks=())
    assert entry.dtype_name == "bfloat16" and entry.dtype is DType("bfloat16") and entry.dtype.torch is torch.bfloat16
    assert entry.itemsize == 2 and entry.nbytes == 12
    assert entry == TensorEntry(fqn="w", path=("w",), shape=(2, 3), dtype_name="bfloat16", chunks=())
    cast = dataclasses.replace(entry, dtype=torch.float32)
    assert cast.dtype == torch.float32 and cast.nbytes == 24 and cast.fqn == "w"
    assert pickle.loads(pickle.dumps(entry)) == entry
    with pytest.raises(TypeError, match="needs a dtype"):
        TensorEntry(fqn="w", path=("w",), shape=(), chunks=())


def test_the_torch_tables_build_at_first_use() -> None:
    code = (
        "import sys; from fsdp_convert import constants; print('torch' in sys.modules); "
        "from fsdp_convert.constants import SUPPORTED_DTYPES; import torch; print(torch.bfloat16 in SUPPORTED_DTYPES)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2]
    )
    assert proc.stdout.split() == ["False", "True"], proc.stderr
