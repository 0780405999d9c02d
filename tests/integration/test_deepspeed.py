"""DeepSpeed ZeRO saves as a source: inspect, consolidate, reshard to DeepSpeed and to DCP, refusals.

The checkpoints are DeepSpeed 0.19.8's own saves of 9 variants at 2 and 3 ranks (``deepspeed_runs``,
``tests/_deepspeed.py``), each beside the live run's ``truth.pt``. The oracles are never this tool's
own reading: the live run's state, DeepSpeed's ``zero_to_fp32``, DeepSpeed's ``engine.load_checkpoint``
at the new world size (all the reshards of one size checked in one torchrun launch, both sizes at once),
and FSDP2's ``dcp.load`` + ``set_state_dict``.
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
from fsdp_convert.cli import app
from tests._compare import assert_same_state, same_bits
from tests._deepspeed import BIAS_LR, LR, TAG, TRUTH, VARIANTS, WEIGHT_DECAY, TinyLM, load_launches
from tests._dist import run_ranks
from tests._samples import Sample

pytestmark = pytest.mark.slow

DIRECTIONS = [(2, 3), (3, 2)]  # (source world size, target world size)
NOT_BFO = [v for v in VARIANTS if v != "bfo"]  # zero_to_fp32 refuses BF16_Optimizer's files


def _truth(run: Path) -> dict[str, Any]:
    truth: dict[str, Any] = torch.load(run / TRUTH, weights_only=True)
    return truth


def _zero_to_fp32(checkpoint: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's own consolidation of ``checkpoint`` (the tag ``latest`` names): ``{fqn: fp32 tensor}``."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # type: ignore[import-untyped,unused-ignore]

    state_dict: dict[str, torch.Tensor] = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    return state_dict


def _assert_equals_zero_to_fp32(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """``got`` equals DeepSpeed's ``reference`` bit for bit on every key it returns.

    ``zero_to_fp32`` returns everything as fp32: where ``got`` keeps a frozen parameter or buffer in the
    module's dtype (bf16), it must equal the reference once cast (bf16 to fp32 is exact).
    """
    assert set(reference) <= set(got), set(reference) - set(got)
    for fqn, want in reference.items():
        tensor = got[fqn]
        if tensor.dtype != want.dtype:
            assert want.dtype == torch.float32, (fqn, tensor.dtype, want.dtype)
            tensor = tensor.float()
        assert same_bits(tensor, want), fqn


def _expected_details(variant: str) -> dict[str, str]:
    stage, dtype, _ = VARIANTS[variant]
    return {
        "deepspeed": "BF16_Optimizer (ZeRO-1)" if dtype == "bf16o" else f"ZeRO-{stage}",
        "parameters": "float32" if dtype == "fp32" else "bfloat16",
        "master weights": "float32",
    }


# 1. inspect


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_inspect_names_stage_dtypes_and_shapes(deepspeed_runs: dict[int, Path], runner: CliRunner, variant: str) -> None:
    """``inspect --json`` of a 3-rank save: producer, world size, details, and every tensor's shape and dtype as the run's."""
    run = deepspeed_runs[3] / variant
    truth = _truth(run)
    result = runner.invoke(app, ["inspect", str(run), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["producer"] == "deepspeed" and doc["world_size"] == 3
    assert doc["details"] == _expected_details(variant)

    model = {e["fqn"]: e for e in doc["groups"]["model"]}
    assert set(model) == {f"model.{fqn}" for fqn in truth["model"]}  # the tied head.weight too
    for fqn, want in truth["model"].items():
        entry = model[f"model.{fqn}"]
        assert (tuple(entry["shape"]), entry["dtype"]) == (tuple(want.shape), str(want.dtype).removeprefix("torch.")), fqn

    optim = {e["fqn"]: e for e in doc["groups"]["optim"]}
    for fqn, moments in truth["optim"]["state"].items():
        for key, want in moments.items():
            entry = optim[f"optim.state.{fqn}.{key}"]
            assert (tuple(entry["shape"]), entry["dtype"]) == (tuple(want.shape), "float32"), (fqn, key)
    states = {fqn for fqn in optim if fqn.startswith("optim.state.")}
    assert len(states) == 3 * len(truth["optim"]["state"]), sorted(states)
    # the other model-states keys; a dict among them may be listed flattened (ds_config.zero_optimization.stage)
    others = {e["fqn"] for e in doc["groups"]["other"]}
    assert {"global_steps", "mine"} <= others and any(f.split(".")[0] == "ds_config" for f in others), sorted(others)


# 2. consolidate


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_consolidate_pt_equals_the_runs_state(
    deepspeed_runs: dict[int, Path], tmp_path: Path, variant: str, world_size: int
) -> None:
    """The .pt holds the run's masters, frozen params and buffers (their dtypes), AdamW state, param groups, client state."""
    run = deepspeed_runs[world_size] / variant
    truth = _truth(run)
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(run, out)
    got = torch.load(out, weights_only=True)

    assert set(got["model"]) == set(truth["model"])
    for fqn, want in truth["model"].items():
        assert same_bits(got["model"][fqn], want), (fqn, got["model"][fqn].dtype, want.dtype)
    assert set(got["optim"]) == {"state", "param_groups"}
    assert set(got["optim"]["state"]) == set(truth["optim"]["state"])
    for fqn, moments in truth["optim"]["state"].items():
        assert_same_state(got["optim"]["state"][fqn], moments, f"optim.state.{fqn}")
    assert got["optim"]["param_groups"] == truth["optim"]["param_groups"]
    assert got["global_steps"] == truth["global_steps"] == 2
    assert got["mine"] == truth["client"]["mine"] == 7

    if variant != "bfo":
        _assert_equals_zero_to_fp32(got["model"], _zero_to_fp32(run))


def test_consolidate_safetensors_keeps_both_tied_names(deepspeed_runs: dict[int, Path], tmp_path: Path) -> None:
    """Model weights alone: every key of the run's model, the tied embedding under both names."""
    run = deepspeed_runs[3] / "z3b"
    want = _truth(run)["model"]
    out = tmp_path / "model.safetensors"
    fsdp_convert.consolidate(run, out)
    got = load_file(out)
    assert sorted(got) == sorted(want)
    assert torch.equal(got["emb.weight"], got["head.weight"])
    for fqn, tensor in want.items():
        assert same_bits(got[fqn], tensor), fqn


def test_consolidate_verify_reads_the_pt_back(deepspeed_runs: dict[int, Path], runner: CliRunner, tmp_path: Path) -> None:
    """``consolidate --verify`` compares the .pt it wrote with the DeepSpeed save and keeps it."""
    run = deepspeed_runs[3] / "z3b"
    out = tmp_path / "full.pt"
    result = runner.invoke(app, ["consolidate", str(run), str(out), "--verify"])
    assert result.exit_code == 0, result.stderr
    assert same_bits(torch.load(out, weights_only=True)["model"]["l1.weight"], _truth(run)["model"]["l1.weight"])


@pytest.mark.parametrize("variant", ["z1b", "z2a", "bfo", "z1"])
def test_consolidate_weights_module_is_the_runs_module(deepspeed_runs: dict[int, Path], tmp_path: Path, variant: str) -> None:
    """``--weights module``: the model is the module's own state dict as the run held it (bf16 for a bf16 run), bit for
    bit, tied names and all; the optimizer state is the same as with the masters."""
    run = deepspeed_runs[3] / variant
    truth = _truth(run)
    out = tmp_path / "module.pt"
    fsdp_convert.consolidate(run, out, weights="module")
    got = torch.load(out, weights_only=True)
    assert set(got["model"]) == set(truth["module"])
    for fqn, want in truth["module"].items():
        assert same_bits(got["model"][fqn], want), (fqn, got["model"][fqn].dtype, want.dtype)
    for fqn, moments in truth["optim"]["state"].items():
        assert_same_state(got["optim"]["state"][fqn], moments, f"optim.state.{fqn}")


def test_weights_module_refused_for_zero3_and_other_checkpoints(
    deepspeed_runs: dict[int, Path], ws3_ckpt: Sample, runner: CliRunner, tmp_path: Path
) -> None:
    """ZeRO-3 saves no module weights (placeholders only), and a DCP checkpoint has one copy: one line each, nothing written."""
    for source, needles in (
        (deepspeed_runs[3] / "z3b", ("ZeRO-3", "--dtype bf16")),
        (ws3_ckpt.checkpoint, ("not a DeepSpeed save",)),
    ):
        out = tmp_path / "out.pt"
        result = runner.invoke(app, ["consolidate", str(source), str(out), "--weights", "module"])
        _assert_one_line_error(result, "--weights module", *needles)
        assert not out.exists()


# 3. reshard DeepSpeed -> DeepSpeed, checked by DeepSpeed's own loader


@pytest.fixture(scope="module")
def reshards(
    deepspeed_runs: dict[int, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[int, int], dict[str, Path | str]]:
    """Every variant resharded 2->3 and 3->2 (``--format auto``): ``{(src, dst): {variant: output, or the error's text}}``."""
    root = tmp_path_factory.mktemp("deepspeed_reshards")
    outputs: dict[tuple[int, int], dict[str, Path | str]] = {}
    for src, dst in DIRECTIONS:
        folder = root / f"{src}to{dst}"
        folder.mkdir()
        outputs[src, dst] = {}
        for variant in VARIANTS:
            try:
                fsdp_convert.reshard(deepspeed_runs[src] / variant, folder / variant, world_size=dst)
            except fsdp_convert.CheckpointError as e:  # that variant's tests fail with it; the others still run
                outputs[src, dst][variant] = f"{type(e).__name__}: {e}"
            else:
                outputs[src, dst][variant] = folder / variant
    return outputs


@pytest.fixture(scope="module")
def deepspeed_loads(
    deepspeed_runs: dict[int, Path],
    reshards: dict[tuple[int, int], dict[str, Path | str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[int, int], dict[str, dict[str, Any]]]:
    """DeepSpeed's ``load_checkpoint`` of every reshard at its target size against the source run's truth.

    One torchrun launch per target size, both at once: ``{(src, dst): {variant: load mode result}}``.
    """
    cases = {
        dst: [(v, out, deepspeed_runs[src] / v / TRUTH) for v, out in reshards[src, dst].items() if isinstance(out, Path)]
        for src, dst in DIRECTIONS
    }
    results = load_launches(tmp_path_factory.mktemp("deepspeed_loads"), cases, timeout=240)
    return {(src, dst): {r["variant"]: r for r in results[dst]} for src, dst in DIRECTIONS}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("src", "dst"), DIRECTIONS, ids=["2to3", "3to2"])
def test_reshard_lays_out_deepspeeds_own_files(
    deepspeed_runs: dict[int, Path], reshards: dict[tuple[int, int], dict[str, Path | str]], variant: str, src: int, dst: int
) -> None:
    """The output holds the files DeepSpeed's own save at the target size holds, and ``latest`` names the same tag."""
    out = reshards[src, dst][variant]
    assert isinstance(out, Path), out
    own = deepspeed_runs[dst] / variant
    assert (out / "latest").read_text() == (own / "latest").read_text() == TAG
    assert sorted(p.name for p in (out / TAG).iterdir()) == sorted(p.name for p in (own / TAG).iterdir())


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("src", "dst"), DIRECTIONS, ids=["2to3", "3to2"])
def test_reshard_deepspeed_loads_at_the_new_world_size(
    deepspeed_loads: dict[tuple[int, int], dict[str, dict[str, Any]]],
    reshards: dict[tuple[int, int], dict[str, Path | str]],
    variant: str,
    src: int,
    dst: int,
) -> None:
    """DeepSpeed's ``engine.load_checkpoint`` at the new size restores the source run bit for bit and trains a step.

    Checked: fp32 masters, frozen params and buffers, the module's own weights, AdamW's step/exp_avg/exp_avg_sq,
    param groups, ``global_steps``, client state. The engine starts from another seed, other buffers and
    other hyper-parameters, so only the load can make each right.
    """
    assert isinstance(reshards[src, dst][variant], Path), reshards[src, dst][variant]
    result = deepspeed_loads[src, dst][variant]
    assert result["error"] is None and result["mismatches"] == [] and result["ok"], result
    assert isinstance(result["loss"], float)


@pytest.mark.parametrize("variant", NOT_BFO)
@pytest.mark.parametrize(("src", "dst"), DIRECTIONS, ids=["2to3", "3to2"])
def test_reshard_zero_to_fp32_reads_the_source_runs_weights(
    deepspeed_runs: dict[int, Path], reshards: dict[tuple[int, int], dict[str, Path | str]], variant: str, src: int, dst: int
) -> None:
    """DeepSpeed's ``zero_to_fp32`` of the output gives the source run's weights (its second reader of the files)."""
    out = reshards[src, dst][variant]
    assert isinstance(out, Path), out
    _assert_equals_zero_to_fp32(_truth(deepspeed_runs[src] / variant)["model"], _zero_to_fp32(out))


# 4. reshard --format dcp, loaded by FSDP2


def _fsdp2_load(rank: int, world_size: int, checkpoint: Path, truth_path: Path) -> None:
    """FSDP2 at this world size loads ``checkpoint`` (DCP) into a fresh ``TinyLM`` and AdamW; rank 0 compares with the truth.

    The model starts from another seed with other buffers and the optimizer with other hyper-parameters, so
    only the load can make them right. The frozen Linear is its own FSDP2 unit in the truth's dtype (FSDP2
    gathers one dtype per unit; the bf16 variants keep it in bf16 beside fp32 masters).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.fsdp import fully_shard

    truth = torch.load(truth_path, weights_only=True)
    torch.manual_seed(1234)
    model = TinyLM()
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.add_(1)
    model.frozen.to(truth["model"]["frozen.weight"].dtype)
    fully_shard(model.frozen)
    fully_shard(model)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in trainable if n.endswith("weight")], "weight_decay": 3 * WEIGHT_DECAY},
        {"params": [p for n, p in trainable if not n.endswith("weight")], "weight_decay": 0.5, "lr": 3 * BIAS_LR},
    ]
    optim = torch.optim.AdamW(groups, lr=3 * LR)
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    got_model, got_optim = get_state_dict(model, optim, options=full)
    if rank == 0:
        assert_same_state(got_model, truth["model"], "model")
        assert_same_state(got_optim, truth["optim"], "optim")


@pytest.mark.parametrize("variant", ["z3b", "z1"])
def test_reshard_format_dcp_loads_into_fsdp2(
    deepspeed_runs: dict[int, Path], runner: CliRunner, tmp_path: Path, variant: str
) -> None:
    """``reshard --format dcp`` of a 3-rank save: FSDP2 at 3 ranks restores the run's masters, buffers and AdamW state."""
    run = deepspeed_runs[3] / variant
    out = tmp_path / "dcp"
    result = runner.invoke(app, ["reshard", str(run), str(out), "--world-size", "3", "--format", "dcp"])
    assert result.exit_code == 0, result.stderr
    assert (out / ".metadata").is_file() and not (out / "latest").exists()
    run_ranks(_fsdp2_load, 3, out, run / TRUTH)


# 5. refusals


def _assert_one_line_error(result: Any, *needles: str) -> None:
    assert result.exit_code != 0, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_format_deepspeed_refuses_a_dcp_source(ws3_ckpt: Sample, runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, ["reshard", str(ws3_ckpt.checkpoint), str(out), "--world-size", "2", "--format", "deepspeed"])
    _assert_one_line_error(result, "--format deepspeed", "DeepSpeed")
    assert not out.exists()


def test_reshard_to_deepspeed_refuses_rename(deepspeed_runs: dict[int, Path], runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, ["reshard", str(deepspeed_runs[3] / "z1"), str(out), "--world-size", "2", "--rename", "a=b"])
    _assert_one_line_error(result, "--rename", "--format dcp")
    assert not out.exists()


@pytest.mark.parametrize("command", ["inspect", "consolidate", "reshard"])
def test_missing_optimizer_file_is_named(
    deepspeed_runs: dict[int, Path], runner: CliRunner, tmp_path: Path, command: str
) -> None:
    save = tmp_path / "z2"
    shutil.copytree(deepspeed_runs[3] / "z2", save)
    missing = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (save / TAG / missing).unlink()
    out = tmp_path / "out.pt"
    extra = {"inspect": [], "consolidate": [str(out)], "reshard": [str(tmp_path / "out"), "--world-size", "2"]}[command]
    result = runner.invoke(app, [command, str(save), *extra])
    _assert_one_line_error(result, missing)
    assert not out.exists() and not (tmp_path / "out").exists()


def test_latest_naming_a_missing_tag_is_named(deepspeed_runs: dict[int, Path], runner: CliRunner, tmp_path: Path) -> None:
    save = tmp_path / "z2"
    shutil.copytree(deepspeed_runs[3] / "z2", save)
    (save / "latest").write_text("step9")
    result = runner.invoke(app, ["consolidate", str(save), str(tmp_path / "out.pt")])
    _assert_one_line_error(result, "step9")
