"""--adapter on torchtitan's own gpt-oss: to Hugging Face names and back, bit for bit as torchtitan's own adapter.

The checkpoint is tests._gpt_oss's (torchtitan 0.3.0's gpt-oss model code at a tiny size: 2
layers of biased Q/K/V/O with sinks and a 4-expert MoE with biases; FSDP2 on 2 CPU ranks, 2 AdamW
steps on synthetic gradients (no CPU backward for its attention), ``dcp.save`` of the model state
dict with the optimizer's beside it); its truth is the full model and optimizer state, gathered.
``consolidate --adapter torchtitan-gpt-oss-to-hf`` must be exactly what torchtitan's
``GptOssStateDictAdapter.to_hf`` makes of it, the experts included (torchtitan's map spells them
without the model's ``_EGD``-style suffixes, so its ``to_hf`` of the model's own names drops them);
``reshard --adapter hf-to-torchtitan-gpt-oss`` of that folder exactly its ``from_hf``, so the run's
model again. transformers' ``GptOssForCausalLM`` loads every weight but the expert matrices from
that folder: torchtitan writes those in the MXFP4 checkpoint's ``(out, in)`` layout under its
``*_blocks`` names, transformers wants ``(in, out)`` ``gate_up_proj``. ``--adapter
torchtitan-gpt-oss-to-transformers`` writes them so, each expert transposed: transformers loads
that folder as written, with no missing key, and its logits are torchtitan's forward's within
float32 rounding; ``transformers-to-torchtitan-gpt-oss`` takes it (and transformers' own
``save_pretrained`` of it) back to the run's model bit for bit, and the transpose streams an expert
at a time within the memory budget.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.adapters.gpt_oss import from_hf, from_transformers, to_hf, to_transformers
from fsdp_convert.cli.app import app
from fsdp_convert.derive import TensorInfo
from fsdp_convert.errors import UnsupportedTransformError
from tests._compare import assert_same_state
from tests._dist import run_ranks
from tests._frameworks import preload
from tests._gpt_oss import (
    GO_DIM,
    GO_EXPERTS,
    GO_HEAD_DIM,
    GO_HEADS,
    GO_HIDDEN,
    GO_KV_HEADS,
    GO_LAYERS,
    GO_VOCAB,
    GO_WINDOW,
    GO_YARN,
    go_build,
    go_model_config,
    go_run,
)
from tests.integration.test_memory import HOOK, SLACK

_SUFFIXES = {
    "mlp1_weight_EGD": "mlp1_weight",
    "mlp1_bias_EG": "mlp1_bias",
    "mlp2_weight_EDF": "mlp2_weight",
    "mlp2_bias_ED": "mlp2_bias",
}


@pytest.fixture(scope="module")
def go_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny gpt-oss: ``checkpoint/`` (DCP, 2 ranks) and ``truth.pt``."""
    preload("torchtitan")
    out = tmp_path_factory.mktemp("gpt_oss")
    run_ranks(go_run, 2, out)
    return out


def _hf_config() -> dict[str, Any]:
    """``GptOssConfig`` of the run's model (tests._gpt_oss.go_model_config)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": GO_VOCAB,
        "hidden_size": GO_DIM,
        "intermediate_size": GO_HIDDEN,
        "num_hidden_layers": GO_LAYERS,
        "num_attention_heads": GO_HEADS,
        "num_key_value_heads": GO_KV_HEADS,
        "head_dim": GO_HEAD_DIM,
        "num_local_experts": GO_EXPERTS,
        "num_experts_per_tok": 2,
        "sliding_window": GO_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 131072,  # gpt-oss-20b's: YaRN's 32 x 4096
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, **GO_YARN},
        "rms_norm_eps": 1e-5,  # torchtitan's RMSNorm default
        "swiglu_alpha": 1.702,  # torchtitan's swiglu default
        "swiglu_limit": 7.0,  # torchtitan's GptOssGroupedExperts default
        "attention_bias": True,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _titan_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state dict with its experts under the names torchtitan's adapter map spells."""
    out = {}
    for key, tensor in state.items():
        head, _, last = key.rpartition(".")
        out[f"{head}.{_SUFFIXES.get(last, last)}"] = tensor
    return out


def test_torchtitan_gpt_oss_to_hf_and_back(
    go_checkpoint: Path, tmp_path: Path, runner: CliRunner, caplog: pytest.LogCaptureFixture
) -> None:
    from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
    from transformers import GptOssForCausalLM

    truth = torch.load(go_checkpoint / "truth.pt", weights_only=True)["model"]
    assert any(k.endswith("mlp1_weight_EGD") for k in truth) and any(k.endswith("attention.sinks") for k in truth)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_hf_config()))
    hf = tmp_path / "hf"
    adapter = ["--adapter", "torchtitan-gpt-oss-to-hf", "--nproc", "2"]
    with caplog.at_level(logging.WARNING):
        result = runner.invoke(app, ["consolidate", str(go_checkpoint / "checkpoint"), str(hf), *adapter])
    assert result.exit_code == 0, result.output
    assert "layers.1.moe.expert_bias_E" in caplog.text  # the one buffer with no HF name, left out aloud

    # bit for bit what torchtitan's own adapter makes of the run's model, the experts under its map's names
    titan_adapter = GptOssStateDictAdapter(go_model_config(), None)
    want = titan_adapter.to_hf(_titan_names(truth))
    assert len(titan_adapter.to_hf(dict(truth))) == len(want) - 4 * GO_LAYERS  # its map misses the model's expert names
    got = load_file(hf / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key

    # transformers' GptOss takes every weight but the (in, out) expert matrices, which torchtitan writes as *_blocks
    (hf / "config.json").write_text(config.read_text())
    model, info = GptOssForCausalLM.from_pretrained(hf, dtype=torch.float32, output_loading_info=True)
    layers = range(GO_LAYERS)
    assert sorted(info["missing_keys"]) == sorted(
        f"model.layers.{n}.mlp.experts.{w}" for n in layers for w in ("down_proj", "gate_up_proj")
    )
    assert sorted(info["unexpected_keys"]) == sorted(f"{k}_blocks" for k in info["missing_keys"])
    for key, tensor in model.state_dict().items():
        if key not in info["missing_keys"]:
            assert torch.equal(tensor, got[key]), key

    # back to torchtitan at 2 ranks: exactly torchtitan's from_hf of that folder under the model's names, the run's model
    titan = tmp_path / "titan"
    result = runner.invoke(app, ["reshard", str(hf), str(titan), "--world-size", "2", "--adapter", "hf-to-torchtitan-gpt-oss"])
    assert result.exit_code == 0, result.output
    expected = {k: v for k, v in truth.items() if not k.endswith("expert_bias_E")}
    assert _titan_names(expected).keys() == titan_adapter.from_hf(dict(got)).keys()
    loaded = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=titan, no_dist=True)
    assert sorted(dcp.FileSystemReader(titan).read_metadata().state_dict_metadata) == sorted(expected)
    titan_from_hf = titan_adapter.from_hf(dict(got))
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor) and torch.equal(
            titan_from_hf[_titan_names({key: tensor}).popitem()[0]], tensor
        ), key


def test_torchtitan_gpt_oss_to_transformers_and_back(go_checkpoint: Path, tmp_path: Path, runner: CliRunner) -> None:
    """``consolidate --adapter torchtitan-gpt-oss-to-transformers`` at 2 ranks: ``to_hf``'s folder with the
    experts transposed, loaded by ``GptOssForCausalLM`` as written; ``reshard --adapter
    transformers-to-torchtitan-gpt-oss`` of it, and of transformers' own ``save_pretrained`` of the
    loaded model, gives the run's model bit for bit."""
    from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
    from transformers import GptOssForCausalLM

    truth = torch.load(go_checkpoint / "truth.pt", weights_only=True)["model"]
    hf = tmp_path / "hf"
    adapter = ["--adapter", "torchtitan-gpt-oss-to-transformers", "--nproc", "2"]
    result = runner.invoke(app, ["consolidate", str(go_checkpoint / "checkpoint"), str(hf), *adapter])
    assert result.exit_code == 0, result.output

    # torchtitan's own to_hf, the two expert weights renamed and transposed expert by expert
    want = GptOssStateDictAdapter(go_model_config(), None).to_hf(_titan_names(truth))
    for key in [k for k in want if k.endswith("_blocks")]:
        want[key.removesuffix("_blocks")] = want.pop(key).transpose(1, 2)
    got = load_file(hf / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    expert = truth["layers.1.moe.routed_experts.inner_experts.mlp1_weight_EGD"]
    assert torch.equal(got["model.layers.1.mlp.experts.gate_up_proj"][2], expert[2].T)  # (D, 2F): gate/up still interleaved

    (hf / "config.json").write_text(json.dumps(_hf_config()))
    model, info = GptOssForCausalLM.from_pretrained(hf, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    assert sorted(model.state_dict()) == sorted(got)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, got[key]), key
    saved = tmp_path / "saved"
    model.save_pretrained(saved)

    expected = {k: v for k, v in truth.items() if not k.endswith("expert_bias_E")}
    for source in (hf, saved):
        titan = tmp_path / f"titan-{source.name}"
        args = ["reshard", str(source), str(titan), "--world-size", "2", "--adapter", "transformers-to-torchtitan-gpt-oss"]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert sorted(dcp.FileSystemReader(titan).read_metadata().state_dict_metadata) == sorted(expected)
        loaded = {k: torch.empty_like(v) for k, v in expected.items()}
        dcp.load(loaded, checkpoint_id=titan, no_dist=True)
        for key, tensor in expected.items():
            assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), (source.name, key)


MiB = 2**20
BUDGET = 1 * MiB
EXPERTS, ROWS, COLS = 32, 512, 512  # one stacked expert weight: 32 MiB of fp32, over budget + slack; one expert 1 MiB
PROBE = """
import sys, fsdp_convert, sitecustomize
from fsdp_convert.adapters import load_adapter
from fsdp_convert.transform import TransformOptions
options = TransformOptions(adapter=load_adapter("torchtitan-gpt-oss-to-transformers"))
fsdp_convert.consolidate(sys.argv[1], sys.argv[2], nproc=1, memory_budget_bytes=int(sys.argv[3]), options=options)
sitecustomize.record("parent")
"""


@pytest.mark.slow
def test_expert_transpose_memory_is_bounded_by_budget(tmp_path: Path) -> None:
    """A stacked expert weight larger than budget + slack, transposed expert by expert: no process holds it whole."""
    key = "layers.0.moe.routed_experts.inner_experts.mlp1_weight_EGD"
    weights = {key: torch.randn(EXPERTS, ROWS, COLS), "norm.weight": torch.randn(COLS)}
    ck = tmp_path / "checkpoint"
    dcp.save(weights, checkpoint_id=ck, no_dist=True)
    assert weights[key].numel() * weights[key].element_size() > BUDGET + SLACK, (
        "the weight must not fit, or the test proves nothing"
    )

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
        print(f"gpt-oss expert transpose: {r['role']} grew {growth / MiB:.1f} MiB")
        assert growth <= BUDGET + SLACK, f"{r['role']} grew {growth / MiB:.1f} MiB, over budget + slack"
    got = load_file(out / "model.safetensors")
    assert sorted(got) == ["model.layers.0.mlp.experts.gate_up_proj", "model.norm.weight"]
    assert torch.equal(got["model.layers.0.mlp.experts.gate_up_proj"], weights[key].transpose(1, 2))


def test_gpt_oss_adapters_refuse_unknown_keys() -> None:
    def info(fqn: str) -> TensorInfo:
        return TensorInfo(fqn=fqn, shape=(4,), dtype=torch.float32)

    with pytest.raises(UnsupportedTransformError, match="layers.0.moe.tokens_per_expert_E"):
        to_hf([info("layers.0.moe.tokens_per_expert_E")], {})
    with pytest.raises(UnsupportedTransformError, match="gate_up_proj_scales: .*MXFP4"):
        from_hf([info("model.layers.0.mlp.experts.gate_up_proj_scales")], {})
    with pytest.raises(UnsupportedTransformError, match="experts.down_proj: .*transformers-to-torchtitan-gpt-oss"):
        from_hf([info("model.layers.0.mlp.experts.down_proj")], {})
    with pytest.raises(UnsupportedTransformError, match="layers.0.moe.tokens_per_expert_E: .*-to-transformers"):
        to_transformers([info("layers.0.moe.tokens_per_expert_E")], {})
    mxfp4 = TensorInfo(fqn="model.layers.0.mlp.experts.down_proj_blocks", shape=(4, 16, 1, 16), dtype=torch.uint8)
    with pytest.raises(UnsupportedTransformError, match="down_proj_blocks: .*MXFP4"):
        from_transformers([mxfp4], {})
    with pytest.raises(UnsupportedTransformError, match="experts.gate_up_proj: expected a stacked"):
        from_transformers([TensorInfo(fqn="model.layers.0.mlp.experts.gate_up_proj", shape=(4, 16), dtype=torch.float32)], {})


def test_gpt_oss_to_transformers_transposes_each_expert_block_by_block() -> None:
    """The transformers map: only the two expert weights change, each expert transposed, from the same experts' rows."""
    stacked = TensorInfo(fqn="layers.1.moe.routed_experts.inner_experts.mlp1_weight_EGD", shape=(4, 6, 3), dtype=torch.bfloat16)
    bias = TensorInfo(fqn="layers.1.moe.routed_experts.inner_experts.mlp1_bias_EG", shape=(4, 6), dtype=torch.bfloat16)
    got = to_transformers([stacked, bias], {})
    assert sorted(got) == ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.gate_up_proj_bias"]
    weight = got["model.layers.1.mlp.experts.gate_up_proj"]
    assert weight.shape == (4, 3, 6) and weight.dtype == torch.bfloat16
    assert list(weight.inputs[0].rows(1, 3)) == [1, 2]  # an output block of experts reads those experts' rows only
    assert got["model.layers.1.mlp.experts.gate_up_proj_bias"].is_copy
    w = torch.randn(4, 6, 3).bfloat16()
    assert torch.equal(weight.compute([w]), w.transpose(1, 2))
    back = from_transformers(
        [TensorInfo(fqn="model.layers.1.mlp.experts.gate_up_proj", shape=(4, 3, 6), dtype=torch.bfloat16)], {}
    )
    derived = back["layers.1.moe.routed_experts.inner_experts.mlp1_weight_EGD"]
    assert derived.shape == (4, 6, 3) and torch.equal(derived.compute([w.transpose(1, 2)]), w)


def test_gpt_oss_to_hf_reads_the_expert_names_torchtitans_map_spells() -> None:
    """Checkpoints of torchtitan's gpt-oss before the ``_EGD``-style suffixes: the names its adapter's map still spells."""
    titan = [
        TensorInfo(fqn=f"layers.3.moe.routed_experts.inner_experts.{name}", shape=(4,), dtype=torch.float32)
        for name in _SUFFIXES.values()
    ]
    got = to_hf(titan, {})
    assert sorted(got) == sorted(
        f"model.layers.3.mlp.experts.{w}"
        for w in ("gate_up_proj_blocks", "gate_up_proj_bias", "down_proj_blocks", "down_proj_bias")
    )
    assert all(got[k].inputs[0].fqn == t.fqn for k, t in zip(got, titan, strict=True))


def test_gpt_oss_checkpoint_holds_the_runs_trained_model_and_optimizer_state(go_checkpoint: Path, tmp_path: Path) -> None:
    """The adapters above run on a non-initial state: ``GO_STEPS`` AdamW steps on synthetic gradients
    (tests._gpt_oss: no CPU backward through FlexAttention), saved beside the model as torchtitan does;
    a plain consolidate gives the run's model and optimizer state bit for bit."""
    truth = torch.load(go_checkpoint / "truth.pt", weights_only=True)
    initial = dict(go_build(seed=4321).named_parameters())
    assert len(initial) == len(truth["optim"]["state"]) and initial.keys() <= truth["model"].keys()
    assert not any(torch.equal(truth["model"][k], v) for k, v in initial.items())  # every weight stepped
    assert all(int(s["step"]) == 2 for s in truth["optim"]["state"].values())
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(go_checkpoint / "checkpoint", out, nproc=1)
    got = torch.load(out, weights_only=True)
    want = {"model": truth["model"], "optimizer": truth["optim"]}
    n = assert_same_state({k: got[k] for k in want}, want)
    assert n == len(truth["model"]) + 3 * len(truth["optim"]["state"])


_BATCH = torch.randint(0, GO_VOCAB, (2, 128), generator=torch.Generator().manual_seed(5))
# gpt-oss's 7.0 never binds at this size (expert pre-activations are ~0.2): the logits test sets both models' limit here
_SWIGLU_LIMIT = 0.1


def _titan_logits(model_state: dict[str, torch.Tensor]) -> torch.Tensor:
    """torchtitan's own gpt-oss forward of ``_BATCH`` (``(2, L)`` token ids) from ``model_state``:
    logits ``(2, L, GO_VOCAB)``, float32.

    Two seams are lifted, no model code replaced: its FlexAttention runs eagerly (torch's reference
    ``flex_attention`` and ``create_block_mask``, the functions it compiles: inductor on CPU has no
    ``return_lse``, which the sinks need; compiling the mask costs seconds), and its experts'
    ``.bfloat16()`` casts are no-ops, so the grouped matmuls run in float32 as transformers' do
    (kept, a float32 forward fails on CPU: the bfloat16 expert output meets the float32 combine
    buffer in ``scatter_add``)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common import attention

    model = go_build(seed=0)
    model.load_state_dict(model_state, strict=True)
    model.eval()
    for layer in model.layers.values():  # GptOssGroupedExperts.Config.swiglu_limit, as built
        layer.moe.routed_experts.inner_experts.swiglu_limit = _SWIGLU_LIMIT
    positions = torch.arange(_BATCH.shape[1]).expand(_BATCH.shape[0], -1)
    with ExitStack() as stack, torch.no_grad():
        stack.enter_context(mock.patch.object(attention.FlexAttention, "_compiled_flex_attn", flex_attention))
        stack.enter_context(mock.patch.object(attention, "_compiled_create_block_mask", create_block_mask))
        stack.enter_context(mock.patch.object(torch.Tensor, "bfloat16", lambda self: self))
        logits = model(_BATCH, attention_masks=model.get_attention_masks(positions))
    assert isinstance(logits, torch.Tensor) and logits.dtype == torch.float32
    return logits


def _hf_logits(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``GptOssForCausalLM`` (eager attention and experts, float32) from ``folder`` as
    written, every weight read from it: logits ``(2, L, GO_VOCAB)`` of ``_BATCH``, then the same with
    the swiglu limit at 7.0."""
    from transformers import GptOssForCausalLM

    model, info = GptOssForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched key: nothing left randomly initialised
    with torch.no_grad():
        logits = model(_BATCH).logits
        for layer in model.model.layers:
            layer.mlp.experts.limit = 7.0
        unclamped = model(_BATCH).logits
    assert logits.shape == (*_BATCH.shape, GO_VOCAB) and logits.dtype == torch.float32
    return logits, unclamped


def test_gpt_oss_hf_export_gives_torchtitans_logits(go_checkpoint: Path, tmp_path: Path, runner: CliRunner) -> None:
    """``from_pretrained`` of the ``torchtitan-gpt-oss-to-transformers`` folder as written (transformers' ``GptOssForCausalLM``,
    eager attention and experts, float32) gives torchtitan's logits on a fixed batch that crosses the
    sliding window 32 times over 128 tokens, within float32 rounding: a max difference at most 1e-5
    of the largest logit, about 80 float32 epsilons (2^-23); about 2 are measured, and each feature
    broken alone on one side measured 2.6e-5 (YaRN's ``beta_slow`` 1 -> 2) to 0.3 (window off by one,
    gate/up de-interleaved). Covered: sinks, window, YaRN (factor 32, its attention factor folded
    into torchtitan's softmax scale), the biased router (softmax then top-2 renormalised against
    top-2 then softmax) and experts, interleaved gate/up with alpha 1.702 and a clamp
    (``swiglu_limit``, set to ``_SWIGLU_LIMIT`` in both so that it binds), no MXFP4.

    Where no config makes the two the same model, the comparison says so and bridges it:
    - the expert matrices: torchtitan's ``to_hf`` writes them as ``gate_up_proj_blocks`` ``(E, 2F, D)``
      and ``down_proj_blocks`` ``(E, D, F)`` (MXFP4's names and row layout, unquantized), which
      transformers' unquantized GptOss does not read (it wants ``gate_up_proj`` ``(E, D, 2F)``,
      ``down_proj`` ``(E, F, D)``): the ``-to-transformers`` adapter writes those, each expert
      transposed, and the folder loads with no missing key;
    - ``moe.expert_bias_E`` (load-balancing bias, used for top-k selection only) has no HF
      counterpart and is left out of the folder: the run's nonzero bias routes tokens differently, so
      torchtitan's forward is taken with it zeroed (and shown to differ with it);
    - torchtitan's ``GptOssGroupedExperts.forward`` casts tokens and expert weights to bfloat16 for its
      grouped matmuls (training runs under FSDP2's bfloat16 ``param_dtype``); transformers computes
      them in the model's dtype: the comparison lifts that cast (``_titan_logits``). Both models in
      bfloat16 are no stable reference: a rounding flips a top-2 choice among near-tied experts.
    """
    truth = torch.load(go_checkpoint / "truth.pt", weights_only=True)["model"]
    hf = tmp_path / "hf"
    adapter = ["--adapter", "torchtitan-gpt-oss-to-transformers", "--nproc", "1"]
    result = runner.invoke(app, ["consolidate", str(go_checkpoint / "checkpoint"), str(hf), *adapter])
    assert result.exit_code == 0, result.output
    (hf / "config.json").write_text(json.dumps({**_hf_config(), "swiglu_limit": _SWIGLU_LIMIT}))

    unbiased = {k: torch.zeros_like(v) if k.endswith("expert_bias_E") else v for k, v in truth.items()}
    want, unclamped = _hf_logits(hf)
    assert (unclamped - want).abs().max() > 1e-2  # the limit binds
    scale = want.abs().max()
    diff = (_titan_logits(unbiased) - want).abs().max() / scale
    biased_diff = (_titan_logits(truth) - want).abs().max() / scale
    print(f"gpt-oss logits: max |torchtitan - HF| = {diff:.3g} x max |logit| ({scale:.3g}); {biased_diff:.3g} with the bias")
    assert diff <= 1e-5
    assert biased_diff > 1e-2  # the buffer the folder leaves out changes the model: it is not a no-op here
