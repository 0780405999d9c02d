"""Fuzzing with hostile inputs: ``.metadata`` bytes, rank-file pickles and safetensors headers, through the CLI.

The inputs are real files of the session samples (the 2-rank FSDP2 run's ``.metadata``; verl-layout
per-rank files and ``HuggingFaceStorageWriter`` shards of ``fsdp2_layouts``), mutated (bytes
flipped, spliced, cut, appended) or replaced by structured hostile ones (pickles that would change a
class, call code or crash the interpreter; headers with huge, negative or nested values). Each case
runs ``consolidate`` in-process (``CliRunner``) and must end in

- exit 0 with an output no larger than the inputs could fill, or exit 1, 2 or 3 with exactly one
  line on stderr (``error: ...``) and nothing at OUT;
- nothing changed outside OUT: a sentinel folder, the input and the current folder are as they were;
- within ``CASE_LIMIT_S`` seconds.

A handful go through ``python -m fsdp_convert`` in a child as well (``test_hostile_inputs_in_a_child``),
where a crash of the interpreter would show as a signal.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fsdp_convert.cli import app
from tests._samples import Sample, _sample
from tests.unit.test_dcp_metadata_writers import hostile_records
from tests.unit.test_unpickler_hostile import LOADERS, _hostile

pytestmark = pytest.mark.redteam  # last rounds' attacks: part of `pytest -m redteam`

EXAMPLES = int(os.environ.get("FSDP_CONVERT_FUZZ_HOSTILE_EXAMPLES", "100"))  # per target; three targets, ~0.1 s a case
CASE_LIMIT_S = 10.0  # an in-process case takes 0.05 to 0.4 s on a 2-core box; a hang or a huge read shows
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same cases on every CI run
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],  # no "explain": it reruns a failure a hundred times
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _tree(root: Path, skip: Path | None = None) -> dict[str, tuple[int, str]]:
    """Every file under ``root`` (but ``skip``): its size and SHA-256."""
    found = {}
    for path in sorted(root.rglob("*")):
        if skip is not None and (path == skip or skip in path.parents):
            continue
        if path.is_file() or path.is_symlink():
            found[str(path.relative_to(root))] = (path.lstat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
    return found


class _Bench:
    """A pristine input folder, and per case a scratch copy of it beside OUT, a sentinel and a current folder."""

    def __init__(self, pristine: Path, root: Path, runner: CliRunner) -> None:
        self.pristine, self.root, self.runner = pristine, root, runner
        self.pristine_tree = _tree(pristine)

    def scratch(self) -> Path:
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.copytree(self.pristine, self.root / "in")
        (self.root / "out").mkdir()
        (self.root / "cwd").mkdir()
        (self.root / "sentinel").mkdir()
        (self.root / "sentinel" / "keep.txt").write_text("must stay as it is\n")
        return self.root / "in"

    def planned_bytes(self) -> int:
        """What ``consolidate`` of the scratch input may write: its entries' bytes as indexed, plus headers."""
        shown = self.runner.invoke(app, ["inspect", "--json", str(self.root / "in")])
        entries = [e for group in json.loads(shown.stdout)["groups"].values() for e in group]
        return sum(e["bytes"] for e in entries) + 512 * len(entries) + (64 << 10)  # zip records and pickle per entry

    def run(self, monkeypatch: pytest.MonkeyPatch) -> str:
        """``consolidate`` the scratch input; check the outcome. Returns the exit code and the error's start."""
        out = self.root / "out" / "out.pt"
        before = _tree(self.root, skip=self.root / "out")
        monkeypatch.chdir(self.root / "cwd")
        start = time.monotonic()
        result = self.runner.invoke(app, ["consolidate", str(self.root / "in"), str(out)])
        took = time.monotonic() - start
        assert took < CASE_LIMIT_S, f"took {took:.1f} s: {result.stderr}"
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        assert _tree(self.root, skip=self.root / "out") == before, "a file outside OUT changed"
        assert _tree(self.pristine) == self.pristine_tree, "the session sample changed"
        if result.exit_code == 0:
            assert out.stat().st_size <= self.planned_bytes(), "an output larger than its plan"
            torch.load(out, weights_only=True, mmap=True)  # whole, not half-written
            return "exit 0"
        lines = result.stderr.strip().splitlines()
        assert result.exit_code in (1, 2, 3), (result.exit_code, result.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
        assert lines[0].isprintable(), lines[0]
        assert not list((self.root / "out").iterdir()), "a failed run left something at OUT"
        return f"exit {result.exit_code}: {lines[0].replace(str(self.root), '')[7:60]}"


def _mutate(data: st.DataObject, raw: bytes, start: int = 0) -> bytes:
    """``raw`` with one random edit at or after ``start``: bits flipped, a span replaced, cut or appended."""
    raw = bytearray(raw)
    kind = data.draw(st.sampled_from(["flip", "splice", "truncate", "append", "duplicate"]), label="edit")
    at = data.draw(st.integers(start, max(start, len(raw) - 1)), label="at")
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            i = data.draw(st.integers(start, len(raw) - 1), label="byte")
            raw[i] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    elif kind == "splice":
        length = data.draw(st.integers(1, 64), label="length")
        raw[at : at + length] = data.draw(st.binary(min_size=0, max_size=64), label="bytes")
    elif kind == "truncate":
        del raw[at:]
    elif kind == "append":
        raw += data.draw(st.binary(min_size=1, max_size=64), label="tail")
    else:
        length = data.draw(st.integers(1, 256), label="length")
        raw[at:at] = raw[at : at + length]
    event(f"mutation: {kind}")
    return bytes(raw)


# --- .metadata --------------------------------------------------------------------------------------


# BUILD (None, {"parts": ()}) on pathlib.PosixPath, then POP: what let "../outside" pass the folder check
_MUTATE_PATH_PARTS = b"cpathlib\nPosixPath\nN}(\x8c\x05parts)u\x86b0"
# BUILD (None, {"pwned": None}) on torch's SavePlan (admitted for Megatron-Core's all_local_plans), then POP
_MUTATE_SAVE_PLAN = b"ctorch.distributed.checkpoint.planner\nSavePlan\nN}(\x8c\x05pwnedNu\x86b0"
_DEEP_TUPLE_KEY = b"\x80\x04}" + b")" + b"\x85" * 1_000_000 + b"Ns."  # hashing it overflows the C stack
_DEEP_JSON = b"[" * 200_000 + b"]" * 200_000


def _hostile_metadata(pristine: bytes) -> dict[str, bytes]:
    """Crafted ``.metadata`` files: the unpickler's hostile opcodes, crashes, bad sizes, a real one misused."""
    cases = {f"opcode: {name}": data for name, data in _hostile(LOADERS[".metadata"]).items() if "EXT" not in name}
    cases.update(
        {
            "deep tuple key": _DEEP_TUPLE_KEY,
            "huge BINUNICODE8": b"\x80\x04\x8d" + struct.pack("<Q", 2**62) + b"x.",
            "huge BINBYTES8": b"\x80\x04\x8e" + struct.pack("<Q", 2**63 - 1) + b"x.",
            "negative LONG4": b"\x80\x04\x8b" + struct.pack("<i", -5) + b".",
            "huge FRAME": b"\x80\x04\x95" + struct.pack("<Q", 2**60) + b"N.",
            "memo index far ahead": b"\x80\x04Nr" + struct.pack("<I", 2**32 - 1) + b".",
            "empty": b"",
            "protocol 0": b"(dp0\n.",
            "two pickles": pristine + pristine,
            "a class mutated, then the real metadata": pristine[:2] + _MUTATE_PATH_PARTS + pristine[2:],
            "a writer's class mutated, then the real metadata": pristine[:2] + _MUTATE_SAVE_PLAN + pristine[2:],
        }
    )
    cases.update({f"writer class: {name}": data for name, (data, _, _) in hostile_records().items()})  # OLMo-core, Megatron
    return cases


@pytest.fixture(scope="module")
def metadata_bench(tmp_path_factory: pytest.TempPathFactory, samples_root: Path) -> _Bench:
    sample: Sample = _sample("ws2_fp32", samples_root)
    return _Bench(sample.checkpoint, tmp_path_factory.mktemp("fuzz_metadata"), CliRunner())


@FUZZ
@given(data=st.data())
def test_fuzz_metadata_bytes(metadata_bench: _Bench, data: st.DataObject, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = metadata_bench.scratch()
    pristine = (ck / ".metadata").read_bytes()
    if data.draw(st.booleans(), label="structured"):
        hostile = _hostile_metadata(pristine)
        name = data.draw(st.sampled_from(sorted(hostile)), label="case")
        (ck / ".metadata").write_bytes(hostile[name])
        event(f"{name}: {metadata_bench.run(monkeypatch)}")
    else:
        (ck / ".metadata").write_bytes(_mutate(data, pristine))
        event(f"mutated: {metadata_bench.run(monkeypatch)}")


# --- rank files: their data.pkl -------------------------------------------------------------------


def _with_pickle(path: Path, pickled: bytes) -> None:
    """Rewrite the torch.save zip at ``path`` with ``pickled`` as its data.pkl (records stored, CRCs right)."""
    original = path.read_bytes()
    with zipfile.ZipFile(io.BytesIO(original)) as zin, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info, pickled if info.filename.endswith("/data.pkl") else zin.read(info))


def _data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


@pytest.fixture(scope="module")
def rank_file_bench(tmp_path_factory: pytest.TempPathFactory, fsdp2_layouts: Path) -> _Bench:
    return _Bench(fsdp2_layouts / "verl", tmp_path_factory.mktemp("fuzz_rank_files"), CliRunner())


@FUZZ
@given(data=st.data())
def test_fuzz_rank_file_pickles(rank_file_bench: _Bench, data: st.DataObject, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = rank_file_bench.scratch()
    path = ck / data.draw(st.sampled_from(sorted(p.name for p in ck.iterdir())), label="file")
    choice = data.draw(st.sampled_from(["structured", "data.pkl", "zip bytes"]), label="target")
    if choice == "structured":
        hostile = {k: v for k, v in _hostile(LOADERS["rank file"]).items() if "EXT" not in k}
        name = data.draw(st.sampled_from(sorted(hostile)), label="case")
        _with_pickle(path, hostile[name])
        event(f"{name}: {rank_file_bench.run(monkeypatch)}")
    elif choice == "data.pkl":
        _with_pickle(path, _mutate(data, _data_pkl(path)))
        event(f"data.pkl mutated: {rank_file_bench.run(monkeypatch)}")
    else:
        path.write_bytes(_mutate(data, path.read_bytes()))
        event(f"zip mutated: {rank_file_bench.run(monkeypatch)}")


# --- safetensors headers --------------------------------------------------------------------------


def _header(path: Path) -> tuple[dict[str, object], bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _write_header(path: Path, header: bytes, body: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)


_ODD_VALUES: list[object] = [
    -1, 2**63, 2**64 + 5, 1e308, float("nan"), "12", None, [], {}, [2**40, 2**40], [[1, 2]], [-5, 3], [3, 1], True,
]  # fmt: skip


def _structured_header(data: st.DataObject, path: Path) -> str:
    header, body = _header(path)
    fqns = sorted(k for k in header if k != "__metadata__")
    fqn = data.draw(st.sampled_from(fqns), label="tensor")
    kind = data.draw(
        st.sampled_from(["dtype", "shape", "data_offsets", "drop", "length field", "deep json", "not json", "metadata"]),
        label="header edit",
    )
    entry = header[fqn]
    assert isinstance(entry, dict)
    if kind in ("dtype", "shape", "data_offsets"):
        values = [*_ODD_VALUES, "F8_E4M3", "U64", "BOOL", "??"] if kind == "dtype" else _ODD_VALUES
        entry[kind] = data.draw(st.sampled_from(values), label="value")
    elif kind == "drop":
        del header[fqn]
    elif kind == "metadata":
        header["__metadata__"] = data.draw(st.sampled_from([{"x": 1}, [], "s", {"k": "v" * 100_000}]), label="value")
    if kind == "length field":
        raw = path.read_bytes()
        length = data.draw(st.sampled_from([0, 1, 7, 2**63 - 1, 2**64 - 1, len(raw), len(raw) - 8, 2**32]), label="length")
        path.write_bytes(struct.pack("<Q", length) + raw[8:])
    elif kind == "deep json":
        _write_header(path, _DEEP_JSON, body)
    elif kind == "not json":
        _write_header(path, b"\xff\xfe{not json" + b" " * 10, body)
    else:
        _write_header(path, json.dumps(header).encode(), body)
    return kind


@pytest.fixture(scope="module")
def safetensors_bench(tmp_path_factory: pytest.TempPathFactory, fsdp2_layouts: Path) -> _Bench:
    return _Bench(fsdp2_layouts / "hf_storage", tmp_path_factory.mktemp("fuzz_safetensors"), CliRunner())


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_headers(safetensors_bench: _Bench, data: st.DataObject, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = safetensors_bench.scratch()
    path = ck / data.draw(st.sampled_from(sorted(p.name for p in ck.glob("*.safetensors"))), label="file")
    if data.draw(st.booleans(), label="structured"):
        kind = _structured_header(data, path)
        event(f"{kind}: {safetensors_bench.run(monkeypatch)}")
    else:
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = _mutate(data, raw[: 8 + length], start=8)  # the header only: a payload edit is CRC's business
        path.write_bytes(header + raw[8 + length :])
        event(f"header mutated: {safetensors_bench.run(monkeypatch)}")


# --- the pristine inputs convert; a few cases in a child ------------------------------------------


@pytest.mark.parametrize("bench", ["metadata_bench", "rank_file_bench", "safetensors_bench"])
def test_fuzz_benches_convert_their_pristine_input(
    bench: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The oracle: each untouched input converts (so a refusal above is the mutation's doing)."""
    fixture: _Bench = request.getfixturevalue(bench)
    fixture.scratch()
    assert fixture.run(monkeypatch) == "exit 0"


def test_hostile_inputs_in_a_child(
    metadata_bench: _Bench, rank_file_bench: _Bench, safetensors_bench: _Bench, tmp_path: Path
) -> None:
    """Through ``python -m fsdp_convert``: a crash would be a signal here, not a failed assertion."""
    cases: dict[str, tuple[_Bench, Callable[[Path], None]]] = {
        "deep tuple .metadata": (
            metadata_bench,
            lambda ck: (ck / ".metadata").write_bytes(_DEEP_TUPLE_KEY),
        ),
        "class-mutating rank file": (
            rank_file_bench,
            lambda ck: _with_pickle(next(ck.glob("model_*.pt")), _hostile(LOADERS["rank file"])["GLOBAL class, BUILD setattr"]),
        ),
        "deep JSON header": (
            safetensors_bench,
            lambda ck: _write_header(next(ck.glob("*.safetensors")), _DEEP_JSON, b""),
        ),
    }
    for name, (bench, spoil) in cases.items():
        ck = tmp_path / name.replace(" ", "_") / "in"
        shutil.copytree(bench.pristine, ck)
        spoil(ck)
        out = ck.parent / "out.pt"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "fsdp_convert", "consolidate", str(ck), str(out)]
        child = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        lines = child.stderr.strip().splitlines()
        assert child.returncode in (1, 3), (name, child.returncode, child.stderr[-1000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, child.stderr[-1000:])
        assert not out.exists()
