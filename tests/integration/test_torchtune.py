"""torchtune 0.6.1's distributed checkpoints: named, consolidated to the run's truth, resharded for its loader, exported to HF.

One 2-rank run of torchtune's own recipe components (``tests/_torchtune.py``: ``shard_model``,
``CheckpointClient`` with asynchronous checkpointing, ``DistributedCheckpointer``) feeds every test
here; its truth is torchtune's own ``gather_cpu_state_dict`` / ``get_full_optimizer_state_dict``
of the same run. The 3-rank load is torchtune's ``CheckpointClient.load_distributed_checkpoint``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli.app import app
from tests import _torchtune as tt
from tests._compare import assert_same_state
from tests._dist import run_ranks
from tests._producers import TRUTH

EPOCH_0 = f"{tt.OUTPUT}/dist_epoch_0"
PROGRESS = ("seed", "epochs_run", "total_epochs", "max_steps_per_epoch")


@pytest.fixture(scope="module")
def torchtune_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's folder: ``base/model.pt``, ``output/dist_epoch_0/`` (torchtune's own save), ``truth.pt``."""
    tt.preload()
    out = tmp_path_factory.mktemp("torchtune_run")
    run_ranks(tt.torchtune_run, 2, out)
    return out


def _truth(run: Path) -> dict[str, Any]:
    return torch.load(run / TRUTH, weights_only=True)  # type: ignore[no-any-return]


def test_inspect_names_torchtune_and_reads_output_as_its_newest_epoch(torchtune_run: Path, tmp_path: Path) -> None:
    """``inspect`` says ``torchtune`` of ``dist_epoch_0/`` and of ``output/`` (read as its newest
    ``dist_epoch_<n>``, by epoch number as torchtune picks it: 10 after 9); two folders of the newest
    epoch are one line naming both, exit 3."""
    for path in (torchtune_run / EPOCH_0, torchtune_run / tt.OUTPUT):
        info = fsdp_convert.inspect_checkpoint(path)
        assert (info.producer, info.world_size) == ("torchtune", 2), path
    output = tmp_path / "output"
    for epoch in (9, 10):
        shutil.copytree(torchtune_run / EPOCH_0, output / f"dist_epoch_{epoch}")
    result = CliRunner().invoke(app, ["inspect", str(output), "--json"])
    assert result.exit_code == 0, result.stderr
    assert Path(json.loads(result.stdout)["checkpoint"]).name == "dist_epoch_10"
    shutil.copytree(torchtune_run / EPOCH_0, output / "dist_epoch_010")
    result = CliRunner().invoke(app, ["inspect", str(output)])
    assert result.exit_code == 3
    assert result.stderr.strip().splitlines() == [
        f"error: {output} has no .metadata; its newest epoch 10 is in dist_epoch_010, dist_epoch_10: pass one"
    ]


def test_consolidate_is_torchtunes_full_state_bit_for_bit(torchtune_run: Path, tmp_path: Path) -> None:
    """``consolidate`` of ``output/`` gives the run's model and its id-keyed optimizer state as
    torchtune's own full-state calls give them, bit for bit, beside its progress keys."""
    truth = _truth(torchtune_run)
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(torchtune_run / tt.OUTPUT, out, nproc=1, verify_output=True)
    got = torch.load(out, weights_only=True)
    assert list(got)[:2] == ["model", "optimizer"]
    assert set(got) == {"model", "optimizer", *PROGRESS, "dataloader"}
    assert {k: got[k] for k in PROGRESS} == {k: truth["progress"][k] for k in PROGRESS}
    assert got["dataloader"] == truth["progress"]["dataloader"]
    assert all(isinstance(key, int) for key in got["optimizer"]["state"])
    n = assert_same_state({"model": got["model"], "optimizer": got["optimizer"]}, {k: truth[k] for k in ("model", "optimizer")})
    assert n == len(truth["model"]) + 3 * len(truth["optimizer"]["state"])
    # read by a plain model and optimizer's own load_state_dict
    torch.manual_seed(0)
    model = tt.tiny_llama()
    model.load_state_dict(got["model"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    optim.load_state_dict(got["optimizer"])
    assert_same_state(
        {"model": model.state_dict(), "optimizer": optim.state_dict()}, {k: truth[k] for k in ("model", "optimizer")}
    )


def test_reshard_loads_in_torchtunes_own_client_at_three_ranks(torchtune_run: Path, tmp_path: Path) -> None:
    """``reshard output/ NEW/dist_epoch_0 --world-size 3``: torchtune's
    ``CheckpointClient.load_distributed_checkpoint`` at 3 ranks, with ``NEW`` as its output_dir,
    finds it and holds the run's model, optimizer state and progress."""
    target = tmp_path / "ws3" / "dist_epoch_0"
    target.parent.mkdir()  # OUT's folder exists, as cp asks
    result = CliRunner().invoke(app, ["reshard", str(torchtune_run / tt.OUTPUT), str(target), "--world-size", "3"])
    assert result.exit_code == 0, result.stderr
    assert fsdp_convert.inspect_checkpoint(target).world_size == 3
    run_ranks(tt.torchtune_load, 3, torchtune_run, target.parent)


def test_torchtune_llama_to_hf_is_tune_to_hf_and_loads_in_transformers(torchtune_run: Path, tmp_path: Path) -> None:
    """``--adapter torchtune-llama-to-hf`` writes exactly what torchtune's ``tune_to_hf`` makes of the
    run's model (q/k permuted), and ``LlamaForCausalLM.from_pretrained`` gives the trained torchtune
    model's logits."""
    from torchtune.models.convert_weights import tune_to_hf
    from transformers import LlamaForCausalLM

    truth = _truth(torchtune_run)
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(tt.hf_config()))
    hf = tmp_path / "hf"
    args = ["consolidate", str(torchtune_run / EPOCH_0), str(hf), "--adapter", "torchtune-llama-to-hf"]
    result = CliRunner().invoke(app, [*args, "--hf-assets", str(assets), "--nproc", "1"])
    assert result.exit_code == 0, result.stderr

    want = tune_to_hf(dict(truth["model"]), num_heads=tt.HEADS, num_kv_heads=tt.KV_HEADS, dim=tt.DIM)
    got = load_file(hf / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert_same_state({k: got[k] for k in want}, want)

    tokens = tt.tokens(777)[:, :-1]
    model = tt.tiny_llama()
    model.load_state_dict(truth["model"])
    hf_model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected, logits = model.eval()(tokens), hf_model(tokens).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
