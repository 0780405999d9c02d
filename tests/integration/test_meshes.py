"""2-D meshes: FSDP2 x tensor parallel and HSDP checkpoints consolidate and reshard bit for bit.

One 4-rank launch (``tests/_meshes.py``) trains both and saves each as DCP and as verl-style
per-rank files; ground truth is the same run's full state dicts. DCP records a ``_StridedShard``
shard as the box at its first element (``compute_local_shape_and_global_offset``); FSDP over
tensor parallelism makes that box exact, and the rank-file reader computes the same boxes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.cells import cell_len
from safetensors.torch import load_file
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli import app
from fsdp_convert.formats._rank_unpickler import kind, load_rank_file
from tests._compare import assert_same_state
from tests._dist import run_ranks
from tests._meshes import MESHES, TRUTH, WORLD_SIZE, two_d_meshes
from tests.integration.test_reshard import _load_at_new_world_size, _reference_losses

GOLDEN = Path(__file__).parent.parent / "golden" / "inspect_tp_2x2.json"
SOURCES = ("checkpoint", "rank_files")


@pytest.fixture(scope="session")
def meshes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tp/``, ``hsdp/`` (each ``checkpoint/``, ``rank_files/``, ``truth.pt``), ``interleaved/rank_files``.

    One 4-rank launch; see tests/_meshes.py.
    """
    out = tmp_path_factory.mktemp("meshes")
    run_ranks(two_d_meshes, WORLD_SIZE, out)
    return out


def _truth(meshes: Path, mesh: str) -> dict[str, Any]:
    return torch.load(meshes / mesh / TRUTH, weights_only=True)


def _by_id(optim: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict as torch.optim's own state_dict() has it: ids in model order."""
    ids = {fqn: i for i, fqn in enumerate(order)}
    groups = [{**g, "params": sorted(ids[p] for p in g["params"])} for g in optim["param_groups"]]
    return {"state": {ids[fqn]: s for fqn, s in optim["state"].items()}, "param_groups": groups}


def test_the_samples_have_the_placements_they_claim(meshes: Path) -> None:
    """FSDP over TP saves ``_StridedShard`` and a dim-1 cut; HSDP saves ``(Replicate(), Shard(0))``."""

    def placements(mesh: str, fqn: str) -> list[str]:
        loaded = load_rank_file(meshes / mesh / "rank_files" / f"model_world_size_{WORLD_SIZE}_rank_1.pt")
        return [kind(p) + str(p.fields.get("dim", "")) for p in loaded[fqn].fields["_spec"].fields["placements"]]

    assert placements("tp", "layers.0.mlp.0.weight") == ["_StridedShard0", "Shard0"]
    assert placements("tp", "output.weight") == ["_StridedShard0", "Shard0"]
    assert placements("tp", "layers.0.mlp.2.weight") == ["Shard0", "Shard1"]
    assert placements("tp", "norm.weight") == ["Shard0"]  # on the dp sub-mesh
    assert placements("hsdp", "output.weight") == ["Replicate", "Shard0"]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("mesh", MESHES)
def test_consolidates_to_the_runs_full_state_dict(meshes: Path, tmp_path: Path, mesh: str, source: str) -> None:
    """Bitwise equal to get_model_state_dict/get_optimizer_state_dict(full_state_dict=True) of the
    run; rank files hold ``optim.state_dict()``, so their optimizer state stays keyed by id."""
    truth = _truth(meshes, mesh)
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(meshes / mesh / source, out, nproc=1, verify_output=True)
    got = torch.load(out, weights_only=True)
    optim = truth["optim"] if source == "checkpoint" else _by_id(truth["optim"], list(truth["model"]))
    assert set(got) == {"model", "optim"}
    assert assert_same_state(got, {"model": truth["model"], "optim": optim}) == 3 * len(truth["model"]) + len(truth["model"])


@pytest.mark.parametrize("mesh", MESHES)
def test_consolidates_to_a_safetensors_folder(meshes: Path, tmp_path: Path, mesh: str) -> None:
    """Small shards and two workers, so tensors cut on two dims are spread over files and workers."""
    truth = _truth(meshes, mesh)
    out = tmp_path / "hf"
    fsdp_convert.consolidate(meshes / mesh / "checkpoint", out, nproc=2, max_shard_bytes=8 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    model: dict[str, torch.Tensor] = {}
    for shard in shards:
        model.update(load_file(out / shard))
    assert sorted(model) == sorted(truth["model"])
    assert_same_state({k: model[k] for k in truth["model"]}, truth["model"])
    assert_same_state(torch.load(out / "optimizer.pt", weights_only=True), truth["optim"])


@pytest.mark.parametrize("mesh", MESHES)
def test_reshard_to_three_ranks_loads_with_fsdp2(meshes: Path, tmp_path: Path, mesh: str) -> None:
    """From the 2-D mesh to a 1-D world of 3: FSDP2 loads model and optimizer from its own files,
    equal bit for bit to the run's full state dicts, and its next step matches one process's."""
    out = tmp_path / "ws3"
    fsdp_convert.reshard(meshes / mesh / "checkpoint", out, world_size=3)
    assert fsdp_convert.verify(meshes / mesh / "checkpoint", out).equal  # 2-D chunks against 1-D ones
    work = tmp_path / "load"
    work.mkdir()
    run_ranks(_load_at_new_world_size, 3, out, meshes / mesh / TRUTH, work)
    losses = json.loads((work / "losses.json").read_text())
    assert losses == pytest.approx(_reference_losses(_truth(meshes, mesh)), rel=1e-6)


@pytest.mark.parametrize("mesh", MESHES)
def test_rank_files_reshard_to_the_runs_state(meshes: Path, tmp_path: Path, mesh: str) -> None:
    """The rank files (``_StridedShard`` read from their placements) reshard to a DCP checkpoint for
    3 ranks, cut as ``torch.chunk(3)`` cuts dim 0, that holds the run's full state (optimizer by id)."""
    out = tmp_path / "ws3"
    fsdp_convert.reshard(meshes / mesh / "rank_files", out, world_size=3, nproc=1)
    info = fsdp_convert.inspect_checkpoint(out)
    assert info.world_size == 3
    assert {e.chunks_per_dim for e in info.entries if e.shape and e.shape[0] >= 3} == {(3,), (3, 1)}
    fsdp_convert.consolidate(out, tmp_path / "full.pt", nproc=1)
    truth = _truth(meshes, mesh)
    want = {"model": truth["model"], "optim": _by_id(truth["optim"], list(truth["model"]))}
    assert_same_state(torch.load(tmp_path / "full.pt", weights_only=True), want)


def _chunk_cells(doc: dict[str, Any]) -> dict[str, tuple[int, list[int] | None]]:
    return {row["fqn"]: (row["chunks"], row["chunks_per_dim"]) for rows in doc["groups"].values() for row in rows}


@pytest.mark.parametrize("source", SOURCES)
def test_inspect_shows_how_tp_cut_each_tensor(
    runner: CliRunner, meshes: Path, source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--json gives chunks per dim; the table writes a cut on several dims, or on one other than 0, out."""
    from fsdp_convert.cli import inspect_cmd

    monkeypatch.setattr(inspect_cmd, "_stdout_is_terminal", lambda: True)  # the table as an 80-column terminal shows it
    ckpt = meshes / "tp" / source
    result = runner.invoke(app, ["inspect", str(ckpt), "--json"])
    assert result.exit_code == 0, result.stderr
    cells = _chunk_cells(json.loads(result.stdout))
    assert cells["model.layers.0.mlp.2.weight"] == (4, [2, 2])  # FSDP on dim 0, TP's Rowwise on dim 1
    assert cells["model.layers.0.mlp.0.weight"] == (4, [4, 1])  # TP's Colwise, then FSDP, both on dim 0
    assert cells["model.output.weight"] == (4, [4, 1])  # uneven: 26, 25, 25, 25 rows
    assert cells["model.layers.0.mlp.2.bias"] == (2, [2])  # replicated over tp: stored once
    # exp_avg and exp_avg_sq of both blocks' mlp.2.weight (by FQN in DCP, by parameter id in rank files)
    assert sum(cell == (4, [2, 2]) for fqn, cell in cells.items() if fqn.startswith("optim.state.")) == 4
    table = runner.invoke(app, ["inspect", str(ckpt)], env={"COLUMNS": "80"})
    assert table.exit_code == 0, table.stderr
    lines = table.stdout.splitlines()
    assert all(cell_len(line) <= 80 for line in lines[2:]), "\n".join(lines)
    cuts = " ".join(line.strip() for line in lines[2 : next(i for i, line in enumerate(lines) if line.startswith("model:"))])
    assert cuts.startswith("cuts: ") and "6 tensors 2 x 2 (dim 0, dim 1)" in cuts and "15 tensors 4 (dim 0)" in cuts, cuts
    wide = runner.invoke(app, ["inspect", str(ckpt)], env={"COLUMNS": "160"}).stdout.splitlines()  # FQNs whole
    rows = {line.split("│")[1].strip(): line.split("│")[4].strip() for line in wide if line.startswith("│")}
    assert rows["model.layers.0.mlp.2.weight"] == "2 x 2 (dim 0, dim 1)"
    assert rows["model.layers.0.mlp.0.weight"] == "4" and rows["model.output.weight"] == "4"


def test_inspect_json_of_a_tp_checkpoint_matches_golden(runner: CliRunner, meshes: Path) -> None:
    ckpt = meshes / "tp" / "checkpoint"
    result = runner.invoke(app, ["inspect", str(ckpt), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["checkpoint"] == str(ckpt)
    doc["checkpoint"] = "<checkpoint>"
    if os.environ.get("FSDP_CONVERT_UPDATE_GOLDEN") == "1":  # regenerate deliberately, then review the diff
        GOLDEN.write_text(json.dumps(doc, indent=2) + "\n")
    assert doc == json.loads(GOLDEN.read_text())
    assert doc["world_size"] == 4 and doc["producer"] == "fsdp2"


def test_hsdp_replicas_are_stored_once(meshes: Path) -> None:
    """DCP keeps one copy of each replicated shard: 2 chunks per sharded tensor from 4 ranks."""
    info = fsdp_convert.inspect_checkpoint(meshes / "hsdp" / "checkpoint")
    assert info.world_size == 4
    rows = {e.fqn: e for e in info.entries}
    assert rows["model.output.weight"].chunks == 2 and rows["model.output.weight"].chunks_per_dim == (2, 1)


def test_an_interleaved_strided_shard_is_refused(runner: CliRunner, meshes: Path, tmp_path: Path) -> None:
    """``(_StridedShard(0, sf=2), Replicate())``: mesh row 0 holds rows 0, 1, 4, 5, not one box.
    The rank files are refused, naming the file and FQN (``dcp.save`` refuses to save it at all)."""
    result = runner.invoke(app, ["consolidate", str(meshes / "interleaved" / "rank_files"), str(tmp_path / "x.pt")])
    assert result.exit_code == 3, result.stderr
    assert "model_world_size_4_rank_0.pt w: placements (_StridedShard(0, sf=2), Replicate()) on mesh [2, 2]" in result.stderr
    assert "not one box" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.pt").exists()
