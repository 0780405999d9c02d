"""consolidate on real FSDP2 checkpoints, checked bitwise against the same run's full state dict."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import fsdp_convert
from tests._compare import assert_same_state
from tests.conftest import Sample


def test_consolidate_pt_equals_ground_truth(fsdp2_ckpt: Sample, tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    result = fsdp_convert.consolidate(fsdp2_ckpt.checkpoint, out)
    got = torch.load(out, weights_only=True, mmap=True)
    want = fsdp2_ckpt.truth()
    n = assert_same_state(got, want)
    # every model tensor, and exp_avg/exp_avg_sq/step for every parameter
    assert n == len(want["model"]) * 4 == result.tensors
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
    assert got["model"]["tok_embeddings.weight"].dtype == fsdp2_ckpt.dtype
    assert got["optim"]["state"]["logit_scale"]["step"].shape == ()


def test_consolidate_covers_awkward_shapes(fsdp2_ckpt: Sample) -> None:
    """The fixtures really contain the cases the tests claim to cover."""
    index = fsdp_convert.inspect_checkpoint(fsdp2_ckpt.checkpoint)
    rows = {e.fqn: e for e in index.entries}
    assert index.world_size == fsdp2_ckpt.world_size
    assert rows["model.tok_embeddings.weight"].shape[0] % fsdp2_ckpt.world_size != 0
    assert rows["model.logit_scale"].shape == (1,) and rows["model.logit_scale"].chunks >= 2
    assert rows["optim.state.logit_scale.step"].shape == ()


def test_consolidate_safetensors_holds_model_weights(fsdp2_ckpt: Sample, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    fsdp_convert.consolidate(fsdp2_ckpt.checkpoint, out)
    want = fsdp2_ckpt.truth()["model"]
    got = load_file(out)
    assert sorted(got) == sorted(want)
    for fqn, tensor in want.items():
        assert got[fqn].dtype == tensor.dtype and torch.equal(got[fqn], tensor), fqn
    with safe_open(out, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert list(f.keys()) == sorted(want)


@pytest.mark.parametrize("only", ["model", "optim"])
def test_consolidate_only_one_group(ws3_ckpt: Sample, tmp_path: Path, only: str) -> None:
    out = tmp_path / f"{only}.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, out, only=only)  # type: ignore[arg-type]
    got = torch.load(out, weights_only=True)
    assert list(got) == [only]
    assert_same_state(got[only], ws3_ckpt.truth()[only])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ws3_fp32", "ws3_bf16"])
def test_consolidate_nproc2_is_byte_identical_to_nproc1(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    sample: Sample = request.getfixturevalue("ws3_ckpt" if name == "ws3_fp32" else "ws3_bf16_ckpt")
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    fsdp_convert.consolidate(sample.checkpoint, one, nproc=1)
    result = fsdp_convert.consolidate(sample.checkpoint, two, nproc=2)
    assert result.nproc == 2
    assert one.read_bytes() == two.read_bytes()
    assert_same_state(torch.load(two, weights_only=True), sample.truth())
