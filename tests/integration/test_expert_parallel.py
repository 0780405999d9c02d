"""Expert-parallel sources: a torchtitan MoE trained with its experts sharded across ranks converts bit for bit.

The checkpoints are tests._ep's launch (torchtitan 0.3.0's own Trainer on 4 CPU ranks, its Qwen3
MoE with ``expert_parallel_degree=2``, FSDP2 on the other ranks of the sparse mesh, its
CheckpointManager's save): ``experts4``, each rank holding one whole expert, not in rank order
(FSDP cuts each EP rank's experts again on dim 0), and ``experts2``, each rank holding half an
expert (FSDP on dim 1). Each must consolidate to the run's full model and optimizer state,
consolidate through ``torchtitan-qwen3-to-hf`` to what torchtitan's own ``to_hf`` makes of the
run's model, and reshard to 2 ranks into what torchtitan's CheckpointManager loads, at EP 2 again,
as the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli.app import app
from tests._compare import assert_same_state
from tests._dist import run_ranks
from tests._ep import EP_CKPT, EP_DEGREE, EP_RUNS, EP_TRUTH, EP_WORLD_SIZE, ep_hf_config, ep_load, ep_model_config, ep_run
from tests._frameworks import preload
from tests._qwen3_moe import QW_MOE_DIM

EXPERT_WEIGHTS = [f"layers.{i}.moe.routed_experts.inner_experts.{w}" for i in range(2) for w in ("w1_EFD", "w2_EDF", "w3_EFD")]
PLACEMENTS = {"experts4": ["_S(0, 2)", "S(0)"], "experts2": ["S(1)", "S(0)"]}
"""The expert weights' placements on torchtitan's sparse mesh ``(efsdp, ep)`` in each run."""


@pytest.fixture(scope="session")
def ep_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests._ep's one launch: ``<run>/checkpoint/step-2`` and ``<run>/truth.pt`` for each of ``EP_RUNS``."""
    preload("torchtitan")
    out = tmp_path_factory.mktemp("expert_parallel")
    run_ranks(ep_run, EP_WORLD_SIZE, out, timeout=300)
    return out


def _truth(ep_runs: Path, name: str) -> dict[str, Any]:
    """The run's truth, its optimizer state as torchtitan saves it: without each group's
    ``param_names`` (its flattening drops them; ``params`` names the same FQNs)."""
    truth = torch.load(ep_runs / name / EP_TRUTH, weights_only=True)
    for group in truth["optim"]["param_groups"]:
        assert group.pop("param_names") == group["params"]
    return truth


def _expert_boxes(checkpoint: Path, fqn: str) -> dict[int, tuple[int, ...]]:
    """Which rank wrote which box of ``fqn``: rank to the box's offsets (from ``.metadata``'s storage data)."""
    md = FileSystemReader(str(checkpoint)).read_metadata()
    return {
        int(info.relative_path.split("_")[2]): tuple(index.offset) for index, info in md.storage_data.items() if index.fqn == fqn
    }


@pytest.mark.parametrize("name", sorted(EP_RUNS))
def test_expert_parallel_checkpoint_consolidates_to_the_runs_full_state(ep_runs: Path, tmp_path: Path, name: str) -> None:
    """The experts were cut by EP (rank ``2 f + e``, at ``efsdp`` f and ``ep`` e, holds expert
    ``e``'s part, FSDP's part f of it), and the consolidated model and optimizer state are the run's, bit for bit."""
    truth = _truth(ep_runs, name)
    num_experts, per_rank = EP_RUNS[name], EP_RUNS[name] // EP_DEGREE
    for fqn in EXPERT_WEIGHTS:
        assert truth["placements"][fqn] == (("efsdp", "ep"), PLACEMENTS[name]), fqn
    ckpt = ep_runs / name / EP_CKPT
    boxes = _expert_boxes(ckpt, EXPERT_WEIGHTS[0])
    if num_experts == 4:  # FSDP cuts each EP rank's 2 experts again on dim 0
        want = {2 * f + e: (per_rank * e + f, 0, 0) for f in range(2) for e in range(2)}
    else:  # one expert per EP rank: FSDP cuts its rows (dim 1)
        want = {2 * f + e: (e, f * QW_MOE_DIM // 2, 0) for f in range(2) for e in range(2)}
    assert boxes == want

    info = fsdp_convert.inspect_checkpoint(ckpt)
    assert (info.producer, info.world_size) == ("torchtitan", EP_WORLD_SIZE)
    grid = {e.fqn: e.chunks_per_dim for e in info.entries}
    assert grid[EXPERT_WEIGHTS[0]] == ((4, 1, 1) if num_experts == 4 else (2, 2, 1))
    shown = CliRunner().invoke(app, ["inspect", str(ckpt), "--wide"])  # the table shows the expert cut
    cut = "4 (dim 0: 1 of 4 experts each)" if num_experts == 4 else "2 x 2 (dim 0: 1 of 2 experts each, dim 1)"
    assert shown.exit_code == 0 and cut in shown.output, shown.output

    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(ckpt, out, nproc=1, verify_output=True)
    got = torch.load(out, weights_only=True)
    assert set(got) == {"model", "optimizer", "lr_scheduler", "train_state", "dataloader"}
    assert got["train_state"]["step"] == 2 and got["dataloader"] == {"batches": 2}
    want_state = {"model": truth["model"], "optimizer": truth["optim"]}
    n = assert_same_state({k: got[k] for k in want_state}, want_state)
    assert n == len(truth["model"]) + 3 * len(truth["optim"]["state"])


@pytest.mark.parametrize("name", sorted(EP_RUNS))
def test_expert_parallel_to_hf_is_torchtitans_to_hf(ep_runs: Path, tmp_path: Path, runner: CliRunner, name: str) -> None:
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    truth = _truth(ep_runs, name)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(ep_hf_config(EP_RUNS[name])))
    hf = tmp_path / "hf"
    to_hf = ["--adapter", "torchtitan-qwen3-to-hf", "--model-config", str(config), "--nproc", "1"]
    result = runner.invoke(app, ["consolidate", str(ep_runs / name / EP_CKPT), str(hf), *to_hf])
    assert result.exit_code == 0, result.output

    want = Qwen3StateDictAdapter(ep_model_config(EP_RUNS[name]), None).to_hf(dict(truth["model"]))
    assert sum(".mlp.experts." in k for k in want) == 2 * 3 * EP_RUNS[name]
    got = load_file(hf / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def test_expert_parallel_reshard_loads_in_torchtitan_at_two_ranks(ep_runs: Path, tmp_path: Path) -> None:
    """``reshard --world-size 2`` of each run is what torchtitan's CheckpointManager loads at 2 ranks,
    EP 2 (the experts cut by EP alone now): the run's model and optimizer state, bit for bit."""
    sources = {}
    for name in EP_RUNS:
        out = tmp_path / name / EP_CKPT
        out.parent.mkdir(parents=True)  # OUT's folder must exist, as for cp
        fsdp_convert.reshard(ep_runs / name / EP_CKPT, out, world_size=2)
        assert sorted(p.name for p in out.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        sources[name] = tmp_path / name
    run_ranks(ep_load, 2, sources, ep_runs, timeout=300)
