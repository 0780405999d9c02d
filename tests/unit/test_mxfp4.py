"""transform.mxfp4: gpt-oss's MXFP4 experts (uint8 ``*_blocks`` nibbles, ``*_scales`` E8M0) as torch's reader reads them.

The ground truth is torch's own ``QuantizedHuggingFaceStorageReader._dequantize_tensor_mxfp4``,
called per request over the whole tensor (torch 2.13's ``dcp.load`` through that reader fills only
the first G values of each MXFP4 row, so it is not the reference), at float32 and bfloat16
targets; tests/integration/test_mxfp4.py adds transformers' ``convert_moe_packed_tensors`` (its
import alone takes seconds). The data holds every byte (so every nibble, low and high) under every
E8M0 scale 0..255.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

from fsdp_convert.adapters.gpt_oss import from_hf, from_transformers
from fsdp_convert.derive import Derived, TensorInfo
from fsdp_convert.errors import UnsupportedTransformError
from fsdp_convert.transform.fp8 import dequantize_rules, with_fp8
from fsdp_convert.transform.mxfp4 import FP4_VALUES, dequantize_groups, dequantize_rule, mxfp4_pairs

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def every_byte_and_scale(experts: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Nibbles ``(experts, 256, 16, 16)`` and scales ``(experts, 256, 16)``: row ``r`` of each expert has scale ``r``
    in every group and all 256 bytes across its 16 groups (each expert in another order)."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.stack([torch.randperm(256, generator=g).repeat(256, 1) for _ in range(experts)])
    scales = torch.arange(256).view(1, 256, 1).expand(experts, 256, 16)
    return blocks.view(experts, 256, 16, 16).to(torch.uint8), scales.to(torch.uint8).contiguous()


def torch_reader(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's reader's per-request MXFP4 dequantization of the whole ``(E, R, G, B)`` tensor, at target ``dtype``."""
    reader = QuantizedHuggingFaceStorageReader("unused", target_dtype=dtype)
    e, r, g, b = blocks.shape
    request = SimpleNamespace(storage_offsets=(0, 0, 0), lengths=(e, r, g * 2 * b))
    return reader._dequantize_tensor_mxfp4(blocks, scales, request, group_start=0, offset_in_first_group=0)  # type: ignore[arg-type]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.dtype])


def info(t: torch.Tensor, fqn: str) -> TensorInfo:
    return TensorInfo(fqn, t.dtype, tuple(t.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_byte_under_every_scale_equals_torch_reader(dtype: torch.dtype) -> None:
    """float32 (cast to ``dtype`` as the mover casts): torch's reader at that target bit for bit, the ±inf of
    scales 253 and up included; values within float32's range exact."""
    blocks, scales = every_byte_and_scale()
    rule = dequantize_rule(info(blocks, "w_blocks"), info(scales, "w_scales"))
    got = rule.compute([blocks, scales])
    assert got.dtype == torch.float32 and got.shape == (3, 256, 512)
    got = got.to(dtype)
    want = torch_reader(blocks, scales, dtype)
    assert want.dtype == dtype and torch.equal(bits(got), bits(want))

    inf = got.float().isinf()
    assert not got.float().isnan().any()
    assert not inf[:, :253].any() and inf[:, 253].any() and inf[:, 255].any()  # scales 253.. overflow the large values
    # value 2j + h of a group is byte j's low (h 0) or high (h 1) nibble, times 2 ** (scale - 127), exactly
    nibbles = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).view(3, 256, 512).long()
    exact = torch.tensor(FP4_VALUES, dtype=torch.float64)[nibbles] * torch.pow(2.0, torch.arange(256) - 127.0).view(1, 256, 1)
    assert torch.equal(got[:, :253].double(), exact[:, :253])
    assert got[0, 0].abs().min() == 0 and got[0, 0][got[0, 0] != 0].abs().min() == 2.0**-128  # scale 0: subnormal, kept


def test_experts_are_built_one_block_at_a_time() -> None:
    """``(E, R, G, B)`` is built by dim-0 rows (experts), its inputs read by the same rows: any block of experts
    is those experts of the whole; 3-d nibbles ``(R, G, B)`` alike by rows."""
    blocks, scales = every_byte_and_scale(experts=3)
    rule = dequantize_rule(info(blocks, "x.w_blocks"), info(scales, "x.w_scales"))
    assert rule.shape == (3, 256, 512) and rule.view is None
    assert [(i.fqn, i.view, list(i.rows(1, 3)) if i.rows else None) for i in rule.inputs] == [
        ("x.w_blocks", None, [1, 2]),
        ("x.w_scales", None, [1, 2]),
    ]
    whole = rule.compute([blocks, scales])
    for r0, r1 in [(0, 1), (1, 3), (2, 3)]:
        assert torch.equal(bits(dequantize_groups([blocks[r0:r1], scales[r0:r1]])), bits(whole[r0:r1]))
    rows = dequantize_rule(info(blocks[1], "w_blocks"), info(scales[1], "w_scales"))
    assert rows.shape == (256, 512)
    assert torch.equal(bits(rows.compute([blocks[1], scales[1]])), bits(whole[1]))
    assert torch.equal(bits(dequantize_groups([blocks[1, 7:9], scales[1, 7:9]])), bits(whole[1, 7:9]))


def test_dequantize_rules_takes_mxfp4_pairs_beside_block_fp8_and_leaves_the_rest() -> None:
    """One entry point: MXFP4 pairs and FP8 weights dequantized to float32, both kinds of scales left out, the rest copied."""
    tensors = [
        TensorInfo("e.gate_up_proj_blocks", torch.uint8, (4, 64, 2, 16)),
        TensorInfo("e.gate_up_proj_scales", torch.uint8, (4, 64, 2)),
        TensorInfo("q.weight", torch.float8_e4m3fn, (300, 200)),
        TensorInfo("q.weight_scale_inv", torch.float32, (3, 2)),
        TensorInfo("lone_blocks", torch.uint8, (4, 2, 16)),  # no scales: not MXFP4
        TensorInfo("float_blocks", torch.float32, (4, 64, 64)),
        TensorInfo("float_scales", torch.float32, (4, 64)),  # not uint8: not MXFP4
        TensorInfo("norm.weight", torch.bfloat16, (64,)),
    ]
    assert mxfp4_pairs(tensors) == {"e.gate_up_proj_blocks": "e.gate_up_proj_scales"}
    rules = dequantize_rules(tensors)
    assert list(rules) == ["e.gate_up_proj_blocks", "q.weight", "lone_blocks", "float_blocks", "float_scales", "norm.weight"]
    mx = rules["e.gate_up_proj_blocks"]
    assert mx.shape == (4, 64, 64) and mx.dtype == torch.float32 and mx.combine is dequantize_groups
    assert rules["q.weight"].dtype == torch.float32
    assert all(rules[k].is_copy for k in ("lone_blocks", "float_blocks", "float_scales", "norm.weight"))


@pytest.mark.parametrize(
    ("blocks", "scales"),
    [((4, 64, 2, 16), (4, 64, 1)), ((4, 64, 2, 16), (4, 64)), ((2, 16), (2,))],
)
def test_mxfp4_scales_of_another_shape_are_refused_naming_both(blocks: tuple[int, ...], scales: tuple[int, ...]) -> None:
    tensors = [TensorInfo("w_blocks", torch.uint8, blocks), TensorInfo("w_scales", torch.uint8, scales)]
    with pytest.raises(UnsupportedTransformError, match=r"w_blocks: MXFP4 needs .* w_scales .*"):
        dequantize_rules(tensors)


def _released(layers: int = 1, experts: int = 4, dim: int = 64, hidden: int = 64) -> list[TensorInfo]:
    """gpt-oss's expert tensors as released: MXFP4 nibbles and scales, bf16 biases."""
    out = []
    for n in range(layers):
        p = f"model.layers.{n}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * hidden, dim), ("down_proj", dim, hidden)):
            out.append(TensorInfo(f"{p}{name}_blocks", torch.uint8, (experts, rows, cols // 32, 16)))
            out.append(TensorInfo(f"{p}{name}_scales", torch.uint8, (experts, rows, cols // 32)))
            out.append(TensorInfo(f"{p}{name}_bias", torch.bfloat16, (experts, rows)))
    return out


@pytest.mark.parametrize("adapter", [from_hf, from_transformers])
def test_gpt_oss_adapters_read_dequantized_experts_by_expert(adapter: Callable[..., Mapping[str, Derived]]) -> None:
    """Both torchtitan adapters after ``--dequantize``: torchtitan's expert weights read the nibbles and scales, an
    output block of experts those experts' rows only; without it the nibbles are refused, naming ``--dequantize``."""
    tensors = _released()
    bound = with_fp8(partial(adapter, config={}), dequantize=True)
    assert bound is not None
    rules = bound(tensors)
    titan = "layers.0.moe.routed_experts.inner_experts."
    assert sorted(rules) == sorted(titan + k for k in ("mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED"))
    w1 = rules[titan + "mlp1_weight_EGD"]
    assert w1.shape == (4, 128, 64) and w1.dtype == torch.float32 and w1.view is None  # built by expert
    blocks, scales = w1.inputs
    assert blocks.rows is not None and scales.rows is not None
    assert blocks.fqn.endswith("gate_up_proj_blocks") and scales.fqn.endswith("gate_up_proj_scales")
    assert list(blocks.rows(1, 3)) == [1, 2] == list(scales.rows(1, 3))  # an output block of experts 1, 2: theirs
    g = torch.Generator().manual_seed(1)
    nibbles = torch.randint(0, 256, (4, 128, 2, 16), generator=g, dtype=torch.uint8)
    exps = torch.randint(120, 135, (4, 128, 2), generator=g, dtype=torch.uint8)
    assert torch.equal(bits(w1.compute([nibbles, exps])), bits(torch_reader(nibbles, exps, torch.float32)))
    with pytest.raises(UnsupportedTransformError, match=r"gate_up_proj_blocks: .*MXFP4.*--dequantize"):
        adapter([t for t in tensors if not t.fqn.endswith("_scales")], {})
