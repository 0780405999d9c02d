"""Issue 37 N5: a claimed shape with a zero-size dimension cannot multiply the output count.

A tensor of shape ``[10**6, 0, 2]`` holds no bytes, so a 3 KB checkpoint may claim it; split on
dim 0 (``--unstack-layers``, an adapter's expert split) it made 1,000,001 output tensors (114 s,
3.4 GB). A split now writes at most ``max(transform.unstack.MAX_EMPTY_SPLIT, the tensor's bytes)`` pieces:
every real split gives each piece at least a byte, so the output count stays bounded by the bytes
read; past it, one line names the FQN.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fsdp_convert
from fsdp_convert.errors import UnsupportedTransformError
from fsdp_convert.transform.unstack import MAX_EMPTY_SPLIT, check_split

from ._attack import RSS_BOUND_BYTES, SECONDS_BOUND, attack

_CLAIMED = (10**6, 0, 2)
_STACKED = "decoder.layers.mlp.linear_fc2.weight"
_EXPERTS = "layers.0.moe.routed_experts.inner_experts.w1_EFD"


def _save(root: Path, state: dict[str, object]) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=root, no_dist=True)
    return root


def _megatron(root: Path, shape: tuple[int, ...]) -> Path:
    """A Megatron-Core torch_dist-like folder: a stacked layer tensor, common.pt and metadata.json beside."""
    _save(root, {_STACKED: torch.empty(shape), "embedding.word_embeddings.weight": torch.ones(4, 2)})
    torch.save({}, root / "common.pt")
    (root / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return root


def _check(result_code: int | None, error_lines: list[str], fqn: str) -> None:
    assert result_code == 1, error_lines
    assert len(error_lines) == 1 and fqn in error_lines[0], error_lines


def test_unstack_of_a_claimed_empty_stack_is_refused(tmp_path: Path) -> None:
    """--unstack-layers of [10**6, 0, 2]: one line naming the FQN, fast and small (was 1,000,001 tensors, 114 s)."""
    ckpt = _megatron(tmp_path / "ckpt", _CLAIMED)
    assert sum(p.stat().st_size for p in ckpt.iterdir()) < 16_000
    result = attack(["consolidate", ckpt, tmp_path / "out.pt", "--unstack-layers"], timeout=30)
    _check(result.code, result.error_lines, _STACKED)
    assert "1000000" in result.error_lines[0]
    assert result.seconds < SECONDS_BOUND and result.max_rss_bytes < RSS_BOUND_BYTES
    assert not (tmp_path / "out.pt").exists()


def test_qwen3_expert_split_of_a_claimed_empty_stack_is_refused(tmp_path: Path) -> None:
    """The qwen3 adapter's expert split of [10**6, 0, 2]: one line naming the FQN (was 1,000,002 tensors, 2.3 GB)."""
    ckpt = _save(tmp_path / "ckpt", {"model": {_EXPERTS: torch.empty(_CLAIMED), "tok_embeddings.weight": torch.ones(4, 2)}})
    out = tmp_path / "out.safetensors"
    result = attack(["consolidate", ckpt, out, "--adapter", "torchtitan-qwen3-to-hf"], timeout=30)
    _check(result.code, result.error_lines, _EXPERTS)
    assert result.seconds < SECONDS_BOUND and result.max_rss_bytes < RSS_BOUND_BYTES
    assert not out.exists()


def test_a_few_empty_layers_still_unstack(tmp_path: Path) -> None:
    """A zero-size stacked tensor of a few layers (a real model's empty buffer) is still split, one empty tensor per layer."""
    ckpt = _megatron(tmp_path / "ckpt", (3, 0, 2))
    fsdp_convert.consolidate(ckpt, tmp_path / "out.pt", options=fsdp_convert.TransformOptions(unstack_layers=True))
    model = torch.load(tmp_path / "out.pt", weights_only=True)["model"]
    assert [tuple(model[f"decoder.layers.{i}.mlp.linear_fc2.weight"].shape) for i in range(3)] == [(0, 2)] * 3


def test_check_split_bound() -> None:
    """Up to max(MAX_EMPTY_SPLIT, bytes) pieces pass; an empty tensor past MAX_EMPTY_SPLIT is refused, naming it."""
    check_split("w", (MAX_EMPTY_SPLIT, 0, 2), torch.float32, MAX_EMPTY_SPLIT, "layers")
    check_split("w", (10**6, 1), torch.uint8, 10**6, "layers")  # a byte a piece: bounded by the bytes read
    with pytest.raises(UnsupportedTransformError, match=r"^w: .*1025"):
        check_split("w", (MAX_EMPTY_SPLIT + 1, 0, 2), torch.float32, MAX_EMPTY_SPLIT + 1, "layers")


@pytest.mark.parametrize(
    ("adapter", "fqn", "shape", "config"),
    [
        ("megatron", "decoder.layers.self_attention.linear_qkv.weight", (4, 6 * 10**6, 0), {"num_hidden_layers": 4}),
        ("megatron", "decoder.layers.mlp.linear_fc2.weight", _CLAIMED, {"num_hidden_layers": 10**6}),
        ("llama3", "layers.0.attention.qkv_linear.wqkv.weight", (6 * 10**7, 0), {}),
        ("qwen3", _EXPERTS, _CLAIMED, {}),
    ],
)
def test_adapters_bound_a_claimed_empty_split(adapter: str, fqn: str, shape: tuple[int, ...], config: dict[str, int]) -> None:
    """Each built-in split (layers, listed rows, experts) refuses a zero-byte tensor's claimed count before listing it."""
    import importlib
    import time

    from fsdp_convert.derive import TensorInfo

    module = importlib.import_module(f"fsdp_convert.adapters.{adapter}")
    start = time.monotonic()
    with pytest.raises(UnsupportedTransformError, match=f"^{fqn}: "):
        module.to_hf([TensorInfo(fqn, torch.bfloat16, shape)], {"num_attention_heads": 4, "num_key_value_heads": 2, **config})
    assert time.monotonic() - start < 1.0
