"""The DeepSpeed fixture's ``truth.pt`` agrees with DeepSpeed's own readers of its checkpoints.

``deepspeed_runs`` (``tests/_deepspeed.py``) trains every variant at 2 and 3 ranks and takes the truth
from the live run; here DeepSpeed's ``zero_to_fp32`` and its ``engine.load_checkpoint`` read the
files back and must find that truth bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._deepspeed import VARIANTS, load_launches

pytestmark = pytest.mark.slow

FROZEN = {"frozen.weight", "frozen.bias"}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "bfo"])
def test_zero_to_fp32_matches_truth(deepspeed_runs: dict[int, Path], variant: str, world_size: int) -> None:
    """DeepSpeed's consolidation equals truth["model"] on every key it returns (a buffer it casts: as cast)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # type: ignore[import-untyped,unused-ignore]

    run = deepspeed_runs[world_size] / variant
    truth = torch.load(run / "truth.pt", weights_only=True)
    assert truth["world_size"] == world_size and truth["global_steps"] == 2 and truth["client"] == {"mine": 7}
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(run))

    assert set(consolidated) <= set(truth["model"])
    missing = set(truth["model"]) - set(consolidated)
    assert missing <= FROZEN and (truth["stage"] == 1 or not missing), missing  # ZeRO-1 saves no frozen fragments
    assert {"emb.weight", "head.weight", "scale", "positions"} <= set(consolidated)
    for fqn, got in consolidated.items():
        want = truth["model"][fqn]
        if got.dtype != want.dtype:
            assert got.dtype == torch.float32, fqn
            want = want.float()
        assert got.shape == want.shape and torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), fqn


def test_zero_to_fp32_refuses_bf16_optimizer(deepspeed_runs: dict[int, Path]) -> None:
    """BF16_Optimizer saves ``bf16_zero_pp_rank_*`` files, which ``zero_to_fp32`` does not read."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # type: ignore[import-untyped,unused-ignore]

    run = deepspeed_runs[3] / "bfo"
    assert torch.load(run / "truth.pt", weights_only=True)["optimizer_class"] == "BF16_Optimizer"
    with pytest.raises(ValueError, match="is not a zero checkpoint"):
        get_fp32_state_dict_from_zero_checkpoint(str(run))


@pytest.fixture(scope="module")
def same_size_loads(deepspeed_runs: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One launch at 3 ranks: DeepSpeed's own resume of its ZeRO-1 and ZeRO-3 bf16 saves, and of a 2-rank ZeRO-1 save."""
    cases = [(v, deepspeed_runs[ws] / v, deepspeed_runs[ws] / v / "truth.pt") for v, ws in (("z1", 3), ("z3b", 3), ("z1", 2))]
    return load_launches(tmp_path_factory.mktemp("ds-load"), {3: cases})[3]


@pytest.mark.parametrize("case", [0, 1])
def test_load_mode_finds_truth_at_the_same_world_size(same_size_loads: list[dict[str, Any]], case: int) -> None:
    """DeepSpeed's own resume (``engine.load_checkpoint``) at 3 ranks restores the truth bit for bit and trains on."""
    result = same_size_loads[case]
    assert result["ok"], result
    assert result["mismatches"] == [] and result["error"] is None


def test_load_mode_reports_a_refused_load(same_size_loads: list[dict[str, Any]]) -> None:
    """A ZeRO-1 save of 2 ranks loaded at 3: DeepSpeed refuses, and the load mode says so in its JSON."""
    result = same_size_loads[2]
    assert not result["ok"]
    assert "used a DP world size of 2 but the current world size is 3" in result["error"], result
