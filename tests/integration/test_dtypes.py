"""Every dtype torch and safetensors share, through consolidate, reshard and verify, bit for bit.

The checkpoint is a real 2-rank ``dcp.save`` of DTensors (``tests/_dtypes.py``): per dtype a (7, 5),
a (1, 3), a 0-dim and a (0, 3) tensor of random bits with NaN payloads, infinities and -0.0
planted. Ground truth is rank 0's ``torch.save`` of the full tensors; outputs are read back with
``torch.load``, ``safetensors.torch.load_file``, torch's ``dcp.load`` into DTensors and
``dcp_to_torch_save``, never with this tool's readers. Tensors are compared by their bytes.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.device_mesh import init_device_mesh
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli import app
from fsdp_convert.constants import SAFETENSORS_DTYPES, safetensors_shape
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.transform import TransformOptions
from tests._compare import assert_same_state, same_bits
from tests._dist import run_ranks
from tests._dtypes import DTYPES, FLOAT4, SHAPES, adversarial, distribute, dtype_state, fqn, save_dtypes

# what safetensors cannot hold: no complex128 or complex32 dtype, and a 0-dim float4 (its header
# shape counts 4-bit values, two per element; safetensors itself refuses to write one)
NOT_IN_SAFETENSORS = tuple(f"{name}.*" for name, d in DTYPES.items() if d not in SAFETENSORS_DTYPES) + (
    (fqn("float4_e2m1fn_x2", "scalar"),) if FLOAT4 is not None else ()
)
SAFETENSORS_OPTIONS = TransformOptions(exclude=NOT_IN_SAFETENSORS)
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu]


@dataclass(frozen=True)
class DtypeSample:
    root: Path
    checkpoint: Path
    truth_path: Path

    def truth(self) -> dict[str, torch.Tensor]:
        """The full tensors by FQN below ``model``, as rank 0 saved them."""
        return torch.load(self.truth_path, weights_only=True)["model"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def dtypes_ckpt(tmp_path_factory: pytest.TempPathFactory) -> DtypeSample:
    root = tmp_path_factory.mktemp("dtypes")
    run_ranks(save_dtypes, 2, root)
    return DtypeSample(root=root, checkpoint=root / "checkpoint", truth_path=root / "truth.pt")


@pytest.fixture(scope="module")
def consolidated(dtypes_ckpt: DtypeSample) -> dict[str, Path]:
    """The checkpoint consolidated once into each format: ``pt``, ``safetensors``, ``hf`` (folder)."""
    out = dtypes_ckpt.root / "consolidated"
    out.mkdir()
    paths = {"pt": out / "full.pt", "safetensors": out / "model.safetensors", "hf": out / "hf"}
    fsdp_convert.consolidate(dtypes_ckpt.checkpoint, paths["pt"], nproc=1)
    fsdp_convert.consolidate(dtypes_ckpt.checkpoint, paths["safetensors"], nproc=1, options=SAFETENSORS_OPTIONS)
    fsdp_convert.consolidate(dtypes_ckpt.checkpoint, paths["hf"], nproc=2, options=SAFETENSORS_OPTIONS, max_shard_bytes=200)
    return paths


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same FQNs (in any order), and each tensor with the same dtype, shape and bytes."""
    assert sorted(got) == sorted(want)
    bad = [f"{k}: {got[k].dtype} {tuple(got[k].shape)}" for k in want if not same_bits(got[k], want[k])]
    assert not bad, bad


def _safetensors_subset(truth: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a safetensors output holds: all but ``NOT_IN_SAFETENSORS``."""
    return {k: t for k, t in truth.items() if not any(fnmatch.fnmatchcase(k, g) for g in NOT_IN_SAFETENSORS)}


def _header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length])  # type: ignore[no-any-return]


def test_checkpoint_holds_every_dtype_and_the_awkward_cases(dtypes_ckpt: DtypeSample) -> None:
    """The fixture really holds what the tests claim: every dtype, sharded over both ranks, and
    bits only a bytewise copy keeps."""
    index = fsdp_convert.inspect_checkpoint(dtypes_ckpt.checkpoint)
    rows = {e.fqn: e for e in index.entries}
    assert index.world_size == 2
    for name, dtype in DTYPES.items():
        odd = rows[f"model.{fqn(name, 'odd')}"]
        assert odd.dtype == str(dtype).removeprefix("torch.") and odd.shape == (7, 5) and odd.chunks == 2
        assert rows[f"model.{fqn(name, 'scalar')}"].shape == ()
        assert rows[f"model.{fqn(name, 'empty')}"].shape == (0, 3)
    truth = dtypes_ckpt.truth()
    assert_same_tensors(truth, dtype_state()["model"])
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2):
        t = truth[fqn(str(dtype).removeprefix("torch."), "odd")]
        values = t.double()  # exact; float8 has no signbit kernel
        assert values.isnan().any() and values.isinf().any() and ((values == 0) & values.signbit()).any(), dtype
        assert t.isnan().any()
        nans = t[t.isnan()].reshape(-1).view(torch.uint8).reshape(-1, dtype.itemsize)
        assert len({bytes(row.tolist()) for row in nans}) >= 2, dtype  # NaNs of different bits
    assert truth[fqn("float8_e4m3fn", "odd")].isnan().any() and truth[fqn("float8_e8m0fnu", "odd")].isnan().any()


def test_consolidate_pt_round_trips_every_dtype(dtypes_ckpt: DtypeSample, consolidated: dict[str, Path]) -> None:
    truth = dtypes_ckpt.truth()
    for mmap in (False, True):
        got = torch.load(consolidated["pt"], weights_only=True, mmap=mmap)
        assert list(got) == ["model"]
        assert_same_tensors(got["model"], truth)
    with zipfile.ZipFile(consolidated["pt"]) as z:
        assert z.testzip() is None


def test_consolidate_safetensors_round_trips_what_safetensors_holds(
    dtypes_ckpt: DtypeSample, consolidated: dict[str, Path]
) -> None:
    """``load_file`` gives back every dtype safetensors names, with the header safetensors itself writes."""
    want = _safetensors_subset(dtypes_ckpt.truth())
    assert {t.dtype for t in want.values()} == set(SAFETENSORS_DTYPES)
    assert_same_tensors(load_file(consolidated["safetensors"]), want)
    header = _header(consolidated["safetensors"])
    assert header.pop("__metadata__") == {"format": "pt"}
    for name, entry in header.items():
        t = want[name]
        assert entry["dtype"] == SAFETENSORS_DTYPES[t.dtype] and entry["shape"] == safetensors_shape(t.dtype, tuple(t.shape))
    with safe_open(consolidated["safetensors"], "pt") as f:
        assert {k: f.get_tensor(k).dtype for k in f.keys()} == {k: t.dtype for k, t in want.items()}


def test_consolidate_hf_folder_round_trips_what_safetensors_holds(
    dtypes_ckpt: DtypeSample, consolidated: dict[str, Path]
) -> None:
    folder = consolidated["hf"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        got.update(load_file(folder / shard))
    assert len(set(index["weight_map"].values())) > 3
    want = _safetensors_subset(dtypes_ckpt.truth())
    assert_same_tensors(got, want)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in want.values())


@pytest.mark.parametrize(
    "key", [fqn("complex128", "odd"), fqn("complex32", "row"), *([fqn("float4_e2m1fn_x2", "scalar")] if FLOAT4 else [])]
)
def test_safetensors_refuses_what_it_cannot_hold_before_writing(dtypes_ckpt: DtypeSample, tmp_path: Path, key: str) -> None:
    out = tmp_path / "model.safetensors"
    with pytest.raises(InvalidOptionError) as caught:
        fsdp_convert.consolidate(dtypes_ckpt.checkpoint, out, nproc=1, options=TransformOptions(include=(key,)))
    message = str(caught.value)
    assert "\n" not in message and key in message and key.split(".")[0] in message.split(key, 1)[1], message
    assert list(tmp_path.iterdir()) == []


def test_safetensors_refusal_on_the_cli_is_one_line(runner: CliRunner, dtypes_ckpt: DtypeSample, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = runner.invoke(app, ["consolidate", str(dtypes_ckpt.checkpoint), str(out), "--include", "complex128.*"])
    assert result.exit_code == InvalidOptionError.exit_code
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "complex128.odd" in lines[0] and "complex128" in lines[0].split("complex128.odd", 1)[1]
    assert not out.exists()


def _load_into_dtensors(rank: int, world_size: int, checkpoint: Path, truth_path: Path, work: Path) -> None:
    """torch's own ``dcp.load`` at the new world size, into DTensors that start with other bits;
    each rank's shards must then be the truth's. This rank sees only .metadata and its own file
    (and rank 0's, which holds the replicated 0-dim tensors)."""
    mesh = init_device_mesh("cpu", (world_size,))
    truth = torch.load(truth_path, weights_only=True)["model"]
    state = {k: distribute(adversarial(t.dtype, tuple(t.shape), seed=7), mesh) for k, t in truth.items()}
    mine = work / f"rank{rank}"
    mine.mkdir()
    for name in {".metadata", f"__{rank}_0.distcp", "__0_0.distcp"}:
        shutil.copy(checkpoint / name, mine / name)
    dcp_load({"model": state}, checkpoint_id=mine)
    bad = [k for k, t in truth.items() if not same_bits(state[k].to_local(), distribute(t, mesh).to_local())]
    assert not bad, (rank, bad)


def test_reshard_to_three_loads_with_torch_dcp(dtypes_ckpt: DtypeSample, tmp_path: Path) -> None:
    out = tmp_path / "ws3"
    fsdp_convert.reshard(dtypes_ckpt.checkpoint, out, world_size=3, nproc=2)
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    work = tmp_path / "load"
    work.mkdir()
    run_ranks(_load_into_dtensors, 3, out, dtypes_ckpt.truth_path, work)
    dcp_to_torch_save(out, tmp_path / "view.pt")
    assert_same_tensors(torch.load(tmp_path / "view.pt", weights_only=True)["model"], dtypes_ckpt.truth())
    assert fsdp_convert.verify(dtypes_ckpt.checkpoint, out, nproc=1).equal


@pytest.mark.parametrize("source", ["pt", "safetensors"])
def test_reshard_of_a_consolidated_file_reads_with_torch(
    dtypes_ckpt: DtypeSample, consolidated: dict[str, Path], tmp_path: Path, source: str
) -> None:
    """The full-file readers (torch.save memory map, safetensors per tensor) give every dtype back."""
    out = tmp_path / "ws2"
    fsdp_convert.reshard(consolidated[source], out, world_size=2, nproc=1)
    dcp_to_torch_save(out, tmp_path / "view.pt")
    got = torch.load(tmp_path / "view.pt", weights_only=True)
    truth = dtypes_ckpt.truth()
    if source == "pt":
        assert_same_tensors(got["model"], truth)
    else:  # a safetensors file's names stand at the top level, as model.state_dict() has them
        assert_same_tensors(got, _safetensors_subset(truth))


def test_verify_finds_every_output_equal(dtypes_ckpt: DtypeSample, consolidated: dict[str, Path]) -> None:
    ckpt = dtypes_ckpt.checkpoint
    result = fsdp_convert.verify(ckpt, consolidated["pt"], nproc=1)
    assert result.equal and result.compared == len(DTYPES) * len(SHAPES), result.differences
    for name in ("safetensors", "hf"):
        result = fsdp_convert.verify(ckpt, consolidated[name], nproc=1, options=SAFETENSORS_OPTIONS)
        assert result.equal and result.compared == len(_safetensors_subset(dtypes_ckpt.truth())), result.differences
    assert fsdp_convert.verify(consolidated["pt"], dtypes_ckpt.truth_path, nproc=1).equal
    assert fsdp_convert.verify(ckpt, consolidated["pt"], nproc=1, atol=1e-3, rtol=1e-3).equal  # float8 allclose


def _flip(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the low bit of its element 1 flipped (a bool stays a bool: 0 <-> 1)."""
    out = t.clone()
    out.reshape(-1).view(torch.uint8)[t.dtype.itemsize] ^= 1
    return out


def test_verify_detects_one_flipped_byte_in_any_dtype(dtypes_ckpt: DtypeSample, tmp_path: Path) -> None:
    truth = dtypes_ckpt.truth()
    flipped = {k: _flip(t) if k.endswith(".odd") else t for k, t in truth.items()}
    torch.save({"model": flipped}, tmp_path / "flipped.pt")
    result = fsdp_convert.verify(dtypes_ckpt.checkpoint, tmp_path / "flipped.pt", nproc=1)
    details = {d.key: (d.kind, d.detail) for d in result.differences}
    assert sorted(details) == sorted(f"model.{fqn(name, 'odd')}" for name in DTYPES)
    assert all(kind == "differs" and "differ" in detail for kind, detail in details.values()), details
    # element 1 of a float tensor is -0.0 (the sign bit alone): now the smallest negative subnormal
    assert details[f"model.{fqn('float32', 'odd')}"][1] == "values differ (max abs difference 1.4e-45)"
    assert details[f"model.{fqn('uint64', 'odd')}"][1] == "values differ (1 of 35 elements)"
    # with a tolerance, float8 is compared in value too (through float64; torch has no float8 allclose)
    tolerant = fsdp_convert.verify(dtypes_ckpt.checkpoint, tmp_path / "flipped.pt", nproc=1, atol=1e-6)
    keys = {d.key for d in tolerant.differences}
    assert f"model.{fqn('float32', 'odd')}" not in keys  # 1.4e-45 is within 1e-6
    assert {f"model.{fqn(str(d).removeprefix('torch.'), 'odd')}" for d in FLOAT8} <= keys  # float8 subnormals are not
    assert f"model.{fqn('complex64', 'odd')}" in keys  # complex: bitwise always


def test_verify_detects_a_flipped_byte_in_a_safetensors_file(
    dtypes_ckpt: DtypeSample, consolidated: dict[str, Path], tmp_path: Path
) -> None:
    """One byte flipped inside the file, in each tensor's data: verify names each tensor, nothing else."""
    out = tmp_path / "model.safetensors"
    shutil.copy(consolidated["safetensors"], out)
    header = _header(out)
    data_start = 8 + struct.unpack("<Q", out.read_bytes()[:8])[0]
    raw = bytearray(out.read_bytes())
    flipped = []
    header.pop("__metadata__")
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        if end > begin:
            raw[data_start + begin] ^= 1  # element 0's low byte: a bool 0 <-> 1 still
            flipped.append(f"model.{name}")
    out.write_bytes(bytes(raw))
    result = fsdp_convert.verify(dtypes_ckpt.checkpoint, out, nproc=1, options=SAFETENSORS_OPTIONS)
    assert sorted(d.key for d in result.differences) == sorted(flipped)
    assert {d.kind for d in result.differences} == {"differs"}


def _cast_like_torch(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's element-wise cast (a 0-dim tensor cast directly takes torch's scalar path, which
    canonicalises a float32 NaN's payload; the writers cast element by element)."""
    return t.reshape(-1).to(dtype).reshape(t.shape)


def _is_cast(dtype: torch.dtype) -> bool:
    """What ``--dtype`` casts: real floating dtypes but float4_e2m1fn_x2 (two packed values; no cast)."""
    return dtype.is_floating_point and dtype != FLOAT4


def test_dtype_cast_touches_floating_tensors_only(dtypes_ckpt: DtypeSample, tmp_path: Path) -> None:
    """``--dtype bf16``: every real floating tensor, float8 included, becomes bf16 as torch casts it;
    complex, integer, bool and float4 (two packed values per element, no cast in torch) tensors
    keep their dtype and bytes."""
    options = TransformOptions(dtype=torch.bfloat16)
    out = tmp_path / "bf16.pt"
    fsdp_convert.consolidate(dtypes_ckpt.checkpoint, out, nproc=1, options=options)
    got = torch.load(out, weights_only=True)["model"]
    truth = dtypes_ckpt.truth()
    want = {k: _cast_like_torch(t, torch.bfloat16) if _is_cast(t.dtype) else t for k, t in truth.items()}
    assert_same_tensors(got, want)
    for dtype in FLOAT8:  # float8 -> bf16 is exact, so a direct .to() of a non-0-dim tensor gives the same bits
        key = fqn(str(dtype).removeprefix("torch."), "odd")
        assert same_bits(got[key], truth[key].to(torch.bfloat16)), key
    kept = {d for d in DTYPES.values() if not _is_cast(d)}
    assert {got[k].dtype for k in got} == {torch.bfloat16} | kept
    assert kept == {d for d in DTYPES.values() if not d.is_floating_point} | ({FLOAT4} if FLOAT4 else set())
    assert fsdp_convert.verify(dtypes_ckpt.checkpoint, out, nproc=1, options=options).equal


def test_fsdp2_run_with_float8_buffers_consolidates_bitwise(dtypes_ckpt: DtypeSample, tmp_path: Path) -> None:
    """An FSDP2-trained model whose buffers are float8, float8_e8m0fnu, uint16, bool and complex64:
    the .pt is the run's full state dict (model and AdamW state, in its order)."""
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(dtypes_ckpt.root / "fsdp2", out, nproc=1)
    truth = torch.load(dtypes_ckpt.root / "fsdp2_truth.pt", weights_only=True)
    assert assert_same_state(torch.load(out, weights_only=True), truth) == 9 + 4 * 3
    assert fsdp_convert.verify(dtypes_ckpt.root / "fsdp2", out, nproc=1).equal


def test_fsdp2_run_casts_floats_only_and_never_step(dtypes_ckpt: DtypeSample, tmp_path: Path) -> None:
    """``--dtype bf16 --optim-dtype bf16``: parameters and the float8 buffers become bf16; the uint16,
    bool and complex64 buffers keep their dtype and bytes; AdamW's moments become bf16, ``step`` does not."""
    out = tmp_path / "bf16.pt"
    options = TransformOptions(dtype=torch.bfloat16, optim_dtype=torch.bfloat16)
    fsdp_convert.consolidate(dtypes_ckpt.root / "fsdp2", out, nproc=1, options=options)
    got = torch.load(out, weights_only=True)
    truth = torch.load(dtypes_ckpt.root / "fsdp2_truth.pt", weights_only=True)
    for key, t in truth["model"].items():
        want = _cast_like_torch(t, torch.bfloat16) if t.is_floating_point() else t
        assert same_bits(got["model"][key], want), key
    assert {k: got["model"][k].dtype for k in ("token_ids", "mask", "phase")} == {
        "token_ids": torch.uint16,
        "mask": torch.bool,
        "phase": torch.complex64,
    }
    for fqn_, state in truth["optim"]["state"].items():
        assert same_bits(got["optim"]["state"][fqn_]["exp_avg"], state["exp_avg"].to(torch.bfloat16)), fqn_
        assert same_bits(got["optim"]["state"][fqn_]["step"], state["step"]), fqn_
    assert fsdp_convert.verify(dtypes_ckpt.root / "fsdp2", out, nproc=1, options=options).equal


def test_fsdp2_run_reshards_to_three_for_torch(dtypes_ckpt: DtypeSample, tmp_path: Path) -> None:
    fsdp_convert.reshard(dtypes_ckpt.root / "fsdp2", tmp_path / "ws3", world_size=3, nproc=1)
    dcp_to_torch_save(tmp_path / "ws3", tmp_path / "view.pt")
    truth = torch.load(dtypes_ckpt.root / "fsdp2_truth.pt", weights_only=True)
    assert_same_state(torch.load(tmp_path / "view.pt", weights_only=True), truth)


def test_reshard_with_a_cast_keeps_every_value_and_verifies(dtypes_ckpt: DtypeSample, tmp_path: Path) -> None:
    """``reshard --dtype bf16``: what torch reads is each value cast; a NaN stays a NaN, but its sign
    and payload bits are torch's choice (they differ between its vectorised and scalar cast paths:
    float64 0x7ff8... becomes 0x7fc0 in one and 0xffff in the other), so NaNs compare as NaNs, and
    verify, told of the cast, finds the reshard equal."""
    options = TransformOptions(dtype=torch.bfloat16)
    out = tmp_path / "ws3"
    fsdp_convert.reshard(dtypes_ckpt.checkpoint, out, world_size=3, nproc=2, options=options)
    dcp_to_torch_save(out, tmp_path / "view.pt")
    got = torch.load(tmp_path / "view.pt", weights_only=True)["model"]
    for key, t in dtypes_ckpt.truth().items():
        if not _is_cast(t.dtype):
            assert same_bits(got[key], t), key
            continue
        want = _cast_like_torch(t, torch.bfloat16)
        assert got[key].dtype == torch.bfloat16 and got[key].shape == t.shape, key
        nan = want.isnan()
        assert torch.equal(got[key].isnan(), nan), key
        assert same_bits(got[key][~nan], want[~nan]), key
    assert fsdp_convert.verify(dtypes_ckpt.checkpoint, out, nproc=1, options=options).equal
