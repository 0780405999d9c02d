"""reshard: FSDP2 at the new world size loads the result (each rank from its own file) bit for bit.

Ground truth is the training run's own state dict and torch's own reading of the output
(``dcp_to_torch_save``, ``FileSystemReader.read_metadata``), never this tool's reading of it; the
comparisons with ``consolidate`` stay as regression checks.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from collections import Counter
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert._sample import SampleConfig, Transformer
from fsdp_convert.cli import app
from fsdp_convert.ops.reshard import reshard
from tests._compare import assert_same_state
from tests._dist import run_ranks
from tests._samples import Sample

CFG = SampleConfig()


def torch_view(checkpoint: Path, scratch: Path) -> dict[str, Any]:
    """A DCP checkpoint as torch itself reads it: ``dcp_to_torch_save`` (its own planner and
    ``planner_data`` nesting), then ``torch.load``."""
    out = scratch / f"{checkpoint.name}.torch-view.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=True)


def torch_chunk_rows(shape: tuple[int, ...], world_size: int) -> list[tuple[int, int]]:
    """``(start, rows)`` of each chunk ``torch.chunk(world_size)`` makes of a tensor of ``shape`` on dim 0."""
    sizes = [part.shape[0] for part in torch.empty(shape, device="meta").chunk(world_size)]
    return list(zip(itertools.accumulate([0, *sizes]), sizes))


def assert_torch_chunk_layout(checkpoint: Path, world_size: int, whole: Collection[str] = ()) -> int:
    """From ``.metadata`` as torch reads it: every tensor is cut on dim 0 as ``torch.chunk(world_size)``
    cuts it, chunk r stored in ``__r_0.distcp``; a 0-dim tensor, and each tensor named in ``whole``,
    is one whole chunk in rank 0's file, and so is every bytes entry. Returns the number of
    tensors checked."""
    md = FileSystemReader(str(checkpoint)).read_metadata()
    tensors = 0
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            assert md.storage_data[MetadataIndex(fqn)].relative_path == "__0_0.distcp", fqn
            continue
        assert isinstance(meta, TensorStorageMetadata), fqn
        shape = tuple(meta.size)
        if fqn in whole:
            want = [((0,) * len(shape), shape)]
        elif shape:
            rest = (0,) * (len(shape) - 1)
            want = [((start, *rest), (rows, *shape[1:])) for start, rows in torch_chunk_rows(shape, world_size)]
        else:
            want = [((), ())]
        got = [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]
        assert sorted(got) == want, (fqn, got, want)
        for rank, (offsets, _) in enumerate(want):
            assert md.storage_data[MetadataIndex(fqn, torch.Size(offsets))].relative_path == f"__{rank}_0.distcp", (fqn, rank)
        tensors += 1
    return tensors


def _batch() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (CFG.batch_size, CFG.seq_len + 1), generator=torch.Generator().manual_seed(99))


def _losses(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[float]:
    """Loss of one training step on a fixed batch, then the loss after that step."""
    tokens = _batch()
    losses = []
    for step in range(2):
        loss = F.cross_entropy(model(tokens[:, :-1]).float().reshape(-1, CFG.vocab_size), tokens[:, 1:].reshape(-1))
        losses.append(loss.item())
        if step == 0:
            loss.backward()
            optim.step()
            optim.zero_grad()
    return losses


def _load_at_new_world_size(rank: int, world_size: int, checkpoint: Path, truth_path: Path, out: Path) -> None:
    torch.manual_seed(1234)  # a different init: only the load can make the values right
    model = Transformer(CFG)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model_sd, optim_sd = get_state_dict(model, optim)
    # this rank sees only .metadata, its own file and rank 0's (which holds the replicated entries)
    mine = out / f"rank{rank}"
    mine.mkdir()
    for name in {".metadata", f"__{rank}_0.distcp", "__0_0.distcp"}:
        if (checkpoint / name).exists():
            shutil.copy(checkpoint / name, mine / name)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=mine)
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    got = {"model": get_model_state_dict(model, options=full), "optim": get_optimizer_state_dict(model, optim, options=full)}
    if rank == 0:  # compare before the step: at world size 1 these can share storage with the parameters
        truth = torch.load(truth_path, weights_only=True)
        assert_same_state(got["model"], truth["model"])
        assert_same_state(got["optim"], truth["optim"])
    del got
    losses = _losses(model, optim)
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))


def _reference_losses(truth: dict) -> list[float]:  # type: ignore[type-arg]
    """The same step in one process, without FSDP, from the ground truth."""
    model = Transformer(CFG)
    model.load_state_dict(truth["model"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ids = {fqn: i for i, (fqn, _) in enumerate(model.named_parameters())}
    groups = [{**g, "params": [ids[f] for f in g["params"]]} for g in truth["optim"]["param_groups"]]
    optim.load_state_dict({"state": {ids[f]: s for f, s in truth["optim"]["state"].items()}, "param_groups": groups})
    return _losses(model, optim)


@pytest.mark.parametrize("target", [1, 2, 4])
def test_fsdp2_loads_resharded_checkpoint_from_own_files(ws3_ckpt: Sample, tmp_path: Path, target: int) -> None:
    out = tmp_path / f"ws{target}"
    result = reshard(ws3_ckpt.checkpoint, out, world_size=target)
    assert result.target_world_size == target
    assert sorted(p.name for p in out.iterdir()) == [".metadata", *(f"__{r}_0.distcp" for r in range(target))]
    work = tmp_path / "load"
    work.mkdir()
    run_ranks(_load_at_new_world_size, target, out, ws3_ckpt.truth_path, work)
    fsdp_losses = json.loads((work / "losses.json").read_text())
    reference = _reference_losses(ws3_ckpt.truth())
    assert all(torch.isfinite(torch.tensor(fsdp_losses)))
    assert fsdp_losses == pytest.approx(reference, rel=1e-6)


@pytest.mark.parametrize("target", [1, 4])
def test_reshard_round_trip_consolidates_byte_identical(ws3_ckpt: Sample, tmp_path: Path, target: int) -> None:
    """Regression check: consolidating the reshard gives the bytes consolidating the source gives.
    Oracle: torch's own reading of the reshard is the run's full state dict, and torch's
    ``.metadata`` says every tensor is cut as ``torch.chunk(target)`` cuts it."""
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, tmp_path / "direct.pt", nproc=1)
    reshard(ws3_ckpt.checkpoint, tmp_path / "resharded", world_size=target)
    fsdp_convert.consolidate(tmp_path / "resharded", tmp_path / "via.pt", nproc=1)
    assert (tmp_path / "direct.pt").read_bytes() == (tmp_path / "via.pt").read_bytes()
    truth = ws3_ckpt.truth()
    assert assert_same_state(torch_view(tmp_path / "resharded", tmp_path), truth) == 124
    assert assert_torch_chunk_layout(tmp_path / "resharded", target) == 124


def test_resharded_checkpoint_reads_with_torch_dcp_to_torch_save(ws3_ckpt: Sample, tmp_path: Path) -> None:
    """torch's dcp_to_torch_save of a reshard to 2 is the run's full state dict (model, optimizer,
    train state, in the order the run's state dict has them)."""
    reshard(ws3_ckpt.checkpoint, tmp_path / "r", world_size=2)
    assert assert_same_state(torch_view(tmp_path / "r", tmp_path), ws3_ckpt.truth()) == 124
    assert assert_torch_chunk_layout(tmp_path / "r", 2) == 124


def test_reshard_cli_with_two_writers(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    out = tmp_path / "ws4"
    result = runner.invoke(app, ["reshard", str(ws3_ckpt.checkpoint), str(out), "--world-size", "4", "--nproc", "2", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["world_size"] == 4 and doc["nproc"] == 2
    one = tmp_path / "one"
    reshard(ws3_ckpt.checkpoint, one, world_size=4, nproc=1)
    for name in (f"__{r}_0.distcp" for r in range(4)):
        assert (out / name).read_bytes() == (one / name).read_bytes(), name
    assert fsdp_convert.verify(ws3_ckpt.checkpoint, out).equal
    again = runner.invoke(app, ["reshard", str(ws3_ckpt.checkpoint), str(out), "--world-size", "4"])
    assert again.exit_code == 4 and "--overwrite" in again.stderr


def _load_model_only(rank: int, world_size: int, checkpoint: Path, truth_path: Path, out: Path) -> None:
    """FSDP2 at the new world size loads a reshard of a plain ``model.state_dict()`` file."""
    torch.manual_seed(1234)
    model = Transformer(CFG)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model_sd = get_model_state_dict(model)
    dcp.load(model_sd, checkpoint_id=checkpoint)
    set_model_state_dict(model, model_sd)
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        assert_same_state(got, torch.load(truth_path, weights_only=True)["model"])


@pytest.mark.parametrize("source", ["state_dict.pt", "model.safetensors"])
def test_full_file_resharded_to_three_loads_with_fsdp2(ws3_ckpt: Sample, tmp_path: Path, source: str) -> None:
    src = tmp_path / source
    if source.endswith(".pt"):
        torch.save(ws3_ckpt.truth()["model"], src)  # what torch.save(model.state_dict()) writes
    else:
        fsdp_convert.consolidate(ws3_ckpt.checkpoint, src)
    out = tmp_path / "ws3"
    reshard(src, out, world_size=3)
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    run_ranks(_load_model_only, 3, out, ws3_ckpt.truth_path, tmp_path)


def test_consolidated_pt_resharded_loads_model_and_optimizer(ws3_ckpt: Sample, tmp_path: Path) -> None:
    full = tmp_path / "full.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, full)
    out = tmp_path / "ws2"
    reshard(full, out, world_size=2)
    work = tmp_path / "load"
    work.mkdir()
    run_ranks(_load_at_new_world_size, 2, out, ws3_ckpt.truth_path, work)
    assert json.loads((work / "losses.json").read_text()) == pytest.approx(_reference_losses(ws3_ckpt.truth()), rel=1e-6)


ReadRecord = tuple[str, tuple[int, ...], str, int, int]  # fqn, chunk offsets, data file, byte offset, length


def _reads_meeting(source: Path, target_world_size: int) -> dict[int, Counter[ReadRecord]]:
    """Per target rank, the source chunks its chunks meet, computed from torch's reading of the
    source's ``.metadata`` alone: a non-empty source chunk is read once for each target chunk
    (``torch.chunk(target_world_size)`` rows on dim 0, or the whole of a 0-dim tensor on rank 0)
    whose rows it shares, at the byte range ``storage_data`` gives it."""
    md = FileSystemReader(str(source)).read_metadata()
    want: dict[int, Counter[ReadRecord]] = {rank: Counter() for rank in range(target_world_size)}
    for fqn, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue  # bytes entries are copied, not read as chunks
        shape = tuple(meta.size)
        targets = list(enumerate(torch_chunk_rows(shape, target_world_size))) if shape else [(0, (0, 1))]
        for chunk in meta.chunks:
            if math.prod(chunk.sizes) == 0:
                continue  # FSDP2's empty chunks hold nothing to read
            lo, hi = (chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]) if shape else (0, 1)
            info = md.storage_data[MetadataIndex(fqn, chunk.offsets)]
            record = (fqn, tuple(chunk.offsets), info.relative_path, info.offset, info.length)
            for rank, (start, rows) in targets:
                if max(lo, start) < min(hi, start + rows):
                    want[rank][record] += 1
    return want


def _logged_reads(log_dir: Path) -> dict[int, Counter[ReadRecord]]:
    """The chunks each worker read, from the FSDP_CONVERT_READ_LOG files (one JSON line per chunk read)."""
    reads: dict[int, Counter[ReadRecord]] = {}
    for log in log_dir.glob("reads-*.jsonl"):
        for line in log.read_text().splitlines():
            rank, fqn, offsets, relative_path, offset, length = json.loads(line)
            reads.setdefault(int(rank), Counter())[(fqn, tuple(offsets), relative_path, offset, length)] += 1
    return reads


@pytest.mark.parametrize(("target", "nproc"), [(2, 1), (4, 1), (6, 1), (4, 2)])
def test_reshard_reads_only_the_source_chunks_a_target_chunk_meets(
    ws3_ckpt: Sample, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: int, nproc: int
) -> None:
    """docs/options.md: "Only the source chunks a target chunk meets are read." From 3 ranks to 2, 4 and 6:
    the workers together read exactly the source chunks the target chunks meet, each once per such
    target chunk, at the byte range torch's .metadata gives, and nothing else (an empty chunk, a
    chunk of rows the target chunk does not hold); with 2 workers both read (chunks are balanced
    over workers by bytes, whatever rank file they go to)."""
    logs = tmp_path / "reads"
    logs.mkdir()
    monkeypatch.setenv("FSDP_CONVERT_READ_LOG", str(logs))
    monkeypatch.delenv("RANK", raising=False)
    reshard(ws3_ckpt.checkpoint, tmp_path / "out", world_size=target, nproc=nproc)
    meeting = _reads_meeting(ws3_ckpt.checkpoint, target)
    want = sum(meeting.values(), Counter())
    got = _logged_reads(logs)
    assert sorted(got) == list(range(nproc))
    total = sum(got.values(), Counter())
    extra, missing = total - want, want - total
    assert not extra and not missing, (sorted(extra)[:5], sorted(missing)[:5])
    # the log is not vacuous: some chunk is read for two target chunks, and some chunk is left
    # unread by a target rank (reading everything, or each chunk once, would not pass)
    assert max(sum(meeting.values(), Counter()).values()) > 1
    every_chunk = set().union(*meeting.values())
    assert all(set(meeting[r]) < every_chunk for r in range(target))
