"""formats/rank_files.py: find_rank_files groups per-rank files by prefix and checks their ranks against the world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_convert.errors import MissingDataFileError, NotADcpCheckpointError
from fsdp_convert.formats.rank_files import find_rank_files, rank_files_index


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
    assert index.world_size == 2 and index.producer == "verl"
    w, step = index.entries
    assert w.fqn == "model.w" and [c.relative_path for c in w.chunks] == ["model_world_size_2_rank_0.pt"]  # type: ignore[union-attr]
    assert step.fqn == "model.step" and step.relative_path == "model_world_size_2_rank_0.pt"  # type: ignore[union-attr]
