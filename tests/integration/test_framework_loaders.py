"""Each producer's own loader reads what ``reshard`` and ``consolidate`` write, at a new world size.

The checkpoints come from the frameworks' own training and save calls (``tests/_frameworks.py``:
accelerate's ``save_state``, Lightning Fabric's ``fabric.save``, 2 ranks). Each loader here is the
framework's own resume code, at 3 forked gloo ranks (one launch per framework, every check inside
it) or, for a consolidated file, in one plain process; the state it loads is compared bit for bit
with the run's ``truth.pt``. torchtitan's ``CheckpointManager`` loading a 3-rank reshard is
``test_reshard_oracles.test_torchtitan_reshard_loads_the_way_torchtitan_loads_at_three_ranks``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli.app import app
from tests._compare import assert_same_state
from tests._dist import run_ranks
from tests._frameworks import accelerate_load, fabric_plain_load, lightning_load, preload

TARGET = 3  # the frameworks saved at 2
LIGHTNING = ("lightning_fsdp1", "lightning_fsdp2")


def _in_order_of(got: Any, want: Any) -> Any:
    """``got`` with every dict's keys in ``want``'s order, where both have the same keys.

    Lightning's reading follows ``.metadata``'s storage order, in which FSDP1 lists a parameter's
    ``step`` last; ``consolidate`` follows the order the run's state dict had (``planner_data``,
    ``step`` first, as ``get_optimizer_state_dict`` gives it). The keys must still be the same.
    """
    if isinstance(got, dict) and isinstance(want, dict):
        assert sorted(map(str, got)) == sorted(map(str, want)), (list(got), list(want))
        return {k: _in_order_of(got[k], want[k]) for k in want}
    return got


def test_accelerate_reshard_loads_with_accelerates_load_state_at_three_ranks(
    runner: CliRunner, accelerate_run: Path, tmp_path: Path
) -> None:
    """``reshard`` of accelerate's ``save_state`` folder writes the same two DCP folders for 3
    ranks, copies the files that hold at any world size (here a scheduler's) byte for byte, and
    leaves the per-rank RNG pickles out unread, saying so on stderr and in ``--json``;
    accelerate's own ``load_state`` at 3 ranks then holds the run's model and optimizer state."""
    from tests.cli.test_bad_inputs import Evil

    src = tmp_path / "accelerate"
    shutil.copytree(accelerate_run / "accelerate", src, ignore=shutil.ignore_patterns("truth.pt"))
    (src / "scheduler.bin").write_bytes(b"scheduler state, copied unread")
    marker = tmp_path / "pwned"
    torch.save(Evil(marker), src / "random_states_0.pkl")
    out = tmp_path / "ws3"
    result = runner.invoke(app, ["reshard", str(src), str(out), "--world-size", str(TARGET), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["folders"] == ["pytorch_model_fsdp_0", "optimizer_0"]
    assert doc["copied"] == ["scheduler.bin"]
    assert doc["left_out"] == ["random_states_0.pkl", "random_states_1.pkl"]
    note = "note: left out random_states_0.pkl, random_states_1.pkl: accelerate's per-rank RNG states"
    assert result.stderr.startswith(note) and len(result.stderr.splitlines()) == 1, result.stderr
    assert doc["notes"] == [result.stderr.strip().removeprefix("note: ")]
    assert not marker.exists()
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        *(f"optimizer_0/{f}" for f in (".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp")),
        *(f"pytorch_model_fsdp_0/{f}" for f in (".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp")),
        "scheduler.bin",
    ]
    assert (out / "scheduler.bin").read_bytes() == (src / "scheduler.bin").read_bytes()
    info = fsdp_convert.inspect_checkpoint(out)
    assert (info.producer, info.world_size) == ("accelerate", TARGET)

    preload("accelerate")
    run_ranks(accelerate_load, TARGET, out, accelerate_run / "accelerate/truth.pt")


def test_lightning_reshard_and_consolidate_load_with_fabric_at_three_ranks(lightning_run: Path, tmp_path: Path) -> None:
    """Lightning Fabric's FSDP1 and FSDP2 checkpoints, resharded to 3 (``meta.pt`` copied byte for
    byte: ``fabric.load`` refuses a folder without it) and consolidated by default (one file, the
    form Fabric's full-checkpoint path reads), each load with ``fabric.load`` under the same
    strategy at 3 ranks, which returns ``{"step"}`` and holds the run's model and optimizer state."""
    sources: dict[str, list[Path]] = {}
    for name in LIGHTNING:
        src = lightning_run / name
        out = tmp_path / f"{name}_ws3"
        result = fsdp_convert.reshard(src, out, world_size=TARGET)
        assert result.copied == ("meta.pt",)
        assert (out / "meta.pt").read_bytes() == (src / "meta.pt").read_bytes()
        assert result.left_out == ("truth.pt",)  # the test's own file, beside the checkpoint
        full = tmp_path / f"{name}.pt"
        fsdp_convert.consolidate(src, full)
        sources[name] = [out, full]
    preload("lightning")
    run_ranks(lightning_load, TARGET, sources, lightning_run)


@pytest.mark.parametrize("name", LIGHTNING)
def test_lightning_consolidate_is_lightnings_own_and_loads_in_one_process(
    runner: CliRunner, lightning_run: Path, tmp_path: Path, name: str
) -> None:
    """By default ``consolidate`` writes what Lightning's own ``consolidate_checkpoint`` writes
    (``{"model", "optimizer", "step"}``: ``meta.pt`` merged), equal in every key, order, value and
    tensor bit; a plain single-process ``fabric.load`` reads it as the run. ``--layout nested``
    gives the uniform form instead: ``{"model", "optim"}``, ``meta.pt`` left out."""
    preload("lightning")
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    src = lightning_run / name
    full = tmp_path / "full.pt"
    fsdp_convert.consolidate(src, full, nproc=1, verify_output=True)
    ours = torch.load(full, weights_only=True)
    lightnings = _load_distributed_checkpoint(src)
    assert list(ours) == ["model", "optimizer", "step"]
    n_tensors = len(ours["model"]) + 3 * len(ours["optimizer"]["state"])
    assert assert_same_state(_in_order_of(ours, lightnings), lightnings) == n_tensors
    fabric_plain_load(full, src / "truth.pt")

    nested = tmp_path / "nested.pt"
    result = runner.invoke(app, ["consolidate", str(src), str(nested), "--layout", "nested", "--nproc", "1"])
    assert result.exit_code == 0, result.stderr
    uniform = torch.load(nested, weights_only=True)
    assert list(uniform) == ["model", "optim"]
    assert_same_state(uniform, {"model": ours["model"], "optim": ours["optimizer"]})
