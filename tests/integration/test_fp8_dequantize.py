"""``--dequantize``: a block-FP8 Hugging Face folder (DeepSeek-V3's layout) read as float32, bit for bit torch's reader.

The folder is written here with safetensors: 2-D ``float8_e4m3fn`` weights of shapes that are not
multiples of 128, each with ``weight_scale_inv`` (float32, one per 128x128 block), beside bf16
norms and embeddings. The ground truth is torch's own
``QuantizedHuggingFaceStorageReader`` (block 128, float32 target) and the Hub's reference
``weight_dequant`` formula (``y = x.float() * s`` per block), written out below.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader
from typer.testing import CliRunner

from fsdp_convert.adapters import load_adapter
from fsdp_convert.cli.app import app
from fsdp_convert.derive import Adapter, Derived, TensorInfo, copy_of
from fsdp_convert.errors import InvalidOptionError, UnsupportedTransformError
from fsdp_convert.transform import TransformOptions
from fsdp_convert.transform.fp8 import dequantize_rules, dequantizes, with_fp8

SHAPES = {
    "model.layers.0.self_attn.q_proj": (300, 200),
    "model.layers.0.mlp.down_proj": (130, 257),
    "model.layers.0.mlp.up_proj": (64, 40),
    "model.layers.1.mlp.gate_proj": (1000, 700),  # several row blocks under --memory-budget 1MiB
}
PLAIN = {"model.norm.weight": (200,), "model.embed_tokens.weight": (50, 200)}


def _write_folder(root: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for name, (rows, cols) in SHAPES.items():
        state[f"{name}.weight"] = (torch.randn(rows, cols, generator=g) * 100).to(torch.float8_e4m3fn)
        state[f"{name}.weight_scale_inv"] = torch.rand(math.ceil(rows / 128), math.ceil(cols / 128), generator=g) + 1e-3
    for fqn, shape in PLAIN.items():
        state[fqn] = torch.randn(shape, generator=g).to(torch.bfloat16)
    files = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for i, (fqn, t) in enumerate(state.items()):  # a weight and its scales may sit in different files
        files[sorted(files)[i % 2]][fqn] = t
    root.mkdir()
    weight_map = {}
    for file, part in files.items():
        save_file(part, str(root / file))
        weight_map |= dict.fromkeys(part, file)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (root / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "quantization_config": quant}))


def _weight_dequant(x: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The Hub's ``inference/kernel.py`` ``weight_dequant`` (a Triton kernel: ``y = x * s`` per block, fp32), in torch."""
    y = torch.empty(x.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            y[rows, cols] = x[rows, cols].to(torch.float32) * s[i, j]
    return y


Quantized = tuple[Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Quantized:
    """The folder, torch's reader's float32 weights of it, and its raw tensors."""
    root = tmp_path_factory.mktemp("fp8") / "hf"
    _write_folder(root)
    raw: dict[str, torch.Tensor] = {}
    for file in sorted(root.glob("*.safetensors")):
        raw |= load_file(str(file))
    truth = {f"{name}.weight": torch.zeros(shape, dtype=torch.float32) for name, shape in SHAPES.items()}
    truth |= {fqn: torch.zeros(shape, dtype=torch.bfloat16) for fqn, shape in PLAIN.items()}
    dcp.load(truth, storage_reader=QuantizedHuggingFaceStorageReader(str(root)), no_dist=True)
    return root, truth, raw


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _folder(out: Path) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for file in sorted(out.glob("*.safetensors")):
        got |= load_file(str(file))
    return got


def test_dequantize_equals_torch_reader_and_weight_dequant(runner: CliRunner, quantized: Quantized, tmp_path: Path) -> None:
    """consolidate --dequantize (row blocks under 1MiB): float32 bit for bit both references; scales left out."""
    root, truth, raw = quantized
    out = tmp_path / "out"
    done = runner.invoke(app, ["consolidate", str(root), str(out), "--dequantize", "--memory-budget", "1MiB", "--nproc", "1"])
    assert done.exit_code == 0, done.output
    got = _folder(out)
    assert sorted(got) == sorted(truth)  # no *_scale_inv
    for fqn, want in truth.items():
        assert got[fqn].dtype == want.dtype, fqn
        assert torch.equal(_bits(got[fqn]), _bits(want)), fqn
    for name in SHAPES:
        ref = _weight_dequant(raw[f"{name}.weight"], raw[f"{name}.weight_scale_inv"])
        assert torch.equal(_bits(got[f"{name}.weight"]), _bits(ref)), name
        assert not torch.equal(ref, raw[f"{name}.weight"].float())  # the scales did change the values


def test_dequantize_then_dtype_and_reshard(runner: CliRunner, quantized: Quantized, tmp_path: Path) -> None:
    """reshard --dequantize --dtype bf16: torch's reader's float32, cast to bf16, in the DCP output."""
    root, truth, _ = quantized
    out = tmp_path / "dcp"
    done = runner.invoke(app, ["reshard", str(root), str(out), "--world-size", "2", "--dequantize", "--dtype", "bf16"])
    assert done.exit_code == 0, done.output
    got = {fqn: torch.zeros(t.shape, dtype=torch.bfloat16) for fqn, t in truth.items()}
    dcp.load(got, checkpoint_id=str(out), no_dist=True)
    for fqn, want in truth.items():
        assert torch.equal(got[fqn], want.to(torch.bfloat16)), fqn


def test_dtype_without_dequantize_is_refused(runner: CliRunner, quantized: Quantized, tmp_path: Path) -> None:
    """--dtype on a quantized folder without --dequantize: one line naming a weight and --dequantize; a plain copy works."""
    root, _, raw = quantized
    done = runner.invoke(app, ["consolidate", str(root), str(tmp_path / "a"), "--dtype", "bf16"])
    assert done.exit_code != 0
    line = done.output.strip()
    assert "\n" not in line and "--dequantize" in line and "_proj.weight" in line, line
    done = runner.invoke(app, ["consolidate", str(root), str(tmp_path / "b")])  # today's behaviour: copied as is
    assert done.exit_code == 0, done.output
    got = _folder(tmp_path / "b")
    assert sorted(got) == sorted(raw) and all(torch.equal(_bits(got[k]), _bits(raw[k])) for k in raw)


def test_bad_scales_and_unstack_are_refused(runner: CliRunner, quantized: Quantized, tmp_path: Path) -> None:
    """Scales of the wrong shape name the weight; --dequantize with --unstack-layers is refused before reading."""
    infos = [
        TensorInfo("w.weight", torch.float8_e4m3fn, (300, 200)),
        TensorInfo("w.weight_scale_inv", torch.float32, (2, 2)),
    ]
    with pytest.raises(UnsupportedTransformError, match=r"w\.weight: .*\(3, 2\)"):
        dequantize_rules(infos)
    with pytest.raises(InvalidOptionError, match="exclude each other: dequantize to a folder first"):
        TransformOptions(dequantize=True, unstack_layers=True)
    root = quantized[0]
    done = runner.invoke(app, ["consolidate", str(root), str(tmp_path / "c"), "--dequantize", "--unstack-layers"])
    assert done.exit_code == 2 and "exclude each other" in done.output, done.output


def _names_seen(seen: list[TensorInfo]) -> Adapter:
    def adapter(tensors: Sequence[TensorInfo]) -> dict[str, Derived]:
        seen.extend(tensors)
        return {f"renamed.{t.fqn}": copy_of(t) for t in tensors}

    return adapter


def test_dequantize_then_adapter_sees_float32_weights(quantized: Quantized) -> None:
    """--dequantize with --adapter: the adapter sees the float32 weights and no scales, and its rules read the FP8
    weights and their scales (dequantized as they are read); an hf-to-torchtitan-* adapter implies it."""
    root, truth, raw = quantized
    infos = [TensorInfo(fqn, t.dtype, tuple(t.shape)) for fqn, t in raw.items()]
    seen: list[TensorInfo] = []
    rules = with_fp8(_names_seen(seen), dequantize=True)(infos)  # type: ignore[misc]
    assert sorted(t.fqn for t in seen) == sorted(truth)
    assert all(t.dtype == truth[t.fqn].dtype and t.shape == truth[t.fqn].shape for t in seen)
    fqn = "model.layers.1.mlp.gate_proj.weight"
    rule = rules[f"renamed.{fqn}"]
    assert [i.fqn for i in rule.inputs] == [fqn, f"{fqn}_scale_inv"] and rule.dtype == torch.float32
    assert torch.equal(rule.compute([raw[fqn], raw[f"{fqn}_scale_inv"]]), truth[fqn])
    assert dequantizes(load_adapter("hf-to-torchtitan-deepseek-v3")) and not dequantizes(load_adapter("torchtitan-llama3-to-hf"))
