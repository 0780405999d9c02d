"""``hf-to-megatron-gpt``: an HF Llama folder resharded into the ``torch_dist`` folder Megatron-Core 0.16.1 loads at any TP.

The HF folders are transformers' ``LlamaForCausalLM`` (GQA: 4 query heads in 2 groups), random
weights, ``save_pretrained``, untied and tied (``tests._megatron_hf.save_hf``). ``reshard HF OUT
--world-size 2 --adapter hf-to-megatron-gpt`` makes each OUT once; Megatron's ``GPTModel`` then loads
it with ``dist_checkpointing.load(model.sharded_state_dict(), OUT)`` at TP=1 (one rank) and TP=2
(two gloo ranks), one launch per TP for both folders (``tests._megatron_hf.megatron_load``), and
must hold the HF weights under Megatron-Bridge's Llama mapping bit for bit.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.adapters import megatron
from fsdp_convert.cli.app import app
from fsdp_convert.derive import TensorInfo
from fsdp_convert.dtypes import as_dtype
from tests import _megatron, _megatron_hf
from tests._compare import assert_same_state
from tests._dist import run_ranks

NAME = "hf-to-megatron-gpt"
TARGET = 2
TIES = (False, True)
EXTRA = "._extra_state/shard_"


@dataclass(frozen=True)
class Converted:
    """One HF folder, its reshard for Megatron, and what Megatron's model held after loading it at each TP."""

    hf: Path
    state: dict[str, torch.Tensor]  # the HF model's state_dict()
    out: Path
    doc: dict[str, Any]  # reshard's --json result
    loaded: dict[int, dict[str, Any]]  # by TP: megatron_load's record


def _reshard_args(hf: Path, out: Path, *extra: str) -> list[str]:
    args = ["reshard", str(hf), str(out), "--world-size", str(TARGET), "--adapter", NAME]
    return [*args, "--model-config", str(hf / "config.json"), *extra]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Converted]:
    """Both folders made and resharded, then loaded by Megatron at TP=1 and TP=2: two launches in all."""
    root = tmp_path_factory.mktemp("megatron_from_hf")
    runner = CliRunner()
    made = {}
    for tie in TIES:
        hf, out = root / f"hf_tied{int(tie)}", root / f"out_tied{int(tie)}"
        state = _megatron_hf.save_hf(hf, tie=tie)
        result = runner.invoke(app, _reshard_args(hf, out, "--json"))
        assert result.exit_code == 0, result.output
        made[tie] = (hf, state, out, json.loads(result.stdout))
    _megatron.preload()
    for tp in (1, 2):
        jobs = [(made[tie][2], tie, root / f"tp{tp}_tied{int(tie)}.pt") for tie in TIES]
        run_ranks(_megatron_hf.megatron_load, tp, jobs, timeout=300)
    return {
        tie: Converted(
            hf=hf,
            state=state,
            out=out,
            doc=doc,
            loaded={tp: torch.load(root / f"tp{tp}_tied{int(tie)}.pt", weights_only=True) for tp in (1, 2)},
        )
        for tie, (hf, state, out, doc) in made.items()
    }


def _sorted(state: dict[str, Any]) -> dict[str, Any]:
    return dict(sorted(state.items()))


@pytest.mark.parametrize("tie", TIES, ids=["untied", "tied"])
def test_reshard_writes_the_folder_megatron_writes(converted: dict[bool, Converted], tmp_path: Path, tie: bool) -> None:
    """OUT holds what a model-only ``dist_checkpointing.save`` writes: data for 2 ranks, ``common.pt``
    (``torch.save({})``, byte for byte as torch writes it), ``metadata.json`` (byte for byte), one
    ``_extra_state/shard_<l>_<L>`` entry per layer module holding ``[None]``; its tensors are the HF
    weights under the mapping, bit for bit (consolidated with no adapter), no output layer when tied."""
    run = converted[tie]
    assert run.doc["added"] == ["common.pt", "metadata.json"] and run.doc["copied"] == []
    names = sorted(p.name for p in run.out.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"]
    buf = io.BytesIO()
    torch.save({}, buf)
    assert (run.out / "common.pt").read_bytes() == buf.getvalue()
    assert torch.load(run.out / "common.pt", weights_only=True) == {}
    backends = '"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch"'
    assert (run.out / "metadata.json").read_text() == "{" + backends + ', "common_backend_version": 1}'
    info = fsdp_convert.inspect_checkpoint(run.out)
    assert (info.producer, info.world_size) == ("megatron-core", TARGET)

    full = tmp_path / "full.pt"
    fsdp_convert.consolidate(run.out, full, nproc=1, verify_output=True)
    got = torch.load(full, weights_only=True)
    layers = _megatron_hf.hf_config()["num_hidden_layers"]
    extra = [f"decoder.layers.{m}{EXTRA}{n}_{layers}" for n in range(layers) for m in megatron.EXTRA_STATE_MODULES]
    assert list(got) == ["model", *extra] and all(got[k] == [None] for k in extra)
    want = _megatron_hf.megatron_state(run.state, tie=tie)
    assert assert_same_state(_sorted(got["model"]), _sorted(want)) == 8 + (not tie)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("tie", TIES, ids=["untied", "tied"])
def test_megatron_loads_the_hf_weights_bit_for_bit(converted: dict[bool, Converted], tie: bool, tp: int) -> None:
    """Megatron's ``GPTModel`` at TP=``tp``, loaded from OUT by ``dist_checkpointing.load``, holds the HF
    weights under the mapping bit for bit, put together from every rank's shards; each tensor OUT stores
    has the model's own global shape (its loader would read the first rows of a larger one). At TP=1,
    q/k/v as Megatron's own forward splits ``linear_qkv`` and gate/up as its SwiGLU halves ``linear_fc1``
    are the HF folder's tensors, every one."""
    run = converted[tie]
    loaded = run.loaded[tp]
    want = _megatron_hf.megatron_state(run.state, tie=tie)
    assert assert_same_state(_sorted(loaded["state"]), _sorted(want)) == len(want)
    stored = dcp.FileSystemReader(str(run.out)).read_metadata().state_dict_metadata
    stored_shapes = {k: tuple(v.size) for k, v in stored.items() if EXTRA not in k}  # type: ignore[union-attr]
    assert stored_shapes == {k: tuple(s) for k, s in loaded["shapes"].items()}
    if tp == 1:
        folder = load_file(run.hf / "model.safetensors")
        assert sorted(loaded["hf_view"]) == sorted(folder) and len(folder) == 2 + 9 * 2 + (not tie)
        assert assert_same_state(_sorted(loaded["hf_view"]), _sorted(folder)) == len(folder)


@pytest.mark.parametrize("tie", TIES, ids=["untied", "tied"])
def test_megatron_gpt_to_hf_of_out_gives_the_hf_folder_back(converted: dict[bool, Converted], tmp_path: Path, tie: bool) -> None:
    """``consolidate OUT x.safetensors --adapter megatron-gpt-to-hf`` gives the HF folder's tensors back bit for bit."""
    run = converted[tie]
    out = tmp_path / "x.safetensors"
    args = ["consolidate", str(run.out), str(out), "--adapter", "megatron-gpt-to-hf"]
    result = CliRunner().invoke(app, [*args, "--model-config", str(run.hf / "config.json")])
    assert result.exit_code == 0, result.output
    folder = load_file(run.hf / "model.safetensors")
    assert assert_same_state(_sorted(load_file(out)), _sorted(folder)) == len(folder)


def test_dry_run_lists_the_files_megatron_reads(converted: dict[bool, Converted], tmp_path: Path) -> None:
    """``--dry-run`` lists ``common.pt`` and ``metadata.json`` with their sizes, and writes nothing."""
    run = converted[False]
    out = tmp_path / "out"
    result = CliRunner().invoke(app, _reshard_args(run.hf, out, "--dry-run", "--json"))
    assert result.exit_code == 0, result.output
    files = {f["name"]: f["nbytes"] for f in json.loads(result.stdout)["files"]}
    assert {name: files[name] for name in ("common.pt", "metadata.json")} == {
        name: (run.out / name).stat().st_size for name in ("common.pt", "metadata.json")
    }
    assert not out.exists()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("num_key_value_heads=4", "do not split into 4 query heads in 4 groups of one head_dim"),
        ("num_attention_heads=3", "do not split into 3 query heads in 2 groups of one head_dim"),
        ("num_hidden_layers=1", "model.layers.1.input_layernorm.weight: layer 1, but num_hidden_layers is 1"),
        ("num_hidden_layers=3", "model.layers.2.self_attn.q_proj.weight: missing; Megatron's GPT needs it in each of 3 layers"),
    ],
)
def test_a_shape_that_does_not_fit_is_refused_in_one_line(
    converted: dict[bool, Converted], tmp_path: Path, option: str, message: str
) -> None:
    """Heads or layers the folder's tensors do not split into are refused before anything is written
    (Megatron's loader would read the first rows of a tensor stored larger than its model's)."""
    out = tmp_path / "out"
    result = CliRunner().invoke(app, _reshard_args(converted[False].hf, out, "--adapter-option", option))
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


def test_from_hf_rules_are_the_mapping_in_bf16_and_invert_to_hf() -> None:
    """Computed on a bf16 model's ``state_dict()`` (``Derived.compute``), the rules give the mapping bit for bit,
    every output a byte copy of row segments; ``megatron-gpt-to-hf``'s rules on that give the HF tensors back."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(_megatron_hf.HF_SEED)
    cfg = _megatron_hf.hf_config()
    state = {k: v.to(torch.bfloat16) for k, v in LlamaForCausalLM(LlamaConfig(**cfg)).state_dict().items()}
    rules = megatron.from_hf([TensorInfo(k, as_dtype(v.dtype), tuple(v.shape)) for k, v in state.items()], cfg)
    ours = {fqn: d.compute([state[i.fqn] for i in d.inputs]) for fqn, d in rules.items()}
    assert assert_same_state(_sorted(ours), _sorted(_megatron_hf.megatron_state(state))) == len(ours)
    back = megatron.to_hf([TensorInfo(k, as_dtype(v.dtype), tuple(v.shape)) for k, v in ours.items()], cfg)
    hf = {fqn: d.compute([ours[i.fqn] for i in d.inputs]) for fqn, d in back.items()}
    assert assert_same_state(_sorted(hf), _sorted(state)) == len(state)
