"""Every output this tool writes is an input it reads: consolidate, reshard and verify on each output kind.

Each kind is written once (module fixture) from the 3-rank FSDP2 sample, or the PEFT LoRA sample
for the adapter folder. Then, for each kind X:

- consolidate(X), with the arguments that wrote X, writes X again byte for byte (a DCP folder:
  the bytes consolidate(CKPT) wrote; the adapter: its file as a Hugging Face folder's weights);
- reshard(X) to 2 ranks holds what X holds: torch's own reading of it (``dcp_to_torch_save``) is
  the run's ground truth in X's layout, every tensor bit for bit, each rank's chunks in its file;
- verify(reference, X) is equal over every key: the reference is the DCP sample (seen with
  ids for the ids-keyed file) or PEFT's own ``save_pretrained`` of the adapter.

One multi-worker run: the issue's own steps (``consolidate CKPT OUT``, ``reshard OUT OUT2
--world-size 2``), loaded by FSDP2 at 2 ranks with model and optimizer state.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli import app
from fsdp_convert.formats.index import flatten_with_paths
from fsdp_convert.transform import TransformOptions
from tests._compare import assert_same_state
from tests._dist import run_ranks
from tests._samples import Sample
from tests.integration.test_reshard import _load_at_new_world_size, _reference_losses, torch_view

KINDS = ["pt", "pt_ids", "ckpt", "safetensors", "hf", "hf_model", "hf_sharded", "hf_optim", "peft", "dcp"]
MODEL_ONLY = {"safetensors", "hf_model", "peft"}  # reshard keeps their flat names, as model.state_dict() has them


@dataclass(frozen=True)
class Built:
    """One output kind as written, and what each operation must find in it.

    Attributes:
        path: the output.
        kwargs: the ``consolidate`` arguments that wrote it (a DCP folder: ``reshard``'s, unused).
        want: what it holds, as torch's ``dcp_to_torch_save`` nests a reshard of it.
        reference: a checkpoint ``verify`` finds equal to it, over ``len(flatten(want))`` keys.
        verify_kwargs: how ``verify`` sees the reference.
    """

    path: Path
    kwargs: dict[str, Any]
    want: dict[str, Any]
    reference: Path
    verify_kwargs: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/_lora.py's run: an FSDP2 PEFT LoRA checkpoint and PEFT's own save_pretrained of the adapter."""
    pytest.importorskip("peft")
    from tests._lora import train_lora

    out = tmp_path_factory.mktemp("lora")
    run_ranks(train_lora, 2, out)
    return out


def _by_ids(truth: dict[str, Any]) -> dict[str, Any]:
    """The ground truth with the optimizer keyed by id in param-group order (as DCP stores the keys: strings)."""
    groups = truth["optim"]["param_groups"]
    ids = {fqn: i for i, fqn in enumerate(p for g in groups for p in g["params"])}
    state = {str(ids[fqn]): value for fqn, value in truth["optim"]["state"].items()}
    param_groups = [{**g, "params": [ids[p] for p in g["params"]]} for g in groups]
    return {**truth, "optim": {"state": state, "param_groups": param_groups}}


@pytest.fixture(scope="module")
def built(ws3_ckpt: Sample, lora_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    from fsdp_convert.lora import LoraAdapter, lora_options

    root = tmp_path_factory.mktemp("outputs")
    ckpt, truth = ws3_ckpt.checkpoint, ws3_ckpt.truth()
    ids = TransformOptions(optim_keys="ids")
    peft = TransformOptions(adapter=LoraAdapter(lora_options("only", alpha=8)))
    specs: dict[str, tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = {
        "pt": ("full.pt", {}, truth, {}),
        "pt_ids": ("ids.pt", {"options": ids}, _by_ids(truth), {"options": ids}),
        "ckpt": ("last.ckpt", {"output_format": "torch"}, truth, {}),
        "safetensors": ("model.safetensors", {}, truth["model"], {}),
        "hf": ("hf", {}, truth, {}),
        "hf_model": ("hf_model", {"only": "model"}, truth["model"], {}),
        "hf_sharded": ("hf_sharded", {"max_shard_bytes": 20_000}, truth, {}),
        "hf_optim": ("hf_optim", {"only": "optim"}, {"optim": truth["optim"]}, {"only": "optim"}),
    }
    out: dict[str, Built] = {}
    for kind, (name, kwargs, want, verify_kwargs) in specs.items():
        fsdp_convert.consolidate(ckpt, root / name, nproc=1, **kwargs)
        out[kind] = Built(root / name, kwargs, want, ckpt, verify_kwargs)
    adapter = lora_run / "adapter"  # PEFT's save_pretrained
    fsdp_convert.consolidate(lora_run / "checkpoint", root / "peft", nproc=1, options=peft)
    out["peft"] = Built(root / "peft", {"options": peft}, load_file(adapter / "adapter_model.safetensors"), adapter)
    fsdp_convert.reshard(ckpt, root / "dcp", world_size=2, nproc=1)
    out["dcp"] = Built(root / "dcp", {}, truth, ckpt)
    # what the kinds hold, before they are read: a .ckpt is torch.save whatever its name, the
    # shards are several, the adapter is PEFT's own
    assert (root / "last.ckpt").read_bytes() == (root / "full.pt").read_bytes()
    assert len(list((root / "hf_sharded").glob("model-*-of-*.safetensors"))) > 1
    assert sorted(p.name for p in (root / "hf_optim").iterdir()) == ["optimizer.pt"]
    assert (root / "peft" / "adapter_model.safetensors").read_bytes() == (adapter / "adapter_model.safetensors").read_bytes()
    return out


def _files(path: Path) -> dict[str, bytes]:
    """A file's bytes, or every file of a folder by name."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("kind", KINDS)
def test_consolidate_of_each_output_writes_it_again_byte_for_byte(built: dict[str, Built], kind: str, tmp_path: Path) -> None:
    b = built[kind]
    if kind == "dcp":  # a DCP folder consolidates as its source does
        fsdp_convert.consolidate(b.path, tmp_path / "full.pt", nproc=1)
        assert _files(tmp_path / "full.pt") == _files(built["pt"].path)
    elif kind == "peft":  # the adapter's tensors, as the weights of a Hugging Face folder
        fsdp_convert.consolidate(b.path, tmp_path / "folder", nproc=1)
        assert _files(tmp_path / "folder") == {"model.safetensors": (b.path / "adapter_model.safetensors").read_bytes()}
    else:
        fsdp_convert.consolidate(b.path, tmp_path / b.path.name, nproc=1, **b.kwargs)
        assert _files(tmp_path / b.path.name) == _files(b.path)


@pytest.mark.parametrize("kind", KINDS)
def test_reshard_of_each_output_holds_its_values(built: dict[str, Built], kind: str, tmp_path: Path) -> None:
    b = built[kind]
    out = tmp_path / "ws2"
    result = fsdp_convert.reshard(b.path, out, world_size=2, nproc=1)
    assert result.target_world_size == 2
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    tensors = sum(isinstance(v, torch.Tensor) for _, v in flatten_with_paths(b.want).values())
    assert assert_same_state(torch_view(out, tmp_path), b.want) == tensors
    # verify reads the reshard back as it is: weights alone (flat names there) are seen as consolidate names them
    check = fsdp_convert.verify(b.path, out)
    assert check.equal and check.compared == len(flatten_with_paths(b.want)), check.differences[:3]


@pytest.mark.parametrize("kind", KINDS)
def test_verify_finds_each_output_equal_to_its_reference(built: dict[str, Built], kind: str) -> None:
    b = built[kind]
    check = fsdp_convert.verify(b.reference, b.path, **b.verify_kwargs)
    assert check.equal, check.differences[:3]
    assert check.compared == len(flatten_with_paths(b.want))


def test_verify_finds_a_changed_value_in_a_folders_optimizer(built: dict[str, Built], tmp_path: Path) -> None:
    copy = tmp_path / "hf"
    shutil.copytree(built["hf"].path, copy)
    optim = torch.load(copy / "optimizer.pt", weights_only=True)
    optim["state"]["norm.bias"]["exp_avg"][3] += 1.0
    torch.save(optim, copy / "optimizer.pt")
    check = fsdp_convert.verify(built["hf"].reference, copy)
    assert [(d.key, d.kind) for d in check.differences] == [("optim.state.norm.bias.exp_avg", "differs")]


def test_consolidated_folder_reshards_and_loads_in_fsdp2_at_two_ranks(
    built: dict[str, Built], ws3_ckpt: Sample, runner: CliRunner, tmp_path: Path
) -> None:
    """The issue: ``consolidate CKPT OUT`` (a folder, optimizer.pt beside the shards), then
    ``reshard OUT OUT2 --world-size 2`` failed with KeyError: 'optim.state.pos_emb.step'."""
    out2 = tmp_path / "ws2"
    result = runner.invoke(app, ["reshard", str(built["hf"].path), str(out2), "--world-size", "2", "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["world_size"] == 2
    work = tmp_path / "load"
    work.mkdir()
    run_ranks(_load_at_new_world_size, 2, out2, ws3_ckpt.truth_path, work)  # model and optimizer, each rank its own file
    assert json.loads((work / "losses.json").read_text()) == pytest.approx(_reference_losses(ws3_ckpt.truth()), rel=1e-6)


@pytest.mark.parametrize("kind", ["pt", "hf"])
def test_consolidate_verify_of_a_file_input_compares_after_its_transforms(
    built: dict[str, Built], kind: str, tmp_path: Path
) -> None:
    """``--verify`` with ``--dtype bf16`` and a rename on a file input: the output is compared with
    what the transforms made of the input, not with the input as stored (a false VerificationError)."""
    options = TransformOptions(dtype="bf16", renames=["^norm\\.=final_norm."])
    out = tmp_path / "cast.pt"
    result = fsdp_convert.consolidate(built[kind].path, out, nproc=1, options=options, verify_output=True)
    assert result.tensors > 0
    model = torch.load(out, weights_only=True)["model"]
    assert "final_norm.weight" in model and "norm.weight" not in model
    assert {t.dtype for t in model.values()} == {torch.bfloat16}
