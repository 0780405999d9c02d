"""Every producer's checkpoint consolidates to its own run's ground truth, and the result loads anywhere.

torchtitan, accelerate and Lightning Fabric checkpoints come from the frameworks' own training and
save calls (tests/_frameworks.py); torch's HuggingFaceStorageWriter, a torch.compile'd state dict
and FSDP1 are torch's own (tests/_producers.py); verl's per-rank files are written as verl writes
them, verl itself not being installable here (tests/_producers.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert._sample import Transformer
from fsdp_convert.cli.app import app
from fsdp_convert.transform import TransformOptions
from tests._compare import assert_same_state
from tests._producers import CFG, TRUTH, train_step

# fixture, checkpoint path inside it, truth.pt inside it, inspect's producer, other top-level keys
# (Lightning: meta.pt's, merged), optimizer form in the output ("names": FQN-keyed; "ids": the
# producer saved optim.state_dict(); None: model only)
PRODUCERS: dict[str, tuple[str, str, str, str, set[str], str | None]] = {
    "torchtitan": (
        "torchtitan_run",
        "torchtitan/checkpoint/step-2",
        "torchtitan/truth.pt",
        "torchtitan",
        {"lr_scheduler", "train_state", "dataloader"},
        "names",
    ),
    "accelerate": ("accelerate_run", "accelerate", "accelerate/truth.pt", "accelerate", set(), "names"),
    "lightning-fsdp1": ("lightning_run", "lightning_fsdp1", "lightning_fsdp1/truth.pt", "lightning", {"step"}, "names"),
    "lightning-fsdp2": ("lightning_run", "lightning_fsdp2", "lightning_fsdp2/truth.pt", "lightning", {"step"}, "names"),
    "fsdp2-wrapper-names": ("fsdp2_layouts", "wrapped", TRUTH, "fsdp2", set(), "names"),
    "hf-storage-writer": ("fsdp2_layouts", "hf_storage", TRUTH, "hf_storage", set(), None),
    "verl": ("fsdp2_layouts", "verl", TRUTH, "verl", {"extra_state"}, "ids"),
    "fsdp1-orig-params": ("fsdp1_layouts", "orig_params_true/checkpoint", "orig_params_true/truth.pt", "fsdp1", set(), "names"),
    "fsdp1-flat-params": ("fsdp1_layouts", "orig_params_false/checkpoint", "orig_params_false/truth.pt", "fsdp1", set(), "names"),
    "fsdp1-rank-files": ("fsdp1_layouts", "orig_params_true/rank_files", "orig_params_true/truth.pt", "fsdp1", set(), "names"),
}


# the optimizer's top-level key in consolidate's default (producer) layout: as the producer saved it
OPTIM_KEY = {"torchtitan": "optimizer", "accelerate": "optimizer", "lightning": "optimizer"}


def _layout(request: pytest.FixtureRequest, name: str) -> tuple[Path, dict[str, Any], str, set[str], str | None]:
    fixture, ckpt, truth_path, producer, others, optim = PRODUCERS[name]
    root: Path = request.getfixturevalue(fixture)
    truth = torch.load(root / truth_path, weights_only=True)
    if producer == "torchtitan":
        # torchtitan builds its optimizer over (name, param) pairs, so torch's full optimizer state
        # dict has each group's param_names; torchtitan's own flattening drops them on save (the
        # params list names the same FQNs), so the checkpoint cannot have them
        for group in truth["optim"]["param_groups"]:
            assert group.pop("param_names") == group["params"]
    return root / ckpt, truth, producer, others, optim


def _by_id(optim: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict as torch.optim's own state_dict() has it: ids in model order."""
    ids = {fqn: i for i, fqn in enumerate(order)}
    groups = [{**g, "params": sorted(ids[p] for p in g["params"])} for g in optim["param_groups"]]
    return {"state": {ids[fqn]: s for fqn, s in optim["state"].items()}, "param_groups": groups}


@pytest.mark.parametrize("name", sorted(PRODUCERS))
def test_each_producer_consolidates_to_its_ground_truth(request: pytest.FixtureRequest, name: str, tmp_path: Path) -> None:
    """Bitwise equal to get_model_state_dict/get_optimizer_state_dict(full_state_dict=True) of the
    same run, after the documented cleaning: wrapper names removed, the optimizer under the
    producer's own key (``optimizer`` for torchtitan, accelerate and Lightning), Lightning's
    ``meta.pt`` merged (``step``), torchtitan's flattened optimizer state nested again with its
    param groups rebuilt; verl's id-keyed optimizer files stay id-keyed. (torchtitan's truth is its model's own state dict,
    gathered: a save hook writes the fused ``wqkv`` as ``wq``/``wk``/``wv``, while its optimizer
    state stays keyed by ``wqkv``.)"""
    ckpt, truth, producer, others, optim = _layout(request, name)
    info = fsdp_convert.inspect_checkpoint(ckpt)
    assert info.producer == producer and info.world_size == 2
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(ckpt, out, nproc=1, verify_output=True)
    got = torch.load(out, weights_only=True)
    key = OPTIM_KEY.get(producer, "optim")
    assert set(got) == ({"model", key} if optim else {"model"}) | others
    want = {"model": truth["model"]}
    if optim is not None:
        want[key] = truth["optim"] if optim == "names" else _by_id(truth["optim"], list(truth["model"]))
    if producer == "hf_storage":  # safetensors headers list names sorted: compare in the truth's order
        assert sorted(got["model"]) == sorted(truth["model"])
        got["model"] = {k: got["model"][k] for k in truth["model"]}
    assert assert_same_state({k: got[k] for k in want}, want) >= len(truth["model"])


def test_torchtitan_other_state_is_the_trainers(torchtitan_run: Path, tmp_path: Path) -> None:
    """The trainer's own train_state, dataloader and LR scheduler state come out as it saved them."""
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(torchtitan_run / "torchtitan/checkpoint/step-2", out, only="all")
    got = torch.load(out, weights_only=True)
    assert got["train_state"] == {"step": CFG.steps, "ntokens_seen": 2 * 8 * CFG.steps}  # local batch 2, seq_len 8
    assert got["dataloader"] == {"batches": CFG.steps}
    assert got["lr_scheduler"] == {"last_epoch": CFG.steps}


def test_accelerate_random_states_are_never_unpickled(accelerate_run: Path, tmp_path: Path) -> None:
    """accelerate's save_state writes pickles beside its DCP folders (random_states_<rank>.pkl):
    the tool never loads them."""
    from tests.cli.test_bad_inputs import Evil

    ck = tmp_path / "accelerate"
    shutil.copytree(accelerate_run / "accelerate", ck)
    assert sorted(p.name for p in ck.glob("random_states_*.pkl")) == ["random_states_0.pkl", "random_states_1.pkl"]
    marker = tmp_path / "pwned"
    torch.save(Evil(marker), ck / "random_states_0.pkl")
    assert fsdp_convert.inspect_checkpoint(ck).producer == "accelerate"
    fsdp_convert.consolidate(ck, tmp_path / "x.pt", nproc=1)
    assert not marker.exists()


def test_wrapper_names_are_removed_unless_kept(fsdp2_layouts: Path, tmp_path: Path) -> None:
    ckpt = fsdp2_layouts / "wrapped"
    assert all(e.fqn.startswith("model._orig_mod.") for e in fsdp_convert.inspect_checkpoint(ckpt).entries if e.group == "model")
    kept = tmp_path / "kept.pt"
    fsdp_convert.consolidate(ckpt, kept, only="model", options=TransformOptions(keep_wrapper_names=True))
    keys = list(torch.load(kept, weights_only=True)["model"])
    assert "_orig_mod.layers.0.mlp.0.weight" in keys and "layers.0.mlp.0.weight" not in keys


def _plain_step(model_state: dict[str, Any], optim_state: dict[str, Any], batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """The usual single-process resume: build, load_state_dict both, one step; the new parameters."""
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    model = Transformer(CFG)
    model.load_state_dict(model_state)
    optim = torch.optim.AdamW(model.parameters())
    optim.load_state_dict(optim_state)
    train_step(model, optim, batch, CFG.vocab_size)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["torchtitan", "accelerate", "lightning-fsdp1", "lightning-fsdp2", "fsdp2-wrapper-names"])
def test_resume_on_one_process_matches_the_fsdp_next_step(
    request: pytest.FixtureRequest, runner: CliRunner, name: str, tmp_path: Path
) -> None:
    """--optim-keys ids gives what torch.optim.Optimizer.state_dict() gives: a plain AdamW over the
    plain model loads it, and one step lands where the distributed run's next step did (rel 1e-6).
    For torchtitan the plain model is its own llama3 model, whose load hook fuses wq/wk/wv again."""
    ckpt, truth, producer, *_ = _layout(request, name)
    out = tmp_path / "plain.pt"
    result = runner.invoke(app, ["consolidate", str(ckpt), str(out), "--optim-keys", "ids", "--nproc", "1"])
    assert result.exit_code == 0, result.stderr
    state = torch.load(out, weights_only=True)
    optim = state[OPTIM_KEY.get(producer, "optim")]
    n_params = len(truth["optim"]["state"])
    assert sorted(optim["state"]) == list(range(n_params))
    assert optim["param_groups"][0]["params"] == list(range(n_params))
    if producer == "torchtitan":
        from tests._frameworks import titan_plain_step

        stepped, head = titan_plain_step(state["model"], optim, truth["batch"]), "lm_head.weight"
    else:
        stepped, head = _plain_step(state["model"], optim, truth["batch"]), "output.weight"
    assert list(stepped) == list(truth["next_model"])
    for fqn, want in truth["next_model"].items():
        torch.testing.assert_close(stepped[fqn], want, rtol=1e-6, atol=1e-7, msg=fqn)
    # and the step moved the weights: a stale optimizer state would not land there
    assert not torch.equal(stepped[head], truth["model"][head])


def test_ids_follow_model_order_for_fsdp1_flat_params(fsdp1_layouts: Path, tmp_path: Path) -> None:
    """FSDP1 with use_orig_params=False lists params in flat-parameter order; ids must follow the
    model's own parameter order, or load_state_dict would pair states with the wrong parameters."""
    out = tmp_path / "plain.pt"
    fsdp_convert.consolidate(fsdp1_layouts / "orig_params_false/checkpoint", out, options=TransformOptions(optim_keys="ids"))
    truth = torch.load(fsdp1_layouts / "orig_params_false/truth.pt", weights_only=True)
    state = torch.load(out, weights_only=True)
    torch.manual_seed(0)
    model = Transformer(CFG)
    model.load_state_dict(state["model"])
    optim = torch.optim.AdamW(model.parameters())
    optim.load_state_dict(state["optim"])
    for name, param in model.named_parameters():
        assert torch.equal(optim.state[param]["exp_avg"], truth["optim"]["state"][name]["exp_avg"]), name


def test_parent_folder_errors_name_the_folder_to_pass(runner: CliRunner, torchtitan_run: Path, tmp_path: Path) -> None:
    """torchtitan's CheckpointManager saves under checkpoint/step-N: its checkpoint folder answers
    with the step folder to pass."""
    parent = torchtitan_run / "torchtitan/checkpoint"
    result = runner.invoke(app, ["consolidate", str(parent), str(tmp_path / "x.pt")])
    assert result.exit_code == 3
    assert result.stderr.strip() == f"error: {parent} has no .metadata, but {parent / 'step-2'} has: pass that folder"
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("name", ["torchtitan", "accelerate", "lightning-fsdp1", "lightning-fsdp2"])
def test_reshard_keeps_the_producer_layout(request: pytest.FixtureRequest, name: str, tmp_path: Path) -> None:
    """A checkpoint resharded to 3 keeps every key as saved (torchtitan: weights at the top level
    and the flattened optimizer state, so torchtitan's own loader reads it; accelerate: its two DCP
    folders; Lightning: meta.pt beside .metadata); consolidating it gives the same bytes."""
    ckpt, _, producer, *_ = _layout(request, name)
    out = tmp_path / "ws3"
    fsdp_convert.reshard(ckpt, out, world_size=3)
    keys = {e.fqn for e in fsdp_convert.inspect_checkpoint(out).entries}
    assert keys == {e.fqn for e in fsdp_convert.inspect_checkpoint(ckpt).entries}
    assert fsdp_convert.inspect_checkpoint(out).world_size == 3
    assert fsdp_convert.inspect_checkpoint(out).producer == producer
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    fsdp_convert.consolidate(ckpt, a)
    fsdp_convert.consolidate(out, b)
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("name", ["verl", "hf-storage-writer", "fsdp1-rank-files"])
def test_non_dcp_sources_reshard_to_dcp(request: pytest.FixtureRequest, name: str, tmp_path: Path) -> None:
    """Per-rank torch.save files and HuggingFaceStorageWriter shards become a DCP checkpoint for 3
    ranks that holds the same state (consolidating either gives the same bytes)."""
    ckpt, *_ = _layout(request, name)
    out = tmp_path / "ws3"
    fsdp_convert.reshard(ckpt, out, world_size=3, nproc=2)
    assert fsdp_convert.inspect_checkpoint(out).world_size == 3
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    fsdp_convert.consolidate(ckpt, a)
    fsdp_convert.consolidate(out, b)
    assert a.read_bytes() == b.read_bytes()


def test_rank_file_errors_name_the_file(runner: CliRunner, fsdp2_layouts: Path, tmp_path: Path) -> None:
    from tests.cli.test_bad_inputs import Evil

    ck = tmp_path / "verl"
    shutil.copytree(fsdp2_layouts / "verl", ck)
    missing = ck / "model_world_size_2_rank_1.pt"
    missing.unlink()
    result = runner.invoke(app, ["consolidate", str(ck), str(tmp_path / "x.pt")])
    assert result.exit_code == 3, result.stderr
    assert result.stderr.strip() == f"error: {missing} is missing; model_world_size_2_rank_0.pt says there are 2 ranks"

    marker = tmp_path / "pwned"
    torch.save({"w": Evil(marker)}, missing)
    result = runner.invoke(app, ["consolidate", str(ck), str(tmp_path / "x.pt")])
    assert result.exit_code == 1 and "would run code when loaded, refused" in result.stderr, result.stderr
    assert str(missing) in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "x.pt").exists()


class _MeshGadget:
    """Pickles to a call of DeviceMesh("cpu", [0]), which under torch's own weights_only loader
    (DeviceMesh is on its allow-list once torch.distributed.tensor is imported) starts a process group."""

    def __reduce__(self) -> tuple[object, ...]:
        from torch.distributed.device_mesh import DeviceMesh

        return (DeviceMesh, ("cpu", [0]))


def test_rank_files_never_build_a_mesh(fsdp2_layouts: Path, tmp_path: Path) -> None:
    import torch.distributed as dist

    ck = tmp_path / "verl"
    shutil.copytree(fsdp2_layouts / "verl", ck)
    torch.save({"w": _MeshGadget()}, ck / "model_world_size_2_rank_1.pt")
    with pytest.raises(fsdp_convert.CheckpointError, match="DeviceMesh is not a state dict value"):
        fsdp_convert.consolidate(ck, tmp_path / "x.pt", nproc=1)
    assert not dist.is_initialized()
    assert not (tmp_path / "x.pt").exists()


def test_accelerate_side_file_linked_out_of_the_checkpoint_is_not_copied(accelerate_run: Path, tmp_path: Path) -> None:
    """reshard copies accelerate's side files (scheduler.bin, ...) byte for byte: never one that links out of the folder."""
    ck = tmp_path / "accelerate"
    shutil.copytree(accelerate_run / "accelerate", ck)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"API_KEY=do-not-copy")
    (ck / "scheduler.bin").symlink_to(secret)
    out = tmp_path / "out"
    with pytest.raises(fsdp_convert.UnsafeContentError, match="scheduler.bin"):
        fsdp_convert.reshard(ck, out, world_size=2, nproc=1)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    # with the user's word, the link is followed (a shared store the step folder links into)
    fsdp_convert.reshard(ck, out, world_size=2, nproc=1, follow_symlinks=True)
    assert (out / "scheduler.bin").read_bytes() == secret.read_bytes()
