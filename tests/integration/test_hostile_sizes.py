"""Small inputs that claim huge sizes: every check runs in time the input's size bounds, or refuses in one line.

Each case is made here from the 2-rank sample (its ``.metadata`` rewritten with torch's own
metadata classes and pickle) or as a per-rank torch.save file (a DTensor saved on a one-rank
mesh, its mesh then claimed larger); the bounds asserted are generous (10 to 100 times today's
time) against what the same input cost before: minutes to hours, or a 1 GiB output from 2 KB.
"""

from __future__ import annotations

import itertools
import os
import pickle
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli import app
from fsdp_convert.formats._rank_pieces import MAX_MESH_RANKS, Placement, strided_box
from fsdp_convert.formats.dcp import load_metadata
from fsdp_convert.torch_compat import StorageInfo, dtensor_local_box
from fsdp_convert.writers.torch_save import _HeaderImage
from tests._dist import run_ranks
from tests._samples import Sample, _sample

pytestmark = pytest.mark.redteam  # last rounds' attacks: part of `pytest -m redteam`


@pytest.fixture(scope="module")
def ws2(samples_root: Path) -> Sample:
    """The 2-rank fp32 sample (the one the attacks were made from)."""
    return _sample("ws2_fp32", samples_root)


def _crafted(sample: Sample, root: Path, mutate: Callable[[Any], None]) -> Path:
    """A copy of ``sample``'s checkpoint whose ``.metadata`` ``mutate`` rewrote (pickled as torch pickles it)."""
    ck = root / "ck"
    shutil.copytree(sample.checkpoint, ck)
    meta = load_metadata(ck / ".metadata")
    mutate(meta)
    (ck / ".metadata").write_bytes(pickle.dumps(meta, protocol=4))
    return ck


def _one_element_chunks(n: int) -> Callable[[Any], None]:
    """A tensor ``model.many`` of ``n`` fp32 elements in ``n`` one-element chunks, each with its own payload record."""

    def mutate(meta: Any) -> None:
        chunks = [ChunkStorageMetadata(offsets=torch.Size([i]), sizes=torch.Size([1])) for i in range(n)]
        properties = TensorProperties(dtype=torch.float32)
        meta.state_dict_metadata["model.many"] = TensorStorageMetadata(properties, torch.Size([n]), chunks)
        for i, c in enumerate(chunks):  # 8-byte records past the end of the data file: only reading fails
            meta.storage_data[MetadataIndex("model.many", c.offsets)] = StorageInfo("__0_0.distcp", 10**9 + 8 * i, 8)
        meta.planner_data["model.many"] = ("model", "many")

    return mutate


def test_a_tensor_in_8000_chunks_is_planned_in_seconds(ws2: Sample, tmp_path: Path) -> None:
    """A 1.1 MB .metadata of one tensor in 8,000 one-element chunks: check_coverage took 106 s before the first read."""
    ck = _crafted(ws2, tmp_path, _one_element_chunks(8000))
    assert (ck / ".metadata").stat().st_size < 2 << 20
    start = time.monotonic()
    report = fsdp_convert.inspect(ck)
    assert next(e for e in report.entries if e.fqn == "model.many").chunks == 8000
    out = tmp_path / "out.pt"
    with pytest.raises(fsdp_convert.CorruptChunkError, match=r"model\.many.*past the end of the file"):
        fsdp_convert.consolidate(ck, out, nproc=1)
    assert time.monotonic() - start < 30  # about 1 s here
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_the_torch_save_header_image_reads_a_part_in_log_time() -> None:
    """torch.save's zip of a million records is read back a record at a time; each read scanned every later part."""
    image = _HeaderImage()
    n = 200_000
    for k in range(n):  # a 30-byte header, then a skipped 64-byte storage, as reserve_record writes them
        image.write(k.to_bytes(30, "little"))
        image.seek(64, os.SEEK_CUR)
    start = time.monotonic()
    assert all(image.pread(30, 94 * k) == k.to_bytes(30, "little") for k in range(n))
    assert image.pread(94, 94 * (n - 1)) == (n - 1).to_bytes(30, "little") + bytes(64)
    assert time.monotonic() - start < 10  # 0.1 s here; the slicing took minutes


# --- per-rank files ---------------------------------------------------------------------------


def _rank_file(rank: int, world_size: int, path: Path, mesh: tuple[int, ...], placements: list[Placement], shape: int) -> None:
    """Save ``{"w": DTensor}`` as verl does, made on a one-rank mesh and then claiming ``mesh`` (coordinate 0...)."""
    from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    made = [
        Shard(d) if k == "Shard" else _StridedShard(d, split_factor=sf) if k == "_StridedShard" else Replicate()
        for k, d, sf in placements
    ]
    box = strided_box((shape,), mesh, (0,) * len(mesh), tuple(placements))
    local = torch.arange(2 if isinstance(box, str) else box[0][0], dtype=torch.float32)
    device_mesh = init_device_mesh("cpu", (1,) * len(mesh))
    dt = DTensor.from_local(local, device_mesh, made, run_check=False, shape=torch.Size([shape]), stride=(1,))
    axes = tuple(_FlatLayout((n,), (1,)) for n in mesh)
    object.__setattr__(dt._spec.mesh, "_layout", _MeshLayout(axes))
    object.__setattr__(dt._spec.mesh, "_coordinate_on_dim", (0,) * len(mesh))
    torch.save({"w": dt}, path)


def _claiming(tmp_path: Path, mesh: tuple[int, ...], placements: list[Placement], shape: int) -> Path:
    folder = tmp_path / "rank_files"
    folder.mkdir()
    run_ranks(_rank_file, 1, folder / "model_rank_0.pt", mesh, placements, shape)
    return folder


def test_a_strided_shard_on_a_claimed_mesh_of_50000_ranks_is_placed_at_once(tmp_path: Path) -> None:
    """FSDP over tensor parallelism claimed on a (50,000 x 2) mesh: torch computed every rank's box (past 300 s from 10^4)."""
    n = 50_000
    folder = _claiming(tmp_path, (n, 2), [("_StridedShard", 0, 2), ("Shard", 0, 1)], 4 * n)
    start = time.monotonic()
    entry = next(e for e in fsdp_convert.inspect(folder).entries if e.fqn == "model.w")
    assert time.monotonic() - start < 20  # about 0.1 s here
    assert entry.shape == (4 * n,) and entry.chunks == 1


def test_an_interleaved_strided_shard_on_a_huge_mesh_is_refused_at_once(runner: CliRunner, tmp_path: Path) -> None:
    n = 100_000
    folder = _claiming(tmp_path, (n,), [("_StridedShard", 0, 2)], 2 * n)
    start = time.monotonic()
    result = runner.invoke(app, ["inspect", str(folder)])
    assert time.monotonic() - start < 20
    assert result.exit_code == 3 and result.stderr.count("\n") == 1
    assert "model_rank_0.pt w: placements (_StridedShard(0, sf=2)) on mesh [100000]" in result.stderr
    assert "not one contiguous run" in result.stderr


def test_a_mesh_past_the_cap_is_refused_in_one_line(runner: CliRunner, tmp_path: Path) -> None:
    folder = _claiming(tmp_path, (2, MAX_MESH_RANKS), [("Shard", 0, 1), ("_StridedShard", 0, 2)], 8)
    result = runner.invoke(app, ["inspect", str(folder)])
    assert result.exit_code == 3
    assert (
        result.stderr
        == f"error: {folder / 'model_rank_0.pt'} w: a mesh of more than {MAX_MESH_RANKS} ranks; not a training run's\n"
    )


def test_a_stride_0_local_tensor_is_refused_not_written_as_1_gib(runner: CliRunner, tmp_path: Path) -> None:
    """A 2 KB rank file holding one float expanded to 2^28 elements wrote a 1 GiB output."""
    folder = tmp_path / "rank_files"
    folder.mkdir()
    torch.save({"w": torch.ones(1).expand(1 << 28)}, folder / "model_rank_0.pt")
    assert (folder / "model_rank_0.pt").stat().st_size < 10_000
    out = tmp_path / "out.pt"
    result = runner.invoke(app, ["consolidate", str(folder), str(out)])
    assert result.exit_code == 1, result.stderr
    assert result.stderr == (
        f"error: {folder / 'model_rank_0.pt'} w: local tensor of shape [268435456] has strides [0] "
        "that make its elements overlap in storage; not reading it\n"
    )
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_transposed_and_sliced_local_tensors_still_read(tmp_path: Path) -> None:
    folder = tmp_path / "rank_files"
    folder.mkdir()
    base = torch.arange(24.0).reshape(4, 6)
    saved = {"t": base.t(), "rows": base[1:3], "cols": base[:, 2:5], "one": torch.ones(1).expand(1)}
    torch.save(saved, folder / "model_rank_0.pt")
    out = tmp_path / "out.pt"
    fsdp_convert.consolidate(folder, out, nproc=1)
    got = torch.load(out, weights_only=True)["model"]
    assert all(torch.equal(got[k], v) for k, v in saved.items())


# --- the strided arithmetic, against torch and against counting indices -------------------------


def _chunks(seq: list[int], parts: int) -> list[list[int]]:
    pieces = [p.tolist() for p in torch.tensor(seq, dtype=torch.long).chunk(parts)] if seq else []
    return pieces + [[]] * (parts - len(pieces))


def _kept_indices(
    shape: tuple[int, ...], mesh: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[Placement, ...]
) -> list[list[int]]:
    """Each dim's global indices a rank keeps, by applying the placements to lists (torch.chunk semantics)."""
    kept = [list(range(n)) for n in shape]
    for (kind, dim, sf), parts, index in zip(placements, mesh, coordinate):
        if kind == "Shard":
            kept[dim] = _chunks(kept[dim], parts)[index]
        elif kind == "_StridedShard":
            kept[dim] = [i for piece in _chunks(kept[dim], sf) for i in _chunks(piece, parts)[index]]
    return kept


_KINDS = [("Replicate", 0, 1), ("Shard", 0, 1), ("Shard", 1, 1)] + [("_StridedShard", d, sf) for d in (0, 1) for sf in (1, 2, 3)]


@pytest.mark.parametrize("shape", [(7, 2), (5, 3), (1, 4), (0, 3)])
@pytest.mark.parametrize("mesh", [(2,), (3,), (2, 2), (3, 2)])
def test_strided_boxes_are_torchs_and_refused_exactly_when_indices_are_not_one_run(
    shape: tuple[int, int], mesh: tuple[int, ...]
) -> None:
    for placements in itertools.product(_KINDS, repeat=len(mesh)):
        for coordinate in itertools.product(*(range(n) for n in mesh)):
            box = strided_box(shape, mesh, coordinate, placements)
            kept = _kept_indices(shape, mesh, coordinate, placements)
            runs = all(k == list(range(k[0], k[0] + len(k))) for k in kept if k)
            assert isinstance(box, str) != runs, (placements, coordinate, box, kept)
            if runs:
                assert box == dtensor_local_box(shape, mesh, coordinate, placements), (placements, coordinate)
                assert box[0] == tuple(len(k) for k in kept)


def test_a_dict_shared_or_inside_itself_is_refused_not_walked_forever(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pickle's memo lets 1 KB hold a dict referred to twice at each of 40 levels: 2^40 leaves to walk."""
    import fsdp_convert.formats.rank_files as rank_files

    shared: dict[str, Any] = {"w": torch.zeros(1)}
    for _ in range(40):
        shared = {"a": shared, "b": shared}
    looped: dict[str, Any] = {}
    looped["again"] = looped
    monkeypatch.setattr(rank_files, "MAX_ENTRIES", 10_000)  # the real cap (4M leaves) takes seconds
    for name, state in (("shared", shared), ("looped", looped)):
        folder = tmp_path / name
        folder.mkdir()
        torch.save(state, folder / "model_rank_0.pt")
        start = time.monotonic()
        result = runner.invoke(app, ["inspect", str(folder)])
        assert time.monotonic() - start < 20
        why = "values nested more than 64 deep or more than 10000 of them" if name == "shared" else "a value that contains itself"
        assert result.exit_code == 3 and result.stderr.startswith(f"error: {folder / 'model_rank_0.pt'}: {why}"), result.stderr
        assert len(result.stderr.splitlines()) == 1
