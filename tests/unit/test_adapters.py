"""adapters/: the built-in model-family adapters against torchtitan 0.3.0's own state dict adapters, bit for bit.

Random weights of tiny configs are saved with ``dcp.save`` (no process group), consolidated with
``--adapter`` into a safetensors file, and compared with what torchtitan's ``Llama3StateDictAdapter``
/ ``Qwen3StateDictAdapter`` ``to_hf`` return on the same state dict; the reverse direction reshards
an HF folder and compares with their ``from_hf``. Also: a user's ``module:function`` adapter, the
config errors, and the CLI flags. No training: the llama3 round trip through torchtitan's own
trained model is tests/integration/test_adapters.py.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.adapters import load_adapter, parse_adapter_option
from fsdp_convert.cli.app import app
from fsdp_convert.errors import InvalidOptionError, UnsupportedTransformError
from fsdp_convert.transform import TransformOptions

H, KV, HD, D, F, V, LAYERS, EXPERTS = 4, 2, 8, 32, 48, 50, 2, 3
BF16 = torch.bfloat16


def _rand(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(BF16)


def _titan_llama3(prefix: str = "attention.qkv_linear.", head: str = "lm_head") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {"tok_embeddings.weight": _rand(V, D, gen=g), "norm.weight": _rand(D, gen=g), f"{head}.weight": _rand(V, D, gen=g)}
    for n in range(LAYERS):
        p = f"layers.{n}."
        sd[p + prefix + "wq.weight"] = _rand(H * HD, D, gen=g)
        sd[p + prefix + "wk.weight"] = _rand(KV * HD, D, gen=g)
        sd[p + prefix + "wv.weight"] = _rand(KV * HD, D, gen=g)
        sd[p + "attention.wo.weight"] = _rand(D, H * HD, gen=g)
        sd[p + "feed_forward.w1.weight"] = _rand(F, D, gen=g)
        sd[p + "feed_forward.w3.weight"] = _rand(F, D, gen=g)
        sd[p + "feed_forward.w2.weight"] = _rand(D, F, gen=g)
        sd[p + "attention_norm.weight"] = _rand(D, gen=g)
        sd[p + "ffn_norm.weight"] = _rand(D, gen=g)
    return sd


def _titan_qwen3(moe: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    sd = {"tok_embeddings.weight": _rand(V, D, gen=g), "norm.weight": _rand(D, gen=g), "lm_head.weight": _rand(V, D, gen=g)}
    for n in range(LAYERS):
        p = f"layers.{n}."
        for name, shape in (("wq", (H * HD, D)), ("wk", (KV * HD, D)), ("wv", (KV * HD, D))):
            sd[p + f"attention.qkv_linear.{name}.weight"] = _rand(*shape, gen=g)
        sd[p + "attention.wo.weight"] = _rand(D, H * HD, gen=g)
        sd[p + "attention.q_norm.weight"] = _rand(HD, gen=g)
        sd[p + "attention.k_norm.weight"] = _rand(HD, gen=g)
        sd[p + "attention_norm.weight"] = _rand(D, gen=g)
        sd[p + "ffn_norm.weight"] = _rand(D, gen=g)
        if moe:
            e = p + "moe.routed_experts.inner_experts."
            sd[e + "w1_EFD"] = _rand(EXPERTS, F, D, gen=g)
            sd[e + "w3_EFD"] = _rand(EXPERTS, F, D, gen=g)
            sd[e + "w2_EDF"] = _rand(EXPERTS, D, F, gen=g)
            sd[p + "moe.router.gate.weight"] = _rand(EXPERTS, D, gen=g)
        else:
            for w, shape in (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F))):
                sd[p + f"feed_forward.{w}.weight"] = _rand(*shape, gen=g)
    return sd


def _llama3_adapter(tied: bool = False) -> Any:
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    rope = object.__new__(ComplexRoPE.Config)  # from_hf only checks the RoPE kind
    attention = types.SimpleNamespace(n_heads=H, n_kv_heads=KV, head_dim=HD, rope=rope)
    config = types.SimpleNamespace(dim=D, enable_weight_tying=tied, layers=[types.SimpleNamespace(attention=attention)])
    return Llama3StateDictAdapter(config, None)  # type: ignore[arg-type]


def _qwen3_adapter(tied: bool = False) -> Any:
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    attention = types.SimpleNamespace(rope=object.__new__(CosSinRoPE.Config))
    layer = types.SimpleNamespace(attention=attention, moe=types.SimpleNamespace(num_experts=EXPERTS))
    return Qwen3StateDictAdapter(types.SimpleNamespace(enable_weight_tying=tied, layers=[layer]), None)  # type: ignore[arg-type]


CONFIG = {"num_attention_heads": H, "num_key_value_heads": KV}


def _consolidate(sd: dict[str, torch.Tensor], tmp: Path, adapter: str, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    dcp.save(sd, checkpoint_id=tmp / "ck", no_dist=True)
    options = TransformOptions(adapter=load_adapter(adapter, config))
    fsdp_convert.consolidate(tmp / "ck", tmp / "out.safetensors", options=options, nproc=1, memory_budget_bytes=1 << 16)
    return load_file(tmp / "out.safetensors")


def _reshard(hf: dict[str, torch.Tensor], tmp: Path, adapter: str, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    (tmp / "hf").mkdir()
    save_file({k: v.contiguous() for k, v in hf.items()}, tmp / "hf" / "model.safetensors")
    options = TransformOptions(adapter=load_adapter(adapter, config))
    fsdp_convert.reshard(tmp / "hf", tmp / "titan", world_size=2, options=options, nproc=1)
    dcp_to_torch_save(tmp / "titan", tmp / "full.pt")
    return torch.load(tmp / "full.pt", weights_only=True)  # type: ignore[no-any-return]


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want) or sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


@pytest.mark.parametrize("tied", [False, True])
def test_llama3_to_hf_is_torchtitans(tmp_path: Path, tied: bool) -> None:
    sd = _titan_llama3()
    got = _consolidate(sd, tmp_path, "torchtitan-llama3-to-hf", {**CONFIG, "tie_word_embeddings": tied})
    _assert_same(got, _llama3_adapter(tied).to_hf(dict(sd)))


def test_llama3_to_hf_reads_earlier_torchtitan_names(tmp_path: Path) -> None:
    """torchtitan before 0.3: ``attention.wq`` and ``output.weight``; same HF tensors."""
    got = _consolidate(_titan_llama3(prefix="attention.", head="output"), tmp_path, "torchtitan-llama3-to-hf", CONFIG)
    _assert_same(got, _llama3_adapter().to_hf(_titan_llama3()))


def test_llama3_to_hf_splits_a_fused_wqkv(tmp_path: Path) -> None:
    """A fused ``wqkv`` (FusedQKVLinear's row order) gives the same HF q/k/v as torchtitan's save hook and to_hf."""
    from torchtitan.models.common.attention import FusedQKVLinear

    sd = _titan_llama3()
    fused = dict(sd)
    for n in range(LAYERS):
        p = f"layers.{n}.attention.qkv_linear."
        q, k, v = (fused.pop(p + f"{w}.weight") for w in ("wq", "wk", "wv"))
        module = types.SimpleNamespace(head_dim=HD, heads_per_kv=H // KV)
        merged = {p + "wq.weight": q, p + "wk.weight": k, p + "wv.weight": v}
        FusedQKVLinear._merge_qkv_on_load(module, merged, p)
        fused[p + "wqkv.weight"] = merged[p + "wqkv.weight"]
    _assert_same(_consolidate(fused, tmp_path, "torchtitan-llama3-to-hf", CONFIG), _llama3_adapter().to_hf(dict(sd)))


@pytest.mark.parametrize("tied", [False, True])
def test_hf_to_llama3_is_torchtitans_from_hf(tmp_path: Path, tied: bool) -> None:
    hf = _llama3_adapter(tied).to_hf(_titan_llama3())
    got = _reshard(hf, tmp_path, "hf-to-torchtitan-llama3", {**CONFIG, "tie_word_embeddings": tied})
    _assert_same(got, _llama3_adapter(tied).from_hf(dict(hf)))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_qwen3_both_ways_are_torchtitans(tmp_path: Path, moe: bool) -> None:
    sd = _titan_qwen3(moe)
    want = _qwen3_adapter().to_hf(dict(sd))
    hf = _consolidate(sd, tmp_path, "torchtitan-qwen3-to-hf", {})
    _assert_same(hf, want)
    back = _reshard(hf, tmp_path, "hf-to-torchtitan-qwen3", {})
    _assert_same(back, _qwen3_adapter().from_hf(dict(want)))
    _assert_same(back, sd)


def test_adapter_errors_name_what_to_pass(tmp_path: Path) -> None:
    sd = _titan_llama3()
    with pytest.raises(InvalidOptionError, match="needs num_attention_heads: pass --model-config"):
        _consolidate(sd, tmp_path, "torchtitan-llama3-to-hf", {})
    with pytest.raises(UnsupportedTransformError, match=r"layers\.0\.attention\.qkv_linear\.wq\.weight: 32 rows do not split"):
        _consolidate(sd, tmp_path / "b", "torchtitan-llama3-to-hf", {"num_attention_heads": 3})
    with pytest.raises(InvalidOptionError, match="unknown; use one of torchtitan-llama3-to-hf"):
        load_adapter("llama")
    with pytest.raises(InvalidOptionError, match="module 'no_such_module' does not import"):
        load_adapter("no_such_module:fn")
    options = TransformOptions(adapter=load_adapter("torchtitan-llama3-to-hf", CONFIG))
    # --verify recomputes the permuted rows: equal as written, and a flipped byte in them is a difference
    out = tmp_path / "v.safetensors"
    fsdp_convert.consolidate(tmp_path / "ck", out, options=options, nproc=1, verify_output=True)
    assert fsdp_convert.verify(tmp_path / "ck", out, options=options, in_process=True).equal
    data = bytearray(out.read_bytes())
    header = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8 : 8 + header])["model.layers.0.self_attn.q_proj.weight"]["data_offsets"]
    data[8 + header + begin + 3] ^= 0x40
    out.write_bytes(bytes(data))
    differences = fsdp_convert.verify(tmp_path / "ck", out, options=options, in_process=True).differences
    assert [d.key for d in differences] == ["model.model.layers.0.self_attn.q_proj.weight"]
    assert parse_adapter_option("num_key_value_heads=8") == ("num_key_value_heads", 8)
    assert parse_adapter_option("name=x") == ("name", "x")


USER_MODULE = """
from fsdp_convert.derive import Derived, HeadPermute, Input


def reverse_rows(parts):
    return parts[0].flip(0)


def my_map(tensors, config):
    out = {}
    for t in tensors:
        if t.fqn.endswith("wq.weight"):
            rows = HeadPermute(config["heads"], t.shape[0] // config["heads"])
            out["q." + t.fqn] = Derived(inputs=(Input(fqn=t.fqn, rows=rows),), shape=t.shape, dtype=t.dtype)
        elif t.fqn == "norm.weight":
            out["norm"] = Derived(inputs=(Input(fqn=t.fqn, rows=None),), shape=t.shape, dtype=t.dtype, combine=reverse_rows)
    return out
"""


def test_user_adapter_module_function_through_the_cli(tmp_path: Path, runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--adapter mymod:fn`` imports the user's module (from the current folder) and applies its rules."""
    (tmp_path / "my_adapters_mod.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_adapters_mod", raising=False)
    sd = _titan_llama3()
    dcp.save(sd, checkpoint_id=tmp_path / "ck", no_dist=True)
    (tmp_path / "config.json").write_text(json.dumps({"heads": 1}))
    args = ["consolidate", "ck", "out.safetensors", "--nproc", "1", "--adapter", "my_adapters_mod:my_map"]
    result = runner.invoke(app, [*args, "--model-config", "config.json", "--adapter-option", "heads=4"])
    assert result.exit_code == 0, result.output
    got = load_file(tmp_path / "out.safetensors")
    wq = "layers.1.attention.qkv_linear.wq.weight"
    assert sorted(got) == ["norm", "q.layers.0.attention.qkv_linear.wq.weight", "q." + wq]
    assert torch.equal(got["norm"], sd["norm.weight"].flip(0))
    assert torch.equal(got["q." + wq], _llama3_adapter().to_hf({wq: sd[wq]})["model.layers.1.self_attn.q_proj.weight"])
    bad = runner.invoke(app, ["consolidate", "ck", "o2.safetensors", "--model-config", "config.json"])
    assert bad.exit_code == 2 and "--model-config and --adapter-option go with --adapter" in bad.output
