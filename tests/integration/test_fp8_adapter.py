"""Block FP8 with ``--adapter``: DeepSeek-V3's Hub layout into torchtitan (dequantized on the fly) and out of it (quantized).

Two checkpoints. A torchtitan DeepSeek-V3 state dict (its keys from torchtitan's own model code,
``tests._deepseek``, at larger shapes so that weights span several 128x128 blocks, partial ones at
the edges, and each of the 4 experts of 132 rows starts off a block boundary in the stacked
tensor), saved with ``dcp.save``; and the real FSDP2 run of ``tests._deepseek``. The references
are torchtitan's and transformers' own code:

- ``consolidate --adapter torchtitan-deepseek-v3-to-hf --quantize fp8-block128`` must be
  ``DeepSeekV3StateDictAdapter.to_hf`` then transformers' ``Fp8Quantize`` (the formula written out
  for partial blocks, which transformers leaves alone), each expert quantized on its own;
- ``reshard`` of that folder with ``--adapter hf-to-torchtitan-deepseek-v3`` (dequantizing, implied)
  must be torch's ``QuantizedHuggingFaceStorageReader`` (float32, block 128) then ``from_hf``, as
  torchtitan reads a quantized folder (``get_hf_storage_reader(from_quantized=True)``); its
  ``CheckpointManager`` loads it at 3 ranks; ``consolidate --dequantize --adapter`` gives the same.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from typer.testing import CliRunner

from fsdp_convert.adapters import load_adapter
from fsdp_convert.cli.app import app
from fsdp_convert.derive import Derived, Gather, Input, TensorInfo
from fsdp_convert.errors import UnsupportedTransformError
from fsdp_convert.transform.chain import Chain
from fsdp_convert.transform.fp8 import dequantize_rules, quantize_rules
from tests._deepseek import DS_SEQ, DS_VOCAB, HF_ROUTING, ds_build, ds_fp32_experts, ds_load, ds_model_config
from tests._dist import run_ranks
from tests._frameworks import preload
from tests.integration.test_deepseek_v3 import _hf_config
from tests.integration.test_fp8_dequantize import _bits, _folder
from tests.integration.test_fp8_quantize import _reference

_KEPT = ("embed", "norm", "lm_head")
FP8_LOGITS_ATOL = 1e-2
"""|transformers on the FP8 export - torchtitan on the run's fp32 weights| on the logits (~4 in size):
FP8's rounding of every quantized weight (3 mantissa bits); measured 1.4e-3."""


def _quantized(fqn: str, t: torch.Tensor) -> bool:
    """What DeepSeek-V3's Hub weights hold in FP8: 2-D ``.weight`` s but embeddings, norms, ``lm_head`` and the router."""
    return t.dim() == 2 and fqn.endswith(".weight") and not fqn.endswith("mlp.gate.weight") and not any(k in fqn for k in _KEPT)


def _titan_adapter() -> Any:
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    return DeepSeekV3StateDictAdapter(ds_model_config(), None)


def _quantize_reference(hf: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """transformers' ``Fp8Quantize`` of an HF state dict as DeepSeek-V3's Hub quantizes it (the formula for partial
    blocks), the other tensors cast to ``dtype``."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=[128, 128], scale_fmt=None))
    quantizer = Fp8Quantize(config)
    out: dict[str, torch.Tensor] = {}
    for fqn, t in hf.items():
        if not _quantized(fqn, t):
            out[fqn] = t if dtype is None else t.to(dtype)
            continue
        q, inv = _reference(t)
        if t.shape[0] % 128 == 0 and t.shape[1] % 128 == 0:
            theirs = quantizer._quantize_one(fqn, t)
            assert torch.equal(_bits(theirs[fqn]), _bits(q)) and torch.equal(theirs[f"{fqn}_scale_inv"], inv), fqn
        out[fqn], out[f"{fqn}_scale_inv"] = q, inv
    return out


def _read_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """A quantized HF folder through torch's ``QuantizedHuggingFaceStorageReader`` (float32, block 128), as torchtitan
    reads one."""
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    index = folder / "model.safetensors.index.json"
    made_index = not index.exists()
    if made_index:  # the reader finds the scales through the index; a one-file folder has none
        weight_map = dict.fromkeys(load_file(str(folder / "model.safetensors")), "model.safetensors")
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw = _folder(folder)
    hf = {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in raw.items() if not k.endswith("_scale_inv")}
    dcp.load(hf, storage_reader=QuantizedHuggingFaceStorageReader(str(folder), target_dtype=torch.float32), no_dist=True)
    if made_index:
        index.unlink()
    return hf


def _dequantize_reference(folder: Path) -> dict[str, torch.Tensor]:
    """torchtitan's read of a quantized HF folder: ``_read_dequantized``, then ``from_hf``."""
    return _titan_adapter().from_hf(_read_dequantized(folder))


def _scaled(fqn: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if "inner_experts" in fqn:  # 4 experts of 132 rows: expert 1 starts at row 132 of the stacked tensor
        return (shape[0], *(8 * n + 4 for n in shape[1:]))
    return shape if "expert_bias" in fqn else tuple(8 * n for n in shape)


@pytest.fixture(scope="module")
def titan_state(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A torchtitan DeepSeek-V3 state dict (float32, larger shapes, one all-zero block), ``dcp.save`` d to ``ckpt/``."""
    preload("torchtitan")
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in ds_model_config().build().state_dict().items()}
    g = torch.Generator().manual_seed(3)
    state = {k: torch.randn(_scaled(k, s), generator=g) * 0.05 for k, s in shapes.items()}
    state["mtp_layers.0.eh_proj.weight"][:, :128] = 0  # (128, 256): a block of zeros has scale 1
    root = tmp_path_factory.mktemp("fp8_adapter")
    dcp.save(state, checkpoint_id=root / "ckpt", no_dist=True)
    (root / "assets").mkdir()
    (root / "assets" / "config.json").write_text(json.dumps(_hf_config()))
    return root, state


@pytest.fixture(scope="module")
def hf_fp8(titan_state: tuple[Path, dict[str, torch.Tensor]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``consolidate --adapter torchtitan-deepseek-v3-to-hf --quantize fp8-block128 --dtype bf16`` of ``titan_state``
    (the Hub's layout: FP8 weights, the rest bf16; in shards)."""
    root, _ = titan_state
    out = tmp_path_factory.mktemp("fp8_adapter_hf") / "hf_fp8"
    assets = root / "assets"
    args = ["consolidate", str(root / "ckpt"), str(out), "--adapter", "torchtitan-deepseek-v3-to-hf"]
    args += ["--model-config", str(assets / "config.json"), "--quantize", "fp8-block128", "--dtype", "bf16"]
    args += ["--hf-assets", str(assets)]
    done = CliRunner().invoke(app, [*args, "--memory-budget", "1MiB", "--max-shard-size", "500KB", "--nproc", "1"])
    assert done.exit_code == 0, done.output
    return out


def test_adapter_then_quantize_equals_to_hf_then_fp8_quantize(titan_state, hf_fp8: Path) -> None:
    """Every tensor bit for bit torchtitan's ``to_hf`` then transformers' ``Fp8Quantize`` (of the float32 weights; the
    others cast to bf16); experts quantized one by one."""
    _, state = titan_state
    want = _quantize_reference(_titan_adapter().to_hf(dict(state)), torch.bfloat16)
    assert want["model.norm.weight"].dtype == torch.bfloat16
    got = _folder(hf_fp8)
    assert sorted(got) == sorted(want)
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in got  # per expert, (132, 132): 2x2 blocks
    assert got["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 2)
    assert len(list(hf_fp8.glob("*.safetensors"))) > 1
    for fqn, t in want.items():
        assert got[fqn].dtype == t.dtype and torch.equal(_bits(got[fqn]), _bits(t)), fqn
    assert got["model.layers.2.eh_proj.weight_scale_inv"][0, 0] == 1.0  # the all-zero block
    config = json.loads((hf_fp8 / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]


def test_hf_fp8_to_torchtitan_dequantizes_as_torch_reader_then_from_hf(hf_fp8: Path, titan_state, tmp_path: Path) -> None:
    """reshard --adapter hf-to-torchtitan-deepseek-v3 (no --dequantize: implied) and consolidate --dequantize --adapter:
    bit for bit torch's quantized reader then torchtitan's ``from_hf``; scales left out; --dtype casts after."""
    root, _ = titan_state
    want = _dequantize_reference(hf_fp8)
    assert all(t.dtype == torch.float32 for t in want.values())
    adapter = ["--adapter", "hf-to-torchtitan-deepseek-v3", "--model-config", str(root / "assets" / "config.json")]
    out = tmp_path / "titan"
    done = CliRunner().invoke(app, ["reshard", str(hf_fp8), str(out), "--world-size", "2", *adapter])
    assert done.exit_code == 0, done.output
    assert sorted(dcp.FileSystemReader(out).read_metadata().state_dict_metadata) == sorted(want)
    got = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(got, checkpoint_id=out, no_dist=True)
    for fqn, t in want.items():
        assert torch.equal(_bits(got[fqn]), _bits(t)), fqn

    file = tmp_path / "titan.safetensors"
    args = ["consolidate", str(hf_fp8), str(file), "--dequantize", *adapter, "--dtype", "bf16", "--memory-budget", "1MiB"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    flat = load_file(str(file))
    assert sorted(flat) == sorted(want)
    for fqn, t in want.items():
        assert flat[fqn].dtype == torch.bfloat16 and torch.equal(flat[fqn], t.to(torch.bfloat16)), fqn


def test_fp8_round_trip_through_torchtitan(hf_fp8: Path, titan_state, tmp_path: Path) -> None:
    """FP8 HF -> torchtitan (dequantized, float32) -> HF quantized again: every FP8 byte comes back, scales within an ulp.

    A block quantized by this formula has 448 as its largest FP8 magnitude, so its dequantized amax
    is ``448 * scale_inv`` (one float32 product) and the new scale ``448 / amax`` is within a few
    ulps of ``1 / scale_inv``: every element re-quantizes to the FP8 value it was (FP8's spacing is
    2**-3 relative). ``scale_inv = 1 / (448 / amax)`` is rounded twice, so it comes back exactly
    for most blocks and one float32 ulp off for the others (measured here: 13 of 125); the
    unquantized tensors (norms, embeddings, router, bias) come back bit for bit.
    """
    root, _ = titan_state
    config = str(root / "assets" / "config.json")
    titan = tmp_path / "titan"
    args = ["reshard", str(hf_fp8), str(titan), "--world-size", "2", "--adapter", "hf-to-torchtitan-deepseek-v3"]
    done = CliRunner().invoke(app, [*args, "--model-config", config])
    assert done.exit_code == 0, done.output
    again = tmp_path / "again"
    args = ["consolidate", str(titan), str(again), "--adapter", "torchtitan-deepseek-v3-to-hf", "--model-config", config]
    done = CliRunner().invoke(app, [*args, "--quantize", "fp8-block128"])
    assert done.exit_code == 0, done.output
    first, second = _folder(hf_fp8), _folder(again)
    assert sorted(first) == sorted(second)
    ulps = []
    for fqn, t in first.items():
        assert second[fqn].dtype == t.dtype, fqn
        if fqn.endswith("_scale_inv"):
            ulps.append((second[fqn].view(torch.int32) - t.view(torch.int32)).abs().flatten())
        else:
            assert torch.equal(_bits(second[fqn]), _bits(t)), fqn
    ulps_all = torch.cat(ulps)  # measured: 112 of 125 blocks' scale_inv exact, 13 one ulp off
    assert int(ulps_all.max()) <= 1 and int((ulps_all == 0).sum()) > ulps_all.numel() // 2


def test_deepseek_run_fp8_export_loads_in_transformers_and_back_in_torchtitan_at_three_ranks(
    ds_checkpoint: Path,
    tmp_path: Path,
) -> None:
    """The real run exported as FP8 (``--adapter ... --quantize``): ``from_pretrained`` (dequantizing) gives the
    torchtitan model's logits within FP8's rounding; ``reshard --adapter hf-to-torchtitan-deepseek-v3 --world-size 3``
    of it is what torchtitan's ``CheckpointManager`` loads at 3 ranks, equal to torch's quantized reader + ``from_hf``."""
    from transformers import DeepseekV3ForCausalLM

    assets = tmp_path / "assets"
    assets.mkdir()
    config = {**_hf_config(), **HF_ROUTING, "rms_norm_eps": 1e-6, "rope_interleave": True}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (assets / "config.json").write_text(json.dumps(config))
    hf = tmp_path / "hf_fp8"
    adapter = ["--adapter", "torchtitan-deepseek-v3-to-hf", "--model-config", str(assets / "config.json")]
    args = ["consolidate", str(ds_checkpoint / "checkpoint"), str(hf), *adapter, "--quantize", "fp8-block128"]
    done = CliRunner().invoke(app, [*args, "--hf-assets", str(assets)])
    assert done.exit_code == 0, done.output
    truth = torch.load(ds_checkpoint / "truth.pt", weights_only=True)
    got = _folder(hf)
    assert got["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    want = _quantize_reference(_titan_adapter().to_hf(dict(truth)))
    assert sorted(got) == sorted(want) and all(torch.equal(_bits(got[k]), _bits(v)) for k, v in want.items())

    titan = ds_build(seed=0)
    titan.load_state_dict(truth)
    ds_fp32_experts(titan)
    model, info = DeepseekV3ForCausalLM.from_pretrained(
        hf, torch_dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and all(k.startswith("model.layers.2.") for k in info["unexpected_keys"])  # MTP
    dequantized = _read_dequantized(hf)
    for key, tensor in model.state_dict().items():  # transformers' dequantization is torch's reader's, bit for bit
        if key.endswith("experts.gate_up_proj"):
            gate, up = (torch.stack([dequantized[f"{key[:-12]}{e}.{w}_proj.weight"] for e in range(4)]) for w in ("gate", "up"))
            assert torch.equal(tensor, torch.cat([gate, up], dim=1)), key
        elif key.endswith("experts.down_proj"):
            assert torch.equal(tensor, torch.stack([dequantized[f"{key[:-9]}{e}.down_proj.weight"] for e in range(4)])), key
        else:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, dequantized[key]), key
    tokens = torch.randint(0, DS_VOCAB, (3, DS_SEQ), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        logits, titan_logits = model.eval()(tokens).logits, titan.eval()(tokens)[0]
    assert (logits - titan_logits).abs().max() <= FP8_LOGITS_ATOL  # measured 1.4e-3 (logits up to 3.8)

    reference = tmp_path / "reference.pt"
    torch.save(_dequantize_reference(hf), reference)
    out = tmp_path / "titan"
    back = ["--adapter", "hf-to-torchtitan-deepseek-v3", "--model-config", str(assets / "config.json")]
    done = CliRunner().invoke(app, ["reshard", str(hf), str(out), "--world-size", "3", *back])
    assert done.exit_code == 0, done.output
    work = tmp_path / "load"
    work.mkdir()
    run_ranks(ds_load, 3, out, reference, work)


def test_head_permuted_rows_of_an_fp8_weight_equal_dequantize_first(tmp_path: Path) -> None:
    """hf-to-torchtitan-llama3 on an FP8 Llama folder: the Q/K rows permuted per head (a row selection, not a block)
    read their FP8 rows and scale rows one by one; bit for bit ``--dequantize`` to a folder, then the adapter on it."""
    g = torch.Generator().manual_seed(5)
    shapes = {"self_attn.q_proj": (256, 200), "self_attn.k_proj": (64, 200), "self_attn.v_proj": (64, 200)}
    shapes |= {"self_attn.o_proj": (200, 256), "mlp.gate_proj": (300, 200), "mlp.up_proj": (300, 200)}
    shapes["mlp.down_proj"] = (200, 300)
    state: dict[str, torch.Tensor] = {}
    for name, (rows, cols) in shapes.items():
        fqn = f"model.layers.0.{name}.weight"
        state[fqn] = (torch.randn(rows, cols, generator=g) * 100).to(torch.float8_e4m3fn)
        state[f"{fqn}_scale_inv"] = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) + 1e-3
    for fqn in ("model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"):
        state[fqn] = torch.randn(200, generator=g).to(torch.bfloat16)
    state["model.embed_tokens.weight"] = state["lm_head.weight"] = torch.randn(50, 200, generator=g).to(torch.bfloat16)
    hf = tmp_path / "hf"
    hf.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.clone() for k, v in state.items()}, str(hf / "model.safetensors"))
    adapter = ["--adapter", "hf-to-torchtitan-llama3", "--adapter-option", "num_attention_heads=8"]
    adapter += ["--adapter-option", "num_key_value_heads=2"]
    runner = CliRunner()
    done = runner.invoke(app, ["consolidate", str(hf), str(tmp_path / "one.safetensors"), *adapter, "--memory-budget", "1MiB"])
    assert done.exit_code == 0, done.output
    done = runner.invoke(app, ["consolidate", str(hf), str(tmp_path / "deq"), "--dequantize"])
    assert done.exit_code == 0, done.output
    done = runner.invoke(app, ["consolidate", str(tmp_path / "deq"), str(tmp_path / "two.safetensors"), *adapter])
    assert done.exit_code == 0, done.output
    one, two = load_file(str(tmp_path / "one.safetensors")), load_file(str(tmp_path / "two.safetensors"))
    assert sorted(one) == sorted(two) and "layers.0.attention.qkv_linear.wq.weight" in one
    for fqn, t in two.items():
        assert one[fqn].dtype == t.dtype and torch.equal(_bits(one[fqn]), _bits(t)), fqn
    wq = one["layers.0.attention.qkv_linear.wq.weight"]
    assert not torch.equal(wq, load_file(str(tmp_path / "deq" / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"])


def _first(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0]


def _reversed_rows(tensors: Sequence[TensorInfo]) -> dict[str, Derived]:
    info = tensors[0]
    rows = Gather(tuple(reversed(range(info.shape[0]))))
    return {"p.weight": Derived(inputs=(Input(fqn=info.fqn, rows=rows),), shape=info.shape, dtype=info.dtype)}


def test_chain_compute_and_its_refusal() -> None:
    """A chained rule computes what its two rule sets compute one after the other (``Derived.compute``, as --verify
    does); a row selection of a rule built by 128-row blocks (--quantize) is refused, naming both tensors."""
    g = torch.Generator().manual_seed(9)
    raw = {
        f"model.layers.0.mlp.experts.{e}.up_proj.weight": (torch.randn(130, 140, generator=g) * 50).to(torch.float8_e4m3fn)
        for e in range(2)
    }
    raw |= {f"{k}_scale_inv": torch.rand(2, 2, generator=g) for k in list(raw)}
    infos = [TensorInfo(k, v.dtype, tuple(v.shape)) for k, v in raw.items()]
    rules = load_adapter("hf-to-torchtitan-deepseek-v3")(infos)
    ((fqn, rule),) = rules.items()
    assert fqn == "layers.0.moe.routed_experts.inner_experts.w3_EFD" and rule.shape == (2, 130, 140)
    dequantized = {k: rule.compute([raw[k], raw[f"{k}_scale_inv"]]) for k, rule in dequantize_rules(infos).items()}
    assert torch.equal(rule.compute([raw[i.fqn] for i in rule.inputs]), torch.stack(list(dequantized.values())))
    assert pickle.loads(pickle.dumps(rule)) == rule  # plans travel to the workers pickled
    whole = {"w.weight": Derived(inputs=(Input(fqn=fqn, rows=None),), shape=rule.shape, dtype=torch.float32, combine=_first)}
    read_whole = Chain(load_adapter("hf-to-torchtitan-deepseek-v3"), lambda tensors: whole)(infos)["w.weight"]
    assert torch.equal(read_whole.compute([raw[i.fqn] for i in read_whole.inputs]), torch.stack(list(dequantized.values())))
    info = TensorInfo("w.weight", torch.float32, (256, 128))
    with pytest.raises(UnsupportedTransformError, match=r"p\.weight: reads w\.weight through Gather"):
        Chain(quantize_rules, _reversed_rows)([info])
    assert sorted(Chain(_reversed_rows, quantize_rules)([info])) == ["p.weight", "p.weight_scale_inv"]  # blocks of rows


def test_hf_fp8_to_torchtitan_names_quantized_again(hf_fp8: Path, titan_state, tmp_path: Path) -> None:
    """--adapter hf-to-torchtitan-deepseek-v3 --quantize fp8-block128: the dequantized, renamed weights quantized again
    as they are named now (2-D ``.weight`` s); the stacked experts (3-D, built in their (E * F, D) view and read by
    expert) dequantized, bit for bit the reference's."""
    root, _ = titan_state
    want = _dequantize_reference(hf_fp8)
    out = tmp_path / "titan.safetensors"
    args = ["consolidate", str(hf_fp8), str(out), "--adapter", "hf-to-torchtitan-deepseek-v3", "--quantize", "fp8-block128"]
    done = CliRunner().invoke(app, [*args, "--model-config", str(root / "assets" / "config.json"), "--memory-budget", "1MiB"])
    assert done.exit_code == 0, done.output
    got = load_file(str(out))
    expected = _quantize_reference(want)
    assert sorted(got) == sorted(expected) and "layers.0.attention.wo.weight_scale_inv" in got
    assert got["layers.1.moe.routed_experts.inner_experts.w1_EFD"].dtype == torch.float32
    for fqn, t in expected.items():  # norms and embeddings stay bf16 as stored (the reader reads them into float32)
        assert got[fqn].dtype in (t.dtype, torch.bfloat16) and torch.equal(_bits(got[fqn].to(t.dtype)), _bits(t)), fqn
