"""lora.py: PEFT names to merged or adapter names, adapter_config.json, and the merge's fp32 math against PEFT's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_convert.errors import InvalidOptionError, UnsupportedTransformError
from fsdp_convert.lora import (
    PEFT_PREFIX,
    LoraOptions,
    LoraTarget,
    adapter_config,
    lora_options,
    lora_scale,
    lora_targets,
    merge_rows,
    read_lora_config,
)

P = PEFT_PREFIX
Q = "model.layers.0.self_attn.q_proj"
MODEL = {
    0: (f"{P}model.embed_tokens.weight", (97, 16)),
    1: (f"{P}{Q}.base_layer.weight", (16, 16)),
    2: (f"{P}{Q}.lora_A.default.weight", (4, 16)),
    3: (f"{P}{Q}.lora_B.default.weight", (16, 4)),
    4: (f"{P}model.layers.0.self_attn.k_proj.weight", (8, 16)),
    5: (f"{P}lm_head.weight", (97, 16)),
}


def _targets(model: dict[int, tuple[str, tuple[int, ...]]], options: LoraOptions) -> dict[int, LoraTarget]:
    return lora_targets({i: f for i, (f, _) in model.items()}, {i: s for i, (_, s) in model.items()}, options)


def test_merge_names_are_merge_and_unloads() -> None:
    got = _targets(MODEL, LoraOptions(mode="merge", alpha=8.0))
    assert {i: t.fqn for i, t in got.items()} == {
        0: "model.embed_tokens.weight",
        1: f"{Q}.weight",
        4: "model.layers.0.self_attn.k_proj.weight",
        5: "lm_head.weight",
    }
    assert (got[1].lora_a, got[1].lora_b, got[1].scale) == (2, 3, 2.0)
    assert got[0].lora_a is None


def test_only_names_are_save_pretraineds() -> None:
    got = _targets(MODEL, LoraOptions(mode="only"))
    assert {i: t.fqn for i, t in got.items()} == {2: f"{P}{Q}.lora_A.weight", 3: f"{P}{Q}.lora_B.weight"}
    unprefixed = {i: (f.removeprefix(P), s) for i, (f, s) in MODEL.items()}  # a LoraModel's own state dict
    assert _targets(unprefixed, LoraOptions(mode="only"))[2].fqn == f"{P}{Q}.lora_A.weight"
    assert _targets(unprefixed, LoraOptions(mode="merge", alpha=8.0))[1].fqn == f"{Q}.weight"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({3: None}, "has no lora_B.weight"),
        ({1: None}, "has no base_layer.weight"),
        ({3: (f"{P}{Q}.lora_B.default.weight", (16, 5))}, "shapes do not chain"),
        ({6: (f"{P}{Q}.lora_A.other.weight", (4, 16))}, "several LoRA adapters (default, other)"),
        ({6: (f"{P}model.embed_tokens.lora_embedding_A.default", (4, 97))}, "lora_embedding_A is not supported"),
        ({3: (f"{P}{Q}.lora_B.default.bias", (16,))}, "unexpected PEFT tensor"),
        ({2: None, 3: None}, "no PEFT LoRA tensor"),
    ],
)
def test_bad_adapters_name_the_fqn(change: dict[int, tuple[str, tuple[int, ...]] | None], message: str) -> None:
    model = dict(MODEL)
    for i, value in change.items():
        if value is None:
            del model[i]
        else:
            model[i] = value
    with pytest.raises(UnsupportedTransformError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _targets(model, LoraOptions(mode="merge", alpha=8.0))


def test_rank_must_match_the_config() -> None:
    with pytest.raises(UnsupportedTransformError, match=rf"{P}{Q}.lora_A.default.weight: rank 4, but .* r=8"):
        _targets(MODEL, LoraOptions(mode="merge", alpha=8.0, r=8))


def _write(tmp_path: Path, **fields: object) -> Path:
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **fields}))
    return path


def test_options_from_config_and_flags(tmp_path: Path) -> None:
    opts = lora_options("merge", config_path=_write(tmp_path, use_rslora=True))
    assert (opts.alpha, opts.r, opts.use_rslora) == (8.0, 4, True)
    assert lora_options("merge", alpha=16, r=4) == LoraOptions(mode="merge", alpha=16, r=4)
    with pytest.raises(InvalidOptionError, match="--lora-r 2 contradicts --lora-config's 4"):
        lora_options("merge", config_path=_write(tmp_path), r=2)
    with pytest.raises(InvalidOptionError, match="--merge-lora needs the adapter's lora_alpha"):
        lora_options("merge", r=4)
    with pytest.raises(InvalidOptionError, match="rank must be positive"):
        lora_options("only", r=0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "not LORA"),
        ({"r": "four"}, "no numeric 'r'"),
    ],
)
def test_refused_configs(tmp_path: Path, fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        read_lora_config(_write(tmp_path, **fields))


def test_config_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "adapter_config.json"
    path.write_text("r = 4")
    with pytest.raises(InvalidOptionError, match="cannot read it as JSON"):
        read_lora_config(path)


def test_adapter_config_from_flags() -> None:
    adapter = {f"{P}{Q}.lora_A.weight": (4, 16), f"{P}{Q}.lora_B.weight": (16, 4)}
    fqns = [f for f, _ in MODEL.values()]
    config = adapter_config(LoraOptions(mode="only", alpha=8.0), adapter, fqns)
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["q_proj"])
    more = [*fqns, f"{P}model.layers.1.self_attn.q_proj.weight"]  # a q_proj without the adapter: full names
    assert adapter_config(LoraOptions(mode="only"), adapter, more)["target_modules"] == [Q]


def test_scale() -> None:
    assert lora_scale(8, 4) == 2.0
    assert lora_scale(8, 4, use_rslora=True) == 4.0


@pytest.mark.parametrize("use_rslora", [False, True])
def test_merge_rows_equals_peft_merge_bitwise(use_rslora: bool) -> None:
    """PEFT's own ``merge()`` of a Linear LoRA layer gives the same float32 bits as one call on the whole weight.

    Row block by row block, ``B @ A`` can differ in the last bits: BLAS picks its kernel by the
    number of rows (MKL on AVX-512: blocks starting at multiples of 8 rows give the whole call's
    bits, blocks of 5 do not), so the test allows a few ulps there.
    """
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12, bias=False))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False, use_rslora=use_rslora)
    model = peft.inject_adapter_in_model(config, model)
    layer = model[0]
    w, a, b = (
        t.detach().clone() for t in (layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight)
    )
    scale = lora_scale(8, 4, use_rslora)
    assert scale == layer.scaling["default"]
    whole = merge_rows(w, b, a, scale, torch.float32)
    blocks = torch.cat([merge_rows(w[r : r + 5], b[r : r + 5], a, scale, torch.float32) for r in range(0, 12, 5)])
    layer.merge()
    assert torch.equal(whole, layer.base_layer.weight.detach())
    torch.testing.assert_close(blocks, whole, rtol=0, atol=4e-6)


def test_merge_rows_casts_once_from_fp32() -> None:
    w, b, a = torch.randn(6, 8).bfloat16(), torch.randn(6, 2).bfloat16(), torch.randn(2, 8).bfloat16()
    got = merge_rows(w, b, a, 0.5, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (w.float() + (b.float() @ a.float()) * 0.5).bfloat16())
    with pytest.raises(ValueError, match="do not chain"):
        merge_rows(w, b.T, a, 0.5, torch.bfloat16)


def test_adapter_rules_pickle_for_the_workers() -> None:
    """The plan travels to worker processes: every ``Derived`` the LoRA adapter makes pickles and still merges."""
    import pickle

    from fsdp_convert.derive import TensorInfo
    from fsdp_convert.lora import LoraAdapter, LoraMerge

    infos = [TensorInfo(fqn, torch.float32, shape) for fqn, shape in MODEL.values()]
    rules = pickle.loads(pickle.dumps(LoraAdapter(LoraOptions(mode="merge", alpha=8.0))(infos)))
    merged = rules[f"{Q}.weight"]
    assert [i.fqn for i in merged.inputs] == [MODEL[1][0], MODEL[3][0], MODEL[2][0]]
    assert merged.inputs[2].rows is None  # A is read whole, W and B by aligned row blocks
    assert merged.combine == LoraMerge(2.0)
    assert list(rules) == [MODEL[i][0].removeprefix(P).replace(".base_layer", "") for i in (0, 1, 4, 5)]
