"""``--unstack-layers`` on Megatron-Core 0.16.1 ``torch_dist`` checkpoints: per-layer tensors, bit for bit.

The run is ``tests/_megatron.py``'s (a Llama-style ``GPTModel`` at tensor parallel 2 on 2 gloo
ranks, ``FP32Optimizer``, ``dist_checkpointing.save(..., ("torch_dist", 1))``); its ``truth.pt``
holds the full tensors in the checkpoint's keys, ``decoder.layers.<name>`` stacked ``(L, ...)``.
Unstacked, layer ``i`` of each, model and optimizer moments alike, must be ``truth[...][i]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli._precheck import check_unstack
from fsdp_convert.cli.app import app
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.transform import TransformOptions
from tests import _megatron
from tests._cli_probe import cli_probe
from tests._compare import assert_same_state

LAYERS = "decoder.layers."


def _unstacked(stacked: dict[str, Any]) -> dict[str, Any]:
    """``stacked`` with each ``decoder.layers.<name>`` value (a tensor, or a dict of them) as ``decoder.layers.<i>.<name>``."""
    out: dict[str, Any] = {}
    for key, value in stacked.items():
        if not key.startswith(LAYERS):
            out[key] = value
            continue
        name = key.removeprefix(LAYERS)
        layers = (value if isinstance(value, torch.Tensor) else next(iter(value.values()))).shape[0]
        for i in range(layers):
            out[f"{LAYERS}{i}.{name}"] = value[i] if isinstance(value, torch.Tensor) else {k: v[i] for k, v in value.items()}
    return dict(sorted(out.items()))


def test_unstack_layers_consolidates_each_layer_bit_for_bit(runner: CliRunner, megatron_run: Path, tmp_path: Path) -> None:
    """``consolidate --unstack-layers`` (a small ``--memory-budget``, ``--verify``) writes each stacked
    ``decoder.layers.<name>`` of shape ``(L, ...)`` as ``L`` tensors ``decoder.layers.<i>.<name>``,
    equal to the run's stacked tensor's ``i``-th slice bit for bit; each optimizer moment follows its
    parameter; unstacked keys only, and the other keys as saved."""
    truth = torch.load(megatron_run / _megatron.TRUTH, weights_only=True)
    stacked = [k for k in truth["model"] if k.startswith(LAYERS)]
    assert stacked and all(truth["model"][k].shape[0] == 2 for k in stacked)  # two layers, stacked
    out = tmp_path / "full.pt"
    args = ["consolidate", str(megatron_run / _megatron.CHECKPOINT), str(out), "--unstack-layers"]
    result = runner.invoke(app, [*args, "--memory-budget", "1MiB", "--verify", "--json"])
    assert result.exit_code == 0, result.stderr
    got = torch.load(out, weights_only=True)
    want_model = _unstacked(truth["model"])
    assert len(want_model) == len(truth["model"]) + len(stacked)
    assert assert_same_state(dict(sorted(got["model"].items())), want_model) == len(want_model)
    state = {k: v for k, v in got["optimizer"]["state"].items() if k != "common_step"}
    want_state = _unstacked(truth["optimizer_state"])
    assert assert_same_state(dict(sorted(state.items())), want_state) == 2 * len(want_model)
    assert_same_state(got["optimizer"]["param_groups"], truth["param_groups"])
    assert got["iteration"] == _megatron.STEPS


def test_unstack_layers_reshard_writes_per_layer_keys(runner: CliRunner, megatron_run: Path, tmp_path: Path) -> None:
    """``reshard --unstack-layers --world-size 3`` writes the per-layer keys (optimizer state as
    Megatron's flat ``optimizer.state.<name>.decoder.layers.<i>.<name>``), each cut for 3 ranks;
    consolidated back, each equals the stacked truth's slice bit for bit."""
    truth = torch.load(megatron_run / _megatron.TRUTH, weights_only=True)
    out = tmp_path / "ws3"
    args = ["reshard", str(megatron_run / _megatron.CHECKPOINT), str(out), "--world-size", "3", "--unstack-layers"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert fsdp_convert.inspect_checkpoint(out).world_size == 3
    meta = dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata
    assert len(meta[f"{LAYERS}0.self_attention.linear_qkv.weight"].chunks) == 3  # type: ignore[union-attr]
    assert f"optimizer.state.exp_avg.{LAYERS}1.mlp.linear_fc2.weight" in meta
    assert f"{LAYERS}self_attention.linear_qkv.weight" not in meta
    full = tmp_path / "full.pt"
    result = runner.invoke(app, ["consolidate", str(out), str(full)])
    assert result.exit_code == 0, result.stderr
    got = torch.load(full, weights_only=True)
    want_model = _unstacked(truth["model"])
    assert assert_same_state(dict(sorted(got["model"].items())), want_model) == len(want_model)
    state = {k: v for k, v in got["optimizer"]["state"].items() if k != "common_step"}
    assert assert_same_state(dict(sorted(state.items())), _unstacked(truth["optimizer_state"])) == 2 * len(want_model)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--unstack-layers: {ckpt} is a dcp checkpoint, whose layers are not stacked"),
        (["--optim-keys", "ids"], "--unstack-layers names each layer's optimizer state; use --optim-keys names"),
        (["--adapter", "megatron-gpt-to-hf"], "--unstack-layers and --adapter exclude each other"),
    ],
)
def test_unstack_layers_refused_in_one_line(runner: CliRunner, tmp_path: Path, extra: list[str], message: str) -> None:
    """A producer that stacks no layers (a plain DCP save), ``--optim-keys ids`` or ``--adapter``:
    ``--unstack-layers`` is a usage error (exit 2) in one line, and nothing is written."""
    ckpt = tmp_path / "plain"
    dcp.save({"decoder.layers.w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=ckpt, no_dist=True)
    out = tmp_path / "full.pt"
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(_megatron.hf_config()))
    extra = [*extra, "--model-config", str(cfg)] if "--adapter" in extra else extra
    result = runner.invoke(app, ["consolidate", str(ckpt), str(out), "--unstack-layers", *extra])
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith("error: " + message.format(ckpt=ckpt)), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


def _unstack_error(**kwargs: Any) -> str:
    with pytest.raises(InvalidOptionError) as caught:
        TransformOptions(unstack_layers=True, **kwargs)
    return caught.value.cli_text()


def test_unstack_layers_precheck_is_the_librarys_rule_before_torch() -> None:
    """``cli._precheck.check_unstack`` refuses what ``TransformOptions`` refuses, in the same words,
    and the CLI says it before importing torch (a fresh interpreter; no checkpoint needed)."""
    for adapter, keys in ((None, "ids"), ("megatron-gpt-to-hf", "names")):
        with pytest.raises(InvalidOptionError) as caught:
            check_unstack(True, keys, adapter)
        library = _unstack_error(optim_keys=keys, adapter=None if adapter is None else (lambda infos: {}))
        assert caught.value.cli_text() == library
    check_unstack(True, "names", None)
    check_unstack(False, "ids", "megatron-gpt-to-hf")
    with pytest.raises(InvalidOptionError, match="expected True or False"):
        TransformOptions(unstack_layers="yes")  # type: ignore[arg-type]
    argv = ["reshard", "nowhere", "out", "--world-size", "2", "--unstack-layers", "--optim-keys", "ids"]
    report, stderr = cli_probe(argv, timeout=120)
    assert report == {"code": 2, "modules": []}, stderr
    assert stderr.startswith("error: --unstack-layers names each layer's optimizer state"), stderr
