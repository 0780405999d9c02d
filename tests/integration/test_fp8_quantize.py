"""``--quantize fp8-block128``: DeepSeek-V3's block-FP8 layout written, bit for bit transformers' ``Fp8Quantize``.

A bf16 Hugging Face folder (written here with safetensors: a tiny DeepSeek-style set of 2-D
weights, some of shapes that are multiples of 128 and some not, beside norms, embeddings, a
router and ``lm_head``) is quantized row block by row block under ``--memory-budget 1MiB``. The
ground truth is transformers' own ``Fp8Quantize._quantize_one`` (``integrations/finegrained_fp8``,
which runs on CPU) for the whole-block shapes, and the same formula written out per block for
the partial ones (transformers leaves those unquantized; DeepSeek's layout has partial blocks).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fsdp_convert.cli.app import app
from fsdp_convert.transform import TransformOptions
from fsdp_convert.transform.fp8 import QUANTIZATION_CONFIG

QUANTIZED = {
    "model.layers.0.self_attn.q_proj.weight": (256, 384),  # whole blocks: transformers quantizes these
    "model.layers.0.mlp.experts.0.down_proj.weight": (640, 512),  # several row blocks under 1MiB
    "model.layers.0.mlp.up_proj.weight": (300, 200),  # partial blocks
    "model.layers.0.self_attn.o_proj.weight": (130, 257),
}
KEPT = {
    "model.embed_tokens.weight": (64, 384),
    "model.norm.weight": (384,),
    "model.layers.0.input_layernorm.weight": (384,),
    "model.layers.0.mlp.gate.weight": (8, 384),  # the router
    "lm_head.weight": (64, 384),
}


def _reference(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``_quantize_one`` formula, block by block: scale 448 / amax (1 for zeros), clamp, cast."""
    fmax = torch.finfo(torch.float8_e4m3fn).max
    rows, cols = w.shape
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    inv = torch.empty((-(-rows // block), -(-cols // block)), dtype=torch.float32)
    for i in range(inv.shape[0]):
        for j in range(inv.shape[1]):
            part = w[i * block : (i + 1) * block, j * block : (j + 1) * block].to(torch.float32)
            amax = part.abs().amax()
            scale = fmax / amax if amax > 0 else torch.tensor(1.0)
            inv[i, j] = 1.0 / scale
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = torch.clamp(part * scale, -fmax, fmax).to(q.dtype)
    return q, inv


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The bf16 folder (with a config.json) and its tensors; one block of q_proj is all zeros."""
    root = tmp_path_factory.mktemp("fp8q") / "hf"
    root.mkdir()
    g = torch.Generator().manual_seed(1)
    state = {fqn: (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16) for fqn, shape in {**QUANTIZED, **KEPT}.items()}
    state["model.layers.0.self_attn.q_proj.weight"][128:, :128] = 0
    save_file(state, str(root / "model.safetensors"))
    config = {"model_type": "deepseek_v3", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(config))
    return root, state


def _folder(out: Path) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for file in sorted(out.glob("*.safetensors")):
        got |= load_file(str(file))
    return got


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_quantize_equals_transformers(runner: CliRunner, bf16_folder, tmp_path: Path) -> None:
    """Quantized weights and scales bit for bit transformers' (and the formula's); the rest as it was; the config says fp8."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    root, state = bf16_folder
    out = tmp_path / "fp8"
    args = ["consolidate", str(root), str(out), "--quantize", "fp8-block128", "--hf-assets", str(root)]
    done = runner.invoke(app, [*args, "--memory-budget", "1MiB", "--nproc", "1"])
    assert done.exit_code == 0, done.output
    got = _folder(out)
    assert sorted(got) == sorted([*state, *(f"{fqn}_scale_inv" for fqn in QUANTIZED)])
    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=[128, 128], scale_fmt=None)))
    for fqn, (rows, cols) in QUANTIZED.items():
        q, inv = _reference(state[fqn])
        assert got[fqn].dtype == torch.float8_e4m3fn and torch.equal(_bits(got[fqn]), _bits(q)), fqn
        assert torch.equal(got[f"{fqn}_scale_inv"], inv), fqn
        if rows % 128 == 0 and cols % 128 == 0:
            theirs = quantizer._quantize_one(fqn, state[fqn])
            assert torch.equal(_bits(got[fqn]), _bits(theirs[fqn])), fqn
            assert torch.equal(got[f"{fqn}_scale_inv"], theirs[f"{fqn}_scale_inv"]), fqn
    assert got["model.layers.0.self_attn.q_proj.weight_scale_inv"][1, 0] == 1.0  # the all-zero block
    for fqn in KEPT:
        assert got[fqn].dtype == torch.bfloat16 and torch.equal(got[fqn], state[fqn]), fqn
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG

    # and back: --dequantize gives the weights within FP8's rounding (3 mantissa bits: 1/16 of a block's amax),
    # and drops the quantization_config
    back = tmp_path / "back"
    done = runner.invoke(app, ["consolidate", str(out), str(back), "--dequantize", "--dtype", "bf16", "--hf-assets", str(out)])
    assert done.exit_code == 0, done.output
    again = _folder(back)
    for fqn in QUANTIZED:
        w = state[fqn].float()
        assert again[fqn].dtype == torch.bfloat16
        assert (again[fqn].float() - w).abs().max() <= w.abs().max() / 16, fqn
    assert "quantization_config" not in json.loads((back / "config.json").read_text())


def test_quantize_goes_alone(runner: CliRunner, bf16_folder, tmp_path: Path) -> None:
    """--quantize with --dequantize or --adapter is refused before reading; a bad value names its choices."""
    with pytest.raises(Exception, match="--quantize goes alone"):
        TransformOptions(quantize="fp8-block128", dequantize=True)
    root = bf16_folder[0]
    done = runner.invoke(app, ["consolidate", str(root), str(tmp_path / "x"), "--quantize", "fp8-block128", "--dequantize"])
    assert done.exit_code == 2 and "--quantize goes alone" in done.output, done.output
    done = runner.invoke(app, ["consolidate", str(root), str(tmp_path / "y"), "--quantize", "int4"])
    assert done.exit_code == 2 and "fp8-block128" in done.output, done.output


def test_from_pretrained_of_the_quantized_folder(runner: CliRunner, tmp_path: Path) -> None:
    """transformers loads the quantized folder (dequantizing it on CPU): weights and logits within FP8's rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path / "bf16")
    out = tmp_path / "fp8"
    done = runner.invoke(
        app,
        ["consolidate", str(tmp_path / "bf16"), str(out), "--quantize", "fp8-block128", "--hf-assets", str(tmp_path / "bf16")],
    )
    assert done.exit_code == 0, done.output
    assert load_file(str(out / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    loaded = LlamaForCausalLM.from_pretrained(out).eval()
    for name, w in model.state_dict().items():
        got = loaded.state_dict()[name].float()
        assert (got - w.float()).abs().max() <= w.float().abs().max() / 16, name
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        want, got = model(ids).logits.float(), loaded(ids).logits.float()
    assert (got - want).abs().max() <= 0.1 * want.abs().max()
