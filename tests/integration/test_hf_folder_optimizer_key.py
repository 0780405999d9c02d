"""A Hugging Face folder consolidated from a checkpoint whose optimizer sits under ``optimizer`` verifies equal.

The folder's ``optimizer.pt`` holds the optimizer state dict itself (no key), read back as
``optim``; Lightning Fabric (like accelerate, torchtitan and Megatron-Core) saves it under
``optimizer``, which consolidate's producer layout keeps. ``verify`` reads the folder's optimizer
under the other side's key, so ``consolidate --verify`` and ``verify CKPT OUT --as-consolidated``
compare it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

from fsdp_convert.cli.app import app
from fsdp_convert.output_table import EXTRA_STATE_FILENAME, OPTIMIZER_FILENAME
from tests._compare import assert_same_state


def test_folder_of_an_optimizer_key_checkpoint_verifies(runner: CliRunner, lightning_run: Path, tmp_path: Path) -> None:
    """``consolidate --verify`` to a folder exits 0 and the folder holds the run's state; ``verify`` agrees both ways."""
    ckpt, out, resharded = lightning_run / "lightning_fsdp2", tmp_path / "hf", tmp_path / "ws3"
    truth = torch.load(lightning_run / "lightning_fsdp2/truth.pt", weights_only=True)

    done = runner.invoke(app, ["consolidate", str(ckpt), str(out), "--verify", "--nproc", "1"])
    assert done.exit_code == 0, done.output
    assert assert_same_state(torch.load(out / OPTIMIZER_FILENAME, weights_only=True), truth["optim"]) > 0
    assert "step" in torch.load(out / EXTRA_STATE_FILENAME, weights_only=True)  # meta.pt's, merged
    for a, b in ((ckpt, out), (out, ckpt)):  # the DCP side as consolidate writes it: meta.pt's step merged
        checked = runner.invoke(app, ["verify", str(a), str(b), "--as-consolidated"])
        assert checked.exit_code == 0, checked.output

    # the folder resharded (a full-file input) holds what consolidate wrote
    done = runner.invoke(app, ["reshard", str(out), str(resharded), "--world-size", "3"])
    assert done.exit_code == 0, done.output
    checked = runner.invoke(app, ["verify", str(out), str(resharded)])
    assert checked.exit_code == 0, checked.output
