"""--adapter on torchtitan's own Qwen3 MoE: to Hugging Face and back, bit for bit as torchtitan's own adapter.

The checkpoint is tests._qwen3_moe's run (torchtitan 0.3.0's Qwen3 model code at a tiny size: 2
MoE layers of 4 experts, stacked ``(E, F, D)`` / ``(E, D, F)`` expert weights; FSDP2 on 2 CPU
ranks, 2 AdamW steps, ``dcp.save`` of ``get_model_state_dict``), so each rank's chunk of an expert
weight holds 2 experts. ``consolidate --adapter torchtitan-qwen3-to-hf`` must be exactly what
torchtitan's ``Qwen3StateDictAdapter.to_hf`` makes of the run's model, ``reshard --adapter
hf-to-torchtitan-qwen3`` of that folder exactly its ``from_hf`` (the run's model again); the
expert split is a byte-range copy (never built block by block), and its memory stays within the
budget when an expert weight is larger than it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from typer.testing import CliRunner

import fsdp_convert.move
from fsdp_convert.cli.app import app
from tests._dist import run_ranks
from tests._frameworks import preload
from tests._qwen3_moe import qw_hf_config, qw_model_config, qw_run
from tests.integration.test_memory import HOOK, SLACK

MiB = 2**20


@pytest.fixture(scope="module")
def qw_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 MoE run: ``checkpoint/`` (DCP, 2 ranks), ``truth.pt`` and ``config.json`` (HF's)."""
    preload("torchtitan")
    out = tmp_path_factory.mktemp("qwen3_moe")
    run_ranks(qw_run, 2, out)
    (out / "config.json").write_text(json.dumps(qw_hf_config()))
    return out


def test_torchtitan_qwen3_moe_to_hf_and_back(qw_checkpoint: Path, tmp_path: Path, runner: CliRunner) -> None:
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    truth = torch.load(qw_checkpoint / "truth.pt", weights_only=True)
    assert any(k.endswith("inner_experts.w1_EFD") for k in truth)
    config = str(qw_checkpoint / "config.json")
    hf = tmp_path / "hf"
    to_hf = ["--adapter", "torchtitan-qwen3-to-hf", "--model-config", config, "--nproc", "2"]
    result = runner.invoke(app, ["consolidate", str(qw_checkpoint / "checkpoint"), str(hf), *to_hf])
    assert result.exit_code == 0, result.output

    titan_adapter = Qwen3StateDictAdapter(qw_model_config(), None)
    want = titan_adapter.to_hf(dict(truth))
    got = load_file(hf / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key

    titan = tmp_path / "titan"
    back = ["--adapter", "hf-to-torchtitan-qwen3", "--model-config", config]
    result = runner.invoke(app, ["reshard", str(hf), str(titan), "--world-size", "2", *back])
    assert result.exit_code == 0, result.output
    expected = titan_adapter.from_hf(dict(got))
    loaded = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=titan, no_dist=True)
    assert sorted(dcp.FileSystemReader(titan).read_metadata().state_dict_metadata) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor) and torch.equal(tensor, truth[key]), key


def test_expert_split_and_stack_are_byte_range_copies(
    qw_checkpoint: Path, tmp_path: Path, runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No expert weight is built block by block (``blocks.move_derived``): split and stacked as byte ranges."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an expert weight was built block by block, not copied")

    monkeypatch.setattr(fsdp_convert.move, "move_derived", refuse)
    config = str(qw_checkpoint / "config.json")
    hf = tmp_path / "hf"
    to_hf = ["--adapter", "torchtitan-qwen3-to-hf", "--model-config", config, "--nproc", "1"]
    result = runner.invoke(app, ["consolidate", str(qw_checkpoint / "checkpoint"), str(hf), *to_hf])
    assert result.exit_code == 0, result.output
    titan = tmp_path / "titan"
    back = ["--adapter", "hf-to-torchtitan-qwen3", "--model-config", config, "--nproc", "1"]
    result = runner.invoke(app, ["reshard", str(hf), str(titan), "--world-size", "2", *back])
    assert result.exit_code == 0, result.output
    truth = torch.load(qw_checkpoint / "truth.pt", weights_only=True)
    stacked = [k for k in truth if "inner_experts" in k]
    loaded = {k: torch.empty_like(truth[k]) for k in stacked}
    dcp.load(loaded, checkpoint_id=titan, no_dist=True)
    for key in stacked:
        assert torch.equal(loaded[key], truth[key]), key


BUDGET = 1 * MiB
EXPERTS, FFN, DIM = 8, 1024, 1024  # one stacked expert weight: 32 MiB of fp32, over budget + slack
PROBE = """
import sys, fsdp_convert, sitecustomize
from fsdp_convert.adapters import load_adapter
from fsdp_convert.transform import TransformOptions
options = TransformOptions(adapter=load_adapter("torchtitan-qwen3-to-hf", {"tie_word_embeddings": False}))
fsdp_convert.consolidate(sys.argv[1], sys.argv[2], nproc=1, memory_budget_bytes=int(sys.argv[3]), options=options)
sitecustomize.record("parent")
"""


@pytest.mark.slow
def test_expert_split_memory_is_bounded_by_budget(tmp_path: Path) -> None:
    """An expert weight larger than budget + slack, split per expert: no process holds it, nor an expert's rows whole."""
    weights = {
        "layers.0.moe.routed_experts.inner_experts.w1_EFD": torch.randn(EXPERTS, FFN, DIM),
        "norm.weight": torch.randn(DIM),
    }
    ck = tmp_path / "checkpoint"
    dcp.save(weights, checkpoint_id=ck, no_dist=True)
    largest = max(t.numel() * t.element_size() for t in weights.values())
    assert largest > BUDGET + SLACK, "the expert weight must not fit in the bound, or the test proves nothing"

    hooks, log, out = tmp_path / "hooks", tmp_path / "memory", tmp_path / "hf"
    hooks.mkdir()
    log.mkdir()
    (hooks / "sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "MEMORY_TEST_LOG": str(log)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(ck), str(out), str(BUDGET)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(p.read_text()) for p in log.iterdir()]
    assert sorted(r["role"] for r in records) == ["parent", "rank0"], records
    for r in records:
        growth = r["peak"] - r["base"]
        assert growth <= BUDGET + SLACK, f"{r['role']} grew {growth / MiB:.1f} MiB, over budget + slack"
    got = load_file(out / "model.safetensors")
    w1 = weights["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
    assert sorted(got) == sorted(
        [f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(EXPERTS)] + ["model.norm.weight"]
    )
    for e in range(EXPERTS):
        assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"], w1[e])
