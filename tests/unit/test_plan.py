"""Plan: coverage checks, byte balancing and option checks, all before any tensor is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_convert.errors import CoverageError, InvalidOptionError
from fsdp_convert.formats import open_checkpoint
from fsdp_convert.formats.index import BytesEntry, ChunkEntry, TensorEntry, check_coverage
from fsdp_convert.item import OutputItem
from fsdp_convert.outputs import HfFolder, SafetensorsFile, TorchSaveFile, output_kind, plan_shards
from fsdp_convert.plan.consolidate import assign_owners, default_nproc, mover_buffers, plan_consolidate
from fsdp_convert.plan.items import prepare_items
from fsdp_convert.transform import TransformOptions
from tests._samples import Sample


def _entry(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], fqn: str = "model.w") -> TensorEntry:
    chunks = tuple(ChunkEntry(offsets=o, sizes=s, relative_path="__0_0.distcp", offset_bytes=0, length_bytes=1) for o, s in boxes)
    return TensorEntry(fqn=fqn, path=("model", fqn), shape=shape, dtype=torch.float32, chunks=chunks)


def _item(entry: TensorEntry | BytesEntry) -> OutputItem:
    dtype = entry.dtype if isinstance(entry, TensorEntry) else None
    return OutputItem(entry=entry, path=entry.path, group="model" if entry.path[0] == "model" else "optim", dtype=dtype)


def test_coverage_accepts_2d_tiling_and_empty_chunks() -> None:
    check_coverage(_entry((4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 6)), ((4, 0), (0, 6))]))
    check_coverage(_entry((), [((), ())]))


@pytest.mark.parametrize(
    ("boxes", "match"),
    [
        ([((0, 0), (2, 6))], "gap"),
        ([((0, 0), (3, 6)), ((2, 0), (2, 6))], "overlap"),
        ([((0, 0), (4, 6)), ((4, 0), (1, 6))], "outside"),
    ],
)
def test_coverage_rejects_gaps_overlaps_and_overhang(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], match: str) -> None:
    with pytest.raises(CoverageError, match=match):
        check_coverage(_entry((4, 6), boxes))


def test_owners_take_turns_by_bytes_so_far_and_values_stay_on_rank0() -> None:
    entries = (
        _entry((100,), [((0,), (100,))], "a"),
        _entry((60,), [((0,), (60,))], "b"),
        BytesEntry(
            fqn="lr", path=("optim", "param_groups", 0, "lr"), relative_path="__0_0.distcp", offset_bytes=0, length_bytes=9
        ),
        _entry((50,), [((0,), (50,))], "c"),
        _entry((30,), [((0,), (30,))], "d"),
    )
    items = tuple(_item(e) for e in entries)  # float32: a 400 bytes, b 240, c 200, d 120
    # a to rank 0 (both empty: the lower rank); b to rank 1 (0 bytes); c to rank 1 (240 < 400);
    # d to rank 0 (400 < 440); the value stays on rank 0
    assert assign_owners(items, 2) == (0, 1, 0, 1, 0)
    # d, c, b, a in the output: d 0, c 1, b 0 (120 < 200), a 1 (200 < 360)
    assert assign_owners(items, 2, order=[4, 3, 2, 1, 0]) == (1, 0, 0, 1, 0)
    assert assign_owners(items, 1) == (0, 0, 0, 0, 0)
    assert assign_owners(items, 3) == (0, 1, 0, 2, 2)  # a 0, b 1, c 2, d to rank 2 (200 < 240 < 400)


def test_plan_rejects_bad_options(ws3_ckpt: Sample, tmp_path: Path) -> None:
    source = open_checkpoint(ws3_ckpt.checkpoint, full_files=True)
    index = source.index
    with pytest.raises(InvalidOptionError, match="holds model weights only"):
        output_kind(tmp_path / "x.safetensors").groups("optim")
    with pytest.raises(InvalidOptionError, match="unknown output suffix"):
        output_kind(tmp_path / "x.txt")
    (tmp_path / "folder").mkdir()
    with pytest.raises(InvalidOptionError, match="output_format torch writes one torch.save file, not an existing folder"):
        output_kind(tmp_path / "folder", "torch")
    assert output_kind(tmp_path / "folder", "safetensors").name == "hf_dir"
    groups = SafetensorsFile().groups("all")
    items = prepare_items(source, TransformOptions(), groups)
    plan = plan_consolidate(index, items, tmp_path / "x.safetensors", kind=SafetensorsFile())
    assert {item.path[0] for item in plan.items} == {"model"}
    items = prepare_items(source, TransformOptions(), TorchSaveFile().groups("all"))
    plan = plan_consolidate(index, items, tmp_path / "x.pt", kind=TorchSaveFile(), nproc=3)
    loads = [0] * 3  # tensors only: values stay on rank 0
    for item, owner in zip(plan.items, plan.owners, strict=True):
        loads[owner] += item.nbytes if item.is_tensor else 0
    assert min(loads) > 0 and max(loads) - min(loads) <= max(item.nbytes for item in plan.items)
    with pytest.raises(InvalidOptionError, match="nothing to write"):
        plan_consolidate(index, (), tmp_path / "x.pt", kind=TorchSaveFile())


@pytest.mark.parametrize("name", ["last.ckpt", "weights", "model.PT", "state.tar"])
def test_format_torch_writes_torch_save_under_any_name_but_safetensors(tmp_path: Path, name: str) -> None:
    assert output_kind(tmp_path / name, "torch").name == "torch_save"
    with pytest.raises(InvalidOptionError, match=r"output_format torch writes one torch.save file, not a \.safetensors name"):
        output_kind(tmp_path / "model.safetensors", "torch")


def test_an_unknown_suffix_with_auto_suggests_format_torch(tmp_path: Path) -> None:
    suggestion = r"unknown output suffix '\.ckpt'.*output_format torch to write a torch\.save file"
    with pytest.raises(InvalidOptionError, match=suggestion):
        output_kind(tmp_path / "last.ckpt")
    assert output_kind(tmp_path / "last.ckpt", "safetensors").name == "hf_dir"  # as before: a folder of shards


def test_shards_pack_in_order_like_save_pretrained() -> None:
    items = tuple(_item(_entry((n,), [((0,), (n,))], f"t{i}")) for i, n in enumerate([10, 10, 30, 5, 5, 40]))  # x4 bytes
    ids = list(range(len(items)))
    shards = plan_shards(items, ids, max_shard_bytes=80)
    assert [s.item_ids for s in shards] == [(0, 1), (2,), (3, 4), (5,)]
    assert [s.filename for s in shards] == [f"model-0000{k}-of-00004.safetensors" for k in (1, 2, 3, 4)]
    # a tensor over the limit gets a shard of its own; each shard's tensors lie back to back after its header
    assert [s.data_offsets[-1] - s.data_offsets[0] + items[s.item_ids[-1]].nbytes for s in shards] == [80, 120, 40, 160]
    assert all(s.data_offsets[0] == len(s.header) for s in shards)
    assert [s.filename for s in plan_shards(items, ids, 10**9)] == ["model.safetensors"]


def test_default_nproc_is_capped_by_cores_files_and_size() -> None:
    assert default_nproc(total_bytes=100, data_files=8, cpus=16) == 1
    assert default_nproc(total_bytes=10 * 2**30, data_files=4, cpus=16) == 4
    assert default_nproc(total_bytes=10 * 2**30, data_files=8, cpus=16) == 5  # one per 2 GiB
    assert default_nproc(total_bytes=10 * 2**30, data_files=8, cpus=2) == 2  # one per core
    assert default_nproc(total_bytes=3 * 2**30, data_files=8, cpus=16) == 2


def test_mover_buffers_fit_the_memory_budget() -> None:
    threads, piece = mover_buffers(256 << 20)
    assert threads * 2 * piece <= 256 << 20 and piece >= 16 << 20
    threads, piece = mover_buffers(8 << 20)
    assert threads * 2 * piece == 8 << 20


def test_plan_drops_the_page_cache_only_for_outputs_over_half_the_ram(ws3_ckpt: Sample, tmp_path: Path) -> None:
    source = open_checkpoint(ws3_ckpt.checkpoint, full_files=True)
    index = source.index
    items = prepare_items(source, TransformOptions(), TorchSaveFile().groups("all"))
    total = sum(item.nbytes for item in items)
    small_ram = plan_consolidate(index, items, tmp_path / "x.pt", kind=TorchSaveFile(), ram_bytes=2 * total - 2)
    big_ram = plan_consolidate(index, items, tmp_path / "x.pt", kind=TorchSaveFile(), ram_bytes=2 * total)
    assert small_ram.drop_cache and not big_ram.drop_cache
    assert not plan_consolidate(index, items, tmp_path / "x.pt", kind=TorchSaveFile()).drop_cache  # RAM unknown


def test_plan_places_every_tensor_once_without_overlap(ws3_ckpt: Sample, tmp_path: Path) -> None:
    """Folder output: every tensor has one byte range, in one file, after that file's header, none overlapping."""
    source = open_checkpoint(ws3_ckpt.checkpoint, full_files=True)
    index = source.index
    items = prepare_items(source, TransformOptions(), HfFolder().groups("all"))
    plan = plan_consolidate(index, items, tmp_path / "out", kind=HfFolder(), max_shard_bytes=5000, nproc=2)
    assert len(plan.shards) > 2 and {f.filename for f in plan.files} >= {"optimizer.pt"}
    seen = [i for f in plan.files for i in f.item_ids]
    assert sorted(seen) == list(range(len(items)))
    for file in plan.files:
        ranges = sorted(
            (offset, offset + plan.items[i].nbytes)
            for i, offset in zip(file.item_ids, file.data_offsets, strict=True)
            if offset is not None
        )
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False)), file.filename
        assert not ranges or ranges[0][0] >= len(file.header)
    assert set(plan.owners) == {0, 1}


def test_a_param_group_field_stored_as_a_tensor_is_refused_before_planning(tmp_path: Path) -> None:
    """The params lists are read as plain values to build the optimizer items; a tensor there is named, not asserted on."""
    from fsdp_convert.errors import UnsupportedTransformError

    w = torch.zeros(2)
    torch.save({"model": {"w": w}, "optim": {"state": {"w": {"exp_avg": w}}, "param_groups": [{"params": w}]}}, tmp_path / "x.pt")
    source = open_checkpoint(tmp_path / "x.pt", full_files=True)
    with pytest.raises(UnsupportedTransformError, match="optim.param_groups.0.params: a tensor, where this tool reads"):
        prepare_items(source, TransformOptions(), TorchSaveFile().groups("all"))


def test_each_worker_gets_the_chunks_of_the_tensors_it_moves_alone(ws3_ckpt: Sample, tmp_path: Path) -> None:
    """``ConsolidateJob.for_rank``: a worker's job holds the chunks of its own tensors; every entry keeps name, shape, dtype."""
    import pickle

    from fsdp_convert.ops._consolidate_rank import ConsolidateJob

    source = open_checkpoint(ws3_ckpt.checkpoint)
    items = prepare_items(source, TransformOptions(), TorchSaveFile().groups("all"))
    plan = plan_consolidate(source.index, items, tmp_path / "x.pt", kind=TorchSaveFile(), nproc=2)
    job = ConsolidateJob(source=source, plan=plan, tmp_output=tmp_path / "tmp", progress=False, check_crc=True)
    chunks = sum(len(e.chunks) for e in source.index.tensors())
    shares = [pickle.loads(pickle.dumps(job.for_rank(rank))) for rank in (0, 1)]
    for rank, share in enumerate(shares):
        for item, whole, owner in zip(share.plan.items, plan.items, plan.owners, strict=True):
            assert (item.entry.fqn, item.path, item.dtype, getattr(item.entry, "shape", None)) == (
                whole.entry.fqn, whole.path, whole.dtype, getattr(whole.entry, "shape", None),
            )  # fmt: skip
            if isinstance(whole.entry, TensorEntry):
                assert item.entry.chunks == (whole.entry.chunks if owner == rank else ())
        assert [e.fqn for e in share.source.index.entries] == [e.fqn for e in source.index.entries]
    held = [sum(len(e.chunks) for e in share.source.index.tensors()) for share in shares]
    assert sum(held) == chunks and min(held) > 0  # the index's chunks split between the two, none twice


@pytest.mark.parametrize(("chunk_bytes", "threads"), [(4 << 10, 1), (64 << 10, 2), (32 << 20, 2)])
def test_small_chunks_are_moved_by_one_thread(chunk_bytes: int, threads: int) -> None:
    """Chunks averaging under 64 KiB (a 1024-rank save's): one mover thread a worker, where a second only contends."""
    from fsdp_convert.dtypes import DType
    from fsdp_convert.move import MoveJob, mover_threads

    chunks = tuple(
        ChunkEntry(offsets=(r, 0), sizes=(1, 8), relative_path=f"__{r}_0.distcp", offset_bytes=0, length_bytes=chunk_bytes)
        for r in range(4)
    )
    entry = TensorEntry(fqn="w", path=("w",), shape=(4, 8), dtype_name="float32", chunks=chunks)
    job = MoveJob(entry=entry, dtype=DType("float32"), file=0, fd=-1, offset=0)
    assert mover_threads([job, job], 2) == threads
