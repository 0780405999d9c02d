"""``--dequantize`` of gpt-oss's MXFP4 experts: torch's reader and transformers bit for bit, and into torchtitan at 2 ranks.

The folder is gpt-oss as released, at the size of tests._gpt_oss's torchtitan model widened to
dims of 64 (MXFP4 packs 32 values a group): every tensor bf16 but the experts' weights, which are
uint8 ``*_blocks`` ``(E, rows, cols // 32, 16)`` with uint8 ``*_scales`` ``(E, rows, cols // 32)``,
holding every byte and every E8M0 scale 0..255 (253 and up overflow to ±inf), a weight and its
scales in different files, and ``config.json``'s ``quantization_config`` as gpt-oss's. The truth:
torch's ``QuantizedHuggingFaceStorageReader._dequantize_tensor_mxfp4`` per request over the whole
tensor (torch 2.13's ``dcp.load`` through that reader fills only the first G values of each MXFP4
row, so it is not used), and transformers' ``convert_moe_packed_tensors``, each expert transposed;
``hf-to-torchtitan-gpt-oss`` of the folder is what torchtitan's own ``CheckpointManager`` loads
into the model sharded by FSDP2 at 2 ranks (the model built without the load-balancing
``expert_bias_E``, which no HF folder holds), equal to torchtitan's ``from_hf`` of the truth.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fsdp_convert.adapters.gpt_oss import to_hf
from fsdp_convert.cli.app import app
from fsdp_convert.derive import TensorInfo
from tests._dist import run_ranks
from tests._frameworks import preload
from tests.integration.test_gpt_oss import _SUFFIXES, _hf_config
from tests.integration.test_memory import HOOK, SLACK
from tests.unit.test_mxfp4 import bits, torch_reader

MX_DIM = MX_HIDDEN = 64
QUANTIZATION = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    "quant_method": "mxfp4",
}
"""gpt-oss-20b's ``quantization_config``."""


def mx_model_config() -> Any:
    """tests._gpt_oss's model at dims of 64, without ``expert_bias_E`` (``load_balance_coeff`` None)."""
    import tests._gpt_oss as go

    with mock.patch.multiple(go, GO_DIM=MX_DIM, GO_HIDDEN=MX_HIDDEN):
        config = go.go_model_config()
    layers = [dataclasses.replace(layer, moe=dataclasses.replace(layer.moe, load_balance_coeff=None)) for layer in config.layers]
    return dataclasses.replace(config, layers=layers)


def mx_build(seed: int) -> torch.nn.Module:
    """The model on CPU, initialised by torchtitan's own ``init_weights`` under ``seed``."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = mx_model_config().build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _mxfp4(rows: tuple[int, ...], cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Nibbles ``(*rows, cols // 32, 16)`` holding every byte, scales ``(*rows, cols // 32)`` every E8M0 value, shuffled."""
    nbytes, groups = torch.Size(rows).numel() * cols // 2, torch.Size(rows).numel() * cols // 32
    blocks = torch.arange(nbytes)[torch.randperm(nbytes, generator=g)] % 256
    scales = torch.arange(groups)[torch.randperm(groups, generator=g)] % 256
    assert nbytes >= 256 and groups >= 256
    return blocks.to(torch.uint8).view(*rows, cols // 32, 16), scales.to(torch.uint8).view(*rows, cols // 32)


def _write_folder(root: Path) -> dict[str, torch.Tensor]:
    """gpt-oss as released, the model's shapes; returns its tensors."""
    with torch.device("meta"):
        titan = mx_model_config().build().state_dict()
    rules = to_hf([TensorInfo(k, v.dtype, tuple(v.shape)) for k, v in titan.items()], {})
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for fqn, rule in rules.items():
        if fqn.endswith("_blocks"):
            *rows, cols = rule.shape
            state[fqn], state[fqn.replace("_blocks", "_scales")] = _mxfp4(tuple(rows), cols, g)
        else:
            state[fqn] = torch.randn(rule.shape, generator=g).to(torch.bfloat16)
    files: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for i, (fqn, t) in enumerate(state.items()):  # a weight and its scales in different files
        files[sorted(files)[i % 2]][fqn] = t
    assert any(k.endswith("_blocks") for k in files["model-00001-of-00002.safetensors"])
    root.mkdir()
    weight_map: dict[str, str] = {}
    for file, part in files.items():
        save_file(part, str(root / file))
        weight_map |= dict.fromkeys(part, file)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {**_hf_config(), "hidden_size": MX_DIM, "intermediate_size": MX_HIDDEN, "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION}))
    return state


def _pairs(state: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in state if k.endswith("_blocks")]


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The folder and its tensors."""
    root = tmp_path_factory.mktemp("mxfp4") / "hf"
    return root, _write_folder(root)


def _folder(out: Path) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for file in sorted(out.glob("*.safetensors")):
        got |= load_file(str(file))
    return got


@pytest.mark.parametrize(("flag", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_consolidate_dequantize_equals_torch_reader_and_transformers(
    runner: CliRunner, released: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, flag: str, dtype: torch.dtype
) -> None:
    """consolidate --dequantize --dtype (row blocks under 1MiB): every expert weight bit for bit torch's reader at
    that target and transformers' at that dtype, transposed back; no ``*_scales``; the rest cast."""
    from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

    from fsdp_convert.transform.mxfp4 import FP4_VALUES as OURS

    assert tuple(FP4_VALUES) == OURS
    root, state = released
    out = tmp_path / "out"
    args = ["consolidate", str(root), str(out), "--dequantize", "--dtype", flag, "--memory-budget", "1MiB", "--nproc", "1"]
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    got = _folder(out)
    assert sorted(got) == sorted(k for k in state if not k.endswith("_scales"))
    for fqn, t in state.items():
        if fqn.endswith("_scales"):
            continue
        if not fqn.endswith("_blocks"):
            assert torch.equal(bits(got[fqn]), bits(t.to(dtype))), fqn
            continue
        scales = state[fqn.replace("_blocks", "_scales")]
        want = torch_reader(t, scales, dtype)
        assert got[fqn].dtype == dtype and got[fqn].shape == want.shape, fqn
        assert torch.equal(bits(got[fqn]), bits(want)), fqn
        transformers = convert_moe_packed_tensors(t, scales, dtype=dtype)  # (E, cols, rows)
        assert torch.equal(bits(got[fqn]), bits(transformers.transpose(1, 2))), fqn
        assert got[fqn].float().isinf().any() and got[fqn].float().isfinite().any(), fqn  # scales 253.. and the rest


def _titan_truth(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan's ``from_hf`` of the folder read by torch's reader (float32), under the model's names, the rest float32."""
    from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter

    hf = {}
    for fqn, t in state.items():
        if fqn.endswith("_blocks"):
            hf[fqn] = torch_reader(t, state[fqn.replace("_blocks", "_scales")], torch.float32)
        elif not fqn.endswith("_scales"):
            hf[fqn] = t.float()
    titan = GptOssStateDictAdapter(mx_model_config(), None).from_hf(hf)
    names = {v: k for k, v in _SUFFIXES.items()}
    out = {}
    for key, tensor in titan.items():
        head, _, last = key.rpartition(".")
        out[f"{head}.{names.get(last, last)}"] = tensor
    return out


def _load_at_rank(rank: int, world_size: int, checkpoint: Path, truth_path: Path, work: Path) -> None:
    """On each rank: a fresh model under FSDP2 (per block, then the root), loaded by torchtitan's own
    ``CheckpointManager`` from ``checkpoint`` as its ``initial_load_path`` (model only, as a run starts
    from a converted checkpoint); every tensor of its state dict, gathered, must be the truth's, dtype and bits."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpoint import CheckpointManager

    def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}

    truth = torch.load(truth_path, weights_only=True)
    model = mx_build(seed=4321)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    experts = "layers.1.moe.routed_experts.inner_experts.mlp1_weight_EGD"
    assert not torch.equal(full(model)[experts], truth[experts]), "the fresh model already holds the folder's experts"
    config = CheckpointManager.Config(enable=True, initial_load_path=str(checkpoint), initial_load_model_only=True)
    parts: dict[str, Any] = {"dataloader": None, "optimizers": None, "lr_schedulers": None, "states": {}, "sd_adapter": None}
    manager = config.build(model_parts=[model], base_folder=str(work / str(rank)), **parts)
    assert manager.load(), "CheckpointManager found nothing to load"
    got = full(model)
    assert sorted(got) == sorted(truth)
    for key, tensor in truth.items():
        assert got[key].dtype == tensor.dtype and torch.equal(bits(got[key]), bits(tensor)), f"rank {rank}: {key}"
    manager.close()


def test_hf_to_torchtitan_gpt_oss_of_mxfp4_loads_in_checkpoint_manager_at_2_ranks(
    runner: CliRunner, released: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """reshard --adapter hf-to-torchtitan-gpt-oss (dequantizing, implied) --world-size 2 --dtype fp32: torchtitan's
    CheckpointManager loads it at 2 ranks as its ``from_hf`` of torch's reader's values; ``--dequantize --adapter
    transformers-to-torchtitan-gpt-oss`` writes the same tensors."""
    preload("torchtitan")
    root, state = released
    truth = _titan_truth(state)
    assert any(k.endswith("mlp1_weight_EGD") for k in truth) and any(k.endswith("mlp2_weight_EDF") for k in truth)
    truth_path = tmp_path / "truth.pt"
    torch.save(truth, truth_path)
    out = tmp_path / "titan"
    args = ["reshard", str(root), str(out), "--world-size", "2", "--dtype", "fp32", "--adapter", "hf-to-torchtitan-gpt-oss"]
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    work = tmp_path / "work"
    work.mkdir()
    run_ranks(_load_at_rank, 2, out, truth_path, work, timeout=300)

    other = tmp_path / "from_transformers"
    args = ["reshard", str(root), str(other), "--world-size", "2", "--dtype", "fp32", "--dequantize"]
    done = runner.invoke(app, [*args, "--adapter", "transformers-to-torchtitan-gpt-oss"])
    assert done.exit_code == 0, done.output
    loaded = {k: torch.empty_like(v) for k, v in truth.items()}
    dcp.load(loaded, checkpoint_id=other, no_dist=True)
    assert sorted(dcp.FileSystemReader(other).read_metadata().state_dict_metadata) == sorted(truth)
    for key, tensor in truth.items():
        assert torch.equal(bits(loaded[key]), bits(tensor)), key


MiB = 2**20
BUDGET = 1 * MiB
EXPERTS, ROWS, COLS = 64, 512, 512  # dequantized: 64 MiB of float32, over every bound below; one expert 1 MiB
PROBE = """
import sys, fsdp_convert, sitecustomize
from fsdp_convert.adapters import load_adapter
from fsdp_convert.transform import TransformOptions
adapter = load_adapter(sys.argv[4]) if sys.argv[4] != "-" else None
options = TransformOptions(adapter=adapter, dequantize=adapter is None)
fsdp_convert.consolidate(sys.argv[1], sys.argv[2], nproc=1, memory_budget_bytes=int(sys.argv[3]), options=options)
sitecustomize.record("parent")
"""


@pytest.mark.slow
@pytest.mark.parametrize(("source", "adapter"), [("dcp", "-"), ("hf", "hf-to-torchtitan-gpt-oss")])
def test_dequantize_memory_is_bounded_by_budget(tmp_path: Path, source: str, adapter: str) -> None:
    """MXFP4 experts whose float32 (64 MiB) is larger than budget + slack, built expert by expert: with --dequantize
    from a DCP checkpoint, or through hf-to-torchtitan-gpt-oss from an HF folder (its safetensors tensors read by
    rows, as they lie in the file), no process grows past budget + slack. Torch's reader's values either way."""
    g = torch.Generator().manual_seed(3)
    fqn = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    blocks, scales = _mxfp4((EXPERTS, ROWS), COLS, g)
    state = {fqn: blocks, fqn.replace("_blocks", "_scales"): scales % 16 + 120}  # finite values
    if source == "dcp":
        ck = tmp_path / "checkpoint"
        dcp.save(state, checkpoint_id=ck, no_dist=True)
    else:
        ck = tmp_path / "hf"
        ck.mkdir()
        save_file(state, str(ck / "model.safetensors"))
    bound = BUDGET + SLACK
    assert EXPERTS * ROWS * COLS * 4 > bound, "the dequantized weight must not fit, or the test proves nothing"

    hooks, log, out = tmp_path / "hooks", tmp_path / "memory", tmp_path / "out.safetensors"
    hooks.mkdir()
    log.mkdir()
    (hooks / "sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "MEMORY_TEST_LOG": str(log)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(ck), str(out), str(BUDGET), adapter],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(p.read_text()) for p in log.iterdir()]
    assert sorted(r["role"] for r in records) == ["parent", "rank0"], records
    for r in records:
        growth = r["peak"] - r["base"]
        print(f"MXFP4 dequantize ({source}, {adapter}): {r['role']} grew {growth / MiB:.1f} MiB")
        assert growth <= bound, f"{r['role']} grew {growth / MiB:.1f} MiB, over {bound / MiB:.1f} MiB"
    got = load_file(out)
    key = fqn if adapter == "-" else "layers.0.moe.routed_experts.inner_experts.mlp1_weight_EGD"
    assert sorted(got) == [key]
    assert torch.equal(bits(got[key]), bits(torch_reader(blocks, state[fqn.replace("_blocks", "_scales")], torch.float32)))
