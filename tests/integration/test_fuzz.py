"""Fuzzing with hypothesis: mutated payload bytes and .metadata fields of a real FSDP2 checkpoint.

Every case must end in a correct result (bitwise equal to the training run's ground truth, for
mutations that do not rename or drop entries) or in a CheckpointError, with nothing left at OUT;
never another exception, a crash or a hang.
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

import fsdp_convert
from fsdp_convert.formats.dcp import load_metadata
from tests._compare import assert_same_state
from tests._samples import Sample

EXAMPLES = int(os.environ.get("FSDP_CONVERT_FUZZ_EXAMPLES", "300"))  # per test; two tests
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same cases on every CI run
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class _Bench:
    """A pristine checkpoint and a scratch folder that mirrors it through hard links.

    Hard links, not symlinks: a symlink out of the checkpoint is refused without ``--follow-symlinks``.
    A file a case changes is first replaced by its own copy (``own_copy``), so the pristine one stays.
    """

    def __init__(self, sample: Sample, root: Path) -> None:
        self.pristine = sample.checkpoint
        self.truth = sample.truth()
        self.metadata = load_metadata(self.pristine / ".metadata")
        self.files = sorted(p.name for p in self.pristine.iterdir() if p.suffix == ".distcp")
        self.root = root

    def scratch(self) -> Path:
        ck = self.root / "ck"
        shutil.rmtree(self.root, ignore_errors=True)
        ck.mkdir(parents=True)
        for p in self.pristine.iterdir():
            os.link(p, ck / p.name)
        return ck

    def own_copy(self, ck: Path, name: str) -> Path:
        (ck / name).unlink()
        shutil.copyfile(self.pristine / name, ck / name)
        return ck / name

    def run(self, ck: Path, check_truth: bool) -> str:
        out = self.root / "out.pt"
        try:
            fsdp_convert.consolidate(ck, out, nproc=1, overwrite=True)
        except fsdp_convert.CheckpointError as e:
            assert not out.exists()
            assert not [p for p in self.root.iterdir() if ".tmp-" in p.name]
            return type(e).__name__
        got = torch.load(out, weights_only=True, mmap=True)
        if check_truth:
            assert_same_state(got, self.truth)
        return "ok"


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> _Bench:
    sample: Sample = request.getfixturevalue("ws3_ckpt")
    return _Bench(sample, tmp_path_factory.mktemp("fuzz"))


@FUZZ
@given(data=st.data())
def test_fuzz_payload_bytes(bench: _Bench, data: st.DataObject) -> None:
    ck = bench.scratch()
    path = bench.own_copy(ck, data.draw(st.sampled_from(bench.files), label="file"))
    size = path.stat().st_size
    kind = data.draw(st.sampled_from(["flip", "zeros", "random", "truncate"]), label="kind")
    offset = data.draw(st.integers(0, size - 1), label="offset")
    if kind == "truncate":
        os.truncate(path, offset)
    else:
        length = data.draw(st.integers(1, 4096), label="length")
        with open(path, "r+b") as f:
            f.seek(offset)
            old = f.read(length)
            if kind == "flip":
                bit = data.draw(st.integers(0, 7), label="bit")
                new = bytes([old[0] ^ (1 << bit)]) + old[1:]
            elif kind == "zeros":
                new = bytes(len(old))
            else:
                new = data.draw(st.binary(min_size=len(old), max_size=len(old)), label="bytes")
            f.seek(offset)
            f.write(new)
    event(f"{kind}: {bench.run(ck, check_truth=True)}")


def _tensor_fqns(meta: Any) -> list[str]:
    return [k for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]


def _mutations(data: st.DataObject, meta: Any) -> tuple[str, Callable[[], None]]:
    """Pick one field of ``meta`` and a new value for it; returns (name, apply)."""
    fqns = _tensor_fqns(meta)
    fqn = data.draw(st.sampled_from(fqns), label="fqn")
    md = meta.state_dict_metadata[fqn]
    chunk = data.draw(st.sampled_from(md.chunks), label="chunk")
    keys = list(meta.storage_data)
    key = data.draw(st.sampled_from(keys), label="storage key")
    info = meta.storage_data[key]
    ints = st.one_of(st.integers(-3, 200), st.sampled_from([2**31, 2**63 - 1, -(2**40)]))
    odd = st.sampled_from([None, "x", 1.5, [], (), b"\x00"])
    kind = data.draw(
        st.sampled_from(
            [
                "chunk_offsets", "chunk_sizes", "tensor_size", "dtype", "storage_offset", "storage_length",
                "relative_path", "transform", "drop_storage", "odd_value", "drop_entry", "planner_path",
            ]
        ),
        label="mutation",
    )  # fmt: skip

    def apply() -> None:
        dim = data.draw(st.integers(0, max(0, len(md.size) - 1)), label="dim")
        if kind == "chunk_offsets" and len(md.size):
            chunk.offsets = torch.Size([*chunk.offsets[:dim], data.draw(ints, label="v"), *chunk.offsets[dim + 1 :]])
        elif kind == "chunk_sizes" and len(md.size):
            chunk.sizes = torch.Size([*chunk.sizes[:dim], data.draw(ints, label="v"), *chunk.sizes[dim + 1 :]])
        elif kind == "tensor_size" and len(md.size):
            md.size = torch.Size([*md.size[:dim], data.draw(ints, label="v"), *md.size[dim + 1 :]])
        elif kind == "dtype":
            dtypes = [torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8, torch.bool, torch.qint8]
            md.properties.dtype = data.draw(st.sampled_from(dtypes), label="v")
        elif kind == "storage_offset":
            info.offset = data.draw(ints, label="v")
        elif kind == "storage_length":
            info.length = data.draw(ints, label="v")
        elif kind == "relative_path":
            choices = ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "../__0_0.distcp", "/etc/passwd", "", "nope.distcp"]
            info.relative_path = data.draw(st.sampled_from(choices), label="v")
        elif kind == "transform":
            info.transform_descriptors = data.draw(st.sampled_from([["zstd"], [""], [1], "zstd"]), label="v")
        elif kind == "drop_storage":
            del meta.storage_data[key]
        elif kind == "odd_value":
            target = data.draw(st.sampled_from(["chunk.offsets", "md.size", "md.chunks", "info.offset", "md.properties"]))
            obj, attr = {"chunk": chunk, "md": md, "info": info}[target.split(".")[0]], target.split(".")[1]
            setattr(obj, attr, data.draw(odd, label="v"))
        elif kind == "drop_entry":
            del meta.state_dict_metadata[fqn]
        elif kind == "planner_path":
            victim = data.draw(st.sampled_from(list(meta.planner_data)), label="victim")
            paths = [("model",), ("optim", "param_groups", 5, "lr"), ("model", "norm.weight"), ("x", 0), ()]
            meta.planner_data[victim] = data.draw(st.sampled_from(paths), label="v")

    return kind, apply


@FUZZ
@given(data=st.data())
def test_fuzz_metadata(bench: _Bench, data: st.DataObject) -> None:
    ck = bench.scratch()
    (ck / ".metadata").unlink()
    if data.draw(st.integers(0, 3), label="raw bytes") == 3:  # hypothesis leans to small values
        raw = bytearray(pickle.dumps(bench.metadata))
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            i = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[i] = data.draw(st.integers(0, 255), label="byte")
        (ck / ".metadata").write_bytes(bytes(raw))
        event(f"raw: {bench.run(ck, check_truth=False)}")  # a flipped name may rename an entry: outcome only
        return
    meta = copy.deepcopy(bench.metadata)
    kind, apply = _mutations(data, meta)
    apply()
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    # dropping an entry or moving it in the nested dict changes the result by design
    event(f"{kind}: {bench.run(ck, check_truth=kind not in ('drop_entry', 'planner_path'))}")


def test_fuzz_bench_sees_the_pristine_checkpoint_as_correct(bench: _Bench) -> None:
    """The oracle itself: the untouched checkpoint converts and equals the truth."""
    assert bench.run(bench.scratch(), check_truth=True) == "ok"
    assert any(isinstance(v, BytesStorageMetadata) for v in bench.metadata.state_dict_metadata.values())
