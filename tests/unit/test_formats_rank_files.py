"""formats/rank_files.py: find_rank_files groups per-rank files by prefix and checks their ranks against the world size;
DTensor boxes from placements (``_rank_shards``), ``_StridedShard`` ones from torch's own offsets."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

from fsdp_convert.errors import MissingDataFileError, NotADcpCheckpointError
from fsdp_convert.formats._rank_shards import _local_box, _placements, _strided_boxes
from fsdp_convert.formats._rank_unpickler import _RECORDS, Record
from fsdp_convert.formats.rank_files import find_rank_files, rank_files_index
from fsdp_convert.producers import detect_producer
from fsdp_convert.torch_compat import dtensor_local_box


def _touch(root: Path, *names: str) -> None:
    for name in names:
        (root / name).write_bytes(b"")


def test_files_are_grouped_by_prefix_and_rank(tmp_path: Path) -> None:
    _touch(
        tmp_path,
        "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt",
        "optim_world_size_2_rank_1.pt", "optim_world_size_2_rank_0.pt",
        "extra_state_world_size_2_rank_0.pt", "extra_state_world_size_2_rank_1.pt",
        "notes.txt", "model.safetensors", "rank_0.json",
    )  # fmt: skip
    (tmp_path / "model_rank_7.pt").mkdir()  # a folder, not a file
    groups = find_rank_files(tmp_path)
    assert sorted(groups) == ["extra_state", "model", "optim"]
    assert {r: p.name for r, p in groups["optim"].items()} == {
        0: "optim_world_size_2_rank_0.pt",
        1: "optim_world_size_2_rank_1.pt",
    }


@pytest.mark.parametrize(
    ("names", "prefix", "ranks"),
    [
        (["rank0.pt", "rank1.pt"], "state", [0, 1]),
        (["shard-rank-0.bin", "shard-rank-1.bin", "shard-rank-2.bin"], "shard", [0, 1, 2]),
        (["model_rank_0.pth"], "model", [0]),
    ],
)
def test_names_without_a_world_size(tmp_path: Path, names: list[str], prefix: str, ranks: list[int]) -> None:
    _touch(tmp_path, *names)
    assert {k: sorted(v) for k, v in find_rank_files(tmp_path).items()} == {prefix: ranks}


def test_a_folder_without_rank_files_has_none(tmp_path: Path) -> None:
    _touch(tmp_path, "model.pt", ".metadata", "__0_0.distcp")
    assert find_rank_files(tmp_path) == {}


def test_a_missing_rank_is_named(tmp_path: Path) -> None:
    _touch(tmp_path, "model_world_size_3_rank_0.pt", "model_world_size_3_rank_2.pt")
    with pytest.raises(MissingDataFileError, match="model_world_size_3_rank_1.pt is missing"):
        find_rank_files(tmp_path)
    (tmp_path / "model_world_size_3_rank_2.pt").unlink()
    _touch(tmp_path, "model_world_size_3_rank_1.pt")
    with pytest.raises(MissingDataFileError, match="rank_2.pt is missing"):
        find_rank_files(tmp_path)


def test_a_gap_without_a_world_size_is_missing(tmp_path: Path) -> None:
    _touch(tmp_path, "rank0.pt", "rank2.pt")
    with pytest.raises(MissingDataFileError, match="rank1.pt is missing"):
        find_rank_files(tmp_path)


def test_two_saves_in_one_folder_are_refused(tmp_path: Path) -> None:
    _touch(tmp_path, "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt", "model_world_size_1_rank_0.pt")
    with pytest.raises(NotADcpCheckpointError, match="several world sizes"):
        find_rank_files(tmp_path)


def test_a_rank_past_the_world_size_is_refused(tmp_path: Path) -> None:
    _touch(tmp_path, "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt", "model_world_size_2_rank_2.pt")
    with pytest.raises(NotADcpCheckpointError, match="rank 2 is past world size 2"):
        find_rank_files(tmp_path)


def test_replicated_plain_tensors_are_read_from_the_first_rank(tmp_path: Path) -> None:
    for rank in range(2):
        torch.save({"w": torch.full((2, 2), float(rank)), "step": rank}, tmp_path / f"model_world_size_2_rank_{rank}.pt")
    index = rank_files_index(tmp_path)
    assert index.world_size == 2 and detect_producer(index).name == "verl"
    w, step = index.entries
    assert w.fqn == "model.w" and [c.relative_path for c in w.chunks] == ["model_world_size_2_rank_0.pt"]  # type: ignore[union-attr]
    assert step.fqn == "model.step" and step.relative_path == "model_world_size_2_rank_0.pt"  # type: ignore[union-attr]


def _rows(n: int, *cuts: tuple[int, int]) -> list[int]:
    """Indices 0..n-1 cut by torch.chunk ``parts`` times, keeping piece ``index``, for each ``(parts, index)`` in order."""
    rows = list(range(n))
    for parts, index in cuts:
        pieces = torch.tensor(rows, dtype=torch.long).chunk(parts) if rows else ()
        rows = pieces[index].tolist() if index < len(pieces) else []
    return rows


@pytest.mark.parametrize("rows", [101, 64, 8, 3, 1])
def test_fsdp_over_tp_strided_shards_are_the_boxes_fsdp_stores(rows: int) -> None:
    """``(_StridedShard(0, sf=2), Shard(0))`` on a (dp=2, tp=2) mesh: tp cuts the rows first, then
    FSDP cuts each tp shard (both torch.chunk), so each rank's rows are one run."""
    boxes = _strided_boxes((rows, 5), (2, 2), (("_StridedShard", 0, 2), ("Shard", 0, 1)))
    assert not isinstance(boxes, str)
    for (dp, tp), (sizes, offsets) in boxes.items():
        want = _rows(rows, (2, tp), (2, dp))
        assert sizes == (len(want), 5), (dp, tp)
        if want:
            assert offsets == (want[0], 0), (dp, tp)


def test_an_interleaved_strided_shard_is_not_a_box() -> None:
    reason = _strided_boxes((8, 3), (2, 2), (("_StridedShard", 0, 2), ("Replicate", 0, 1)))
    assert isinstance(reason, str) and "not one contiguous run" in reason and "_StridedShard(0, sf=2), Replicate()" in reason


@pytest.mark.parametrize("shape", [(7, 5), (4, 9), (1, 2), (12, 12)])
@pytest.mark.parametrize("dims", [(0, 1), (1, 0), (None, 0), (0, 0), (1, None), (1, 1)])
def test_torchs_boxes_agree_with_ours_for_shard_and_replicate(
    shape: tuple[int, int], dims: tuple[int | None, int | None]
) -> None:
    """``_local_box`` (Shard and Replicate, no private torch) gives what torch's own function gives."""
    placements = tuple(("Replicate", 0, 1) if d is None else ("Shard", d, 1) for d in dims)
    for coordinate in itertools.product(range(2), range(3)):
        ours = _local_box(shape, (2, 3), coordinate, list(dims))
        sizes, offsets = dtensor_local_box(shape, (2, 3), coordinate, placements)
        assert ours[0] == sizes
        assert all(o == t for o, t, s in zip(ours[1], offsets, sizes) if s > 0), (coordinate, ours, offsets)


def _record(name: str, *args: object, **state: object) -> Record:
    cls = _RECORDS[name]
    obj = cls(*args)
    obj.__setstate__(state)
    return obj


def _spec(order: tuple[tuple[int, tuple[int, ...]], ...] | None, strided_as_order: bool) -> dict[str, object]:
    shard = "torch.distributed.tensor.placement_types.Shard"
    entries = (
        None if order is None else tuple(_record("torch.distributed.tensor._dtensor_spec.ShardOrderEntry", *e) for e in order)
    )
    return {
        "placements": (_record(shard, dim=0), _record(shard, dim=0)),
        "shard_order": entries,
        "use_strided_shard_as_shard_order": strided_as_order,
    }


def test_a_shard_order_other_than_left_to_right_is_refused() -> None:
    """DTensorSpec.shard_order can say a dim is cut by mesh dim 1 before mesh dim 0; DCP's offsets
    (from placements alone) would then be wrong, so such a file is refused, not misread."""
    assert _placements(_spec(((0, (0, 1)),), False), "f w") == (("Shard", 0, 1), ("Shard", 0, 1))
    assert _placements(_spec(None, False), "f w") == (("Shard", 0, 1), ("Shard", 0, 1))
    with pytest.raises(NotADcpCheckpointError, match=r"^f w: shard order \{0: \(1, 0\)\} is not left to right"):
        _placements(_spec(((0, (1, 0)),), False), "f w")


def test_a_torch_without_dtensor_offsets_fails_in_one_line_naming_its_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.tensor._utils as dtensor_utils

    from fsdp_convert.errors import TorchFeatureError

    monkeypatch.delattr(dtensor_utils, "_compute_local_shape_and_global_offset")
    _strided_boxes.cache_clear()
    with pytest.raises(
        TorchFeatureError, match=rf"^torch {re.escape(torch.__version__)} lacks .*_compute_local_shape_and_global_offset"
    ) as e:
        _strided_boxes((4, 2), (2, 2), (("_StridedShard", 0, 2), ("Shard", 0, 1)))
    assert "\n" not in str(e.value)
