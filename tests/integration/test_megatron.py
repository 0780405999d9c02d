"""Megatron-Core 0.16.1 ``torch_dist`` checkpoints: named, consolidated bit for bit, resharded for its own loader.

One run (``tests/_megatron.py``: a Llama-style ``GPTModel`` at tensor parallel 2 on 2 gloo ranks,
``FP32Optimizer``'s sharded state, ``dist_checkpointing.save(..., ("torch_dist", 1))``) feeds every
test; the reshard is read back by ``dist_checkpointing.load`` at 3 ranks (TP=1), one more launch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli.app import app
from tests import _megatron
from tests._compare import assert_same_state
from tests._dist import run_ranks

TARGET = 3


def _truth(run: Path) -> dict[str, Any]:
    return torch.load(run / _megatron.TRUTH, weights_only=True)  # type: ignore[no-any-return]


def test_megatron_inspect_names_it_and_consolidate_is_the_runs_state(megatron_run: Path, tmp_path: Path) -> None:
    """``inspect`` says ``megatron-core``; ``consolidate`` gives the run's full tensors bit for bit in
    Megatron's keys (layers stacked), the optimizer state under ``optimizer.state`` by model key,
    and ``common.pt``'s ``param_groups`` and step merged into ``optimizer``, its ``iteration`` at the top."""
    ckpt = megatron_run / _megatron.CHECKPOINT
    truth = _truth(megatron_run)
    info = fsdp_convert.inspect_checkpoint(ckpt)
    assert (info.producer, info.world_size) == ("megatron-core", 2)
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(ckpt, out, nproc=1, verify_output=True)
    got = torch.load(out, weights_only=True)
    extra = [k for k in got if "._extra_state/shard_" in k]  # its layers' ShardedObjects, as saved
    assert list(got) == ["model", "optimizer", *extra, "iteration"] and len(extra) == 8
    assert all(got[k] == [None] for k in extra)
    assert got["iteration"] == _megatron.STEPS
    layers = got["model"]["decoder.layers.self_attention.linear_qkv.weight"]
    assert layers.shape[0] == 2  # stacked: (num_layers, rows, hidden)
    assert assert_same_state(got["model"], truth["model"]) == len(truth["model"])
    state = dict(got["optimizer"]["state"])
    step = state.pop("common_step")  # a 0-dim tensor in common.pt, written as that tensor
    assert type(step) is torch.Tensor and truth["step"].shape == ()
    assert assert_same_state(step, truth["step"]) == 1  # dtype, shape and bits
    assert assert_same_state(state, truth["optimizer_state"]) == 2 * len(truth["model"])
    assert_same_state(got["optimizer"]["param_groups"], truth["param_groups"])


def test_megatron_reshard_loads_with_dist_checkpointing_at_three_ranks(
    runner: CliRunner, megatron_run: Path, tmp_path: Path
) -> None:
    """``reshard --world-size 3`` copies ``common.pt`` and ``metadata.json`` byte for byte, and
    Megatron's own ``dist_checkpointing.load`` at 3 ranks (TP=1) reads OUT into a fresh model and
    ``FP32Optimizer``: the run's weights, moments, param groups and step, bit for bit."""
    src = tmp_path / "src"
    shutil.copytree(megatron_run / _megatron.CHECKPOINT, src)
    out = tmp_path / "ws3"
    result = runner.invoke(app, ["reshard", str(src), str(out), "--world-size", str(TARGET), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["copied"] == ["common.pt", "metadata.json"]
    assert doc["left_out"] == []
    for name in ("common.pt", "metadata.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert fsdp_convert.inspect_checkpoint(out).world_size == TARGET
    _megatron.preload()
    run_ranks(_megatron.megatron_load, TARGET, out, megatron_run / _megatron.TRUTH, timeout=300)


def test_megatron_gpt_to_hf_is_megatrons_own_split_per_layer(runner: CliRunner, megatron_run: Path, tmp_path: Path) -> None:
    """``--adapter megatron-gpt-to-hf`` writes, bit for bit, what Megatron's own modules hold after
    ``dist_checkpointing.load`` at TP=1, under Megatron-Bridge's Llama names: layers unstacked,
    q/k/v as Megatron's forward splits ``linear_qkv``, gate/up as its SwiGLU halves ``linear_fc1``;
    transformers' ``LlamaForCausalLM`` loads the folder with no key missing or left over."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(_megatron.hf_config()))
    hf = tmp_path / "hf"
    ckpt = megatron_run / _megatron.CHECKPOINT
    args = ["consolidate", str(ckpt), str(hf), "--adapter", "megatron-gpt-to-hf", "--hf-assets", str(assets)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
    got = load_file(hf / "model.safetensors")
    _megatron.preload()
    run_ranks(_megatron.megatron_hf_reference, 1, ckpt, tmp_path / "ref.pt", timeout=300)
    want = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert sorted(got) == sorted(want) and len(want) == 3 + 9 * 2
    assert assert_same_state({k: got[k] for k in want}, want) == len(want)
    model = LlamaForCausalLM(LlamaConfig(**_megatron.hf_config()))
    missing, unexpected = model.load_state_dict(got, strict=False)
    assert (missing, unexpected) == ([], [])


def test_megatron_dp_reshardable_buckets_are_refused_in_one_line(runner: CliRunner, megatron_run: Path, tmp_path: Path) -> None:
    """The distributed optimizer's ``dp_reshardable`` state (whole flattened gradient buckets per DP
    rank) cannot be put per parameter: ``consolidate`` refuses it in one line naming the key and
    ``fully_reshardable``, before writing; ``--only model`` still converts the weights."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dp_reshardable"
    bucket = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.exp_avg"
    weight = torch.arange(8.0).reshape(2, 4)
    dcp.save({"embedding.word_embeddings.weight": weight, bucket: torch.zeros(16)}, checkpoint_id=src, no_dist=True)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(megatron_run / _megatron.CHECKPOINT / name, src / name)
    assert fsdp_convert.inspect_checkpoint(src).producer == "megatron-core"
    out = tmp_path / "full.pt"
    result = runner.invoke(app, ["consolidate", str(src), str(out)])
    assert result.exit_code == 1 and not out.exists()
    assert result.stderr.startswith(f"error: {bucket}: Megatron's distributed optimizer saved as dp_reshardable")
    assert "fully_reshardable" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    result = runner.invoke(app, ["consolidate", str(src), str(out), "--only", "model"])
    assert result.exit_code == 0, result.stderr
    assert_same_state(torch.load(out, weights_only=True), {"model": {"embedding.word_embeddings.weight": weight}})
