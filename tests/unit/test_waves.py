"""Waves of an output to object storage: whole files in order, each wave's work spread over every worker anew."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_convert.formats import open_checkpoint
from fsdp_convert.ops import _waves
from fsdp_convert.outputs import HfFolder
from fsdp_convert.plan.consolidate import file_bytes, group_waves, output_bytes, plan_consolidate, staging_bytes, wave_plans
from fsdp_convert.plan.items import prepare_items
from fsdp_convert.plan.reshard import plan_reshard, rank_file_bytes, wave_plan
from fsdp_convert.roles import GROUPS
from fsdp_convert.transform import TransformOptions
from tests._samples import Sample


@pytest.mark.parametrize(
    ("sizes", "wave_bytes", "want"),
    [
        ([4, 4, 4, 4], 8, ((0, 1), (2, 3))),
        ([4, 9, 4, 3, 1], 8, ((0,), (1,), (2, 3, 4))),  # a file over the limit is a wave of its own
        ([1, 1, 1], 100, ((0, 1, 2),)),
        ([], 8, ()),
    ],
)
def test_group_waves_cuts_files_in_order(sizes: list[int], wave_bytes: int, want: tuple[tuple[int, ...], ...]) -> None:
    assert group_waves(sizes, wave_bytes) == want


def test_staging_holds_two_consecutive_waves() -> None:
    assert staging_bytes([5, 3, 4, 1]) == 8 and staging_bytes([7]) == 7 and staging_bytes([]) == 0


def test_wave_plans_keep_every_file_once(ws3_ckpt: Sample, tmp_path: Path) -> None:
    source = open_checkpoint(ws3_ckpt.checkpoint, full_files=True)
    index = source.index
    items = prepare_items(source, TransformOptions(), HfFolder().groups("model"))
    plan = plan_consolidate(index, items, tmp_path / "out", kind=HfFolder(), max_shard_bytes=4096, nproc=2)
    waves = wave_plans(plan, 8192)
    assert len(waves) > 3 and tuple(f for w in waves for f in w.files) == plan.files
    assert sum(output_bytes(w) for w in waves) == output_bytes(plan)
    owners = set()
    for wave in waves:
        assert output_bytes(wave) <= 8192 or len(wave.files) == 1
        assert output_bytes(wave) == sum(file_bytes(wave, f) for f in wave.files)
        owners.update(wave.owners[i] for f in wave.files for i in f.item_ids)
    assert owners == {0, 1}  # striped anew over both workers


def test_reshard_waves_cover_every_rank_file_once(ws3_ckpt: Sample, monkeypatch: pytest.MonkeyPatch) -> None:
    source = open_checkpoint(ws3_ckpt.checkpoint, full_files=True)
    index = source.index
    items = prepare_items(source, TransformOptions(), GROUPS, keep_layout=True)
    plan = plan_reshard(index, items, 4, nproc=2)
    one = wave_plan(plan, frozenset({1}))
    assert {p.chunk.rank for p in one.payloads} == {1} and {p.owner for p in one.payloads} == {0, 1}
    assert {(p.item, p.offset) for p in one.payloads} == {(p.item, p.offset) for p in plan.payloads if p.chunk.rank == 1}
    sizes = rank_file_bytes(plan)
    monkeypatch.setattr(_waves, "WAVE_BYTES", max(sizes.values()))
    waves = _waves._rank_waves((("", plan),), _waves.WAVE_BYTES)
    assert sorted(f for w in waves for f in w.files) == [(0, r) for r in sorted(sizes)]
    assert [n for w in waves for n in w.names] == [f"__{r}_0.distcp" for r in sorted(sizes)]
    assert _waves.reshard_staging_bytes((("", plan),)) < sum(sizes.values())
