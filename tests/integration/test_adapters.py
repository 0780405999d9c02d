"""--adapter on torchtitan's own trained Llama 3: to Hugging Face and back, checked by torchtitan and transformers.

The checkpoint is the session's ``torchtitan_run`` (torchtitan 0.3.0's Trainer and
CheckpointManager, FSDP2 on 2 CPU ranks); its truth is the model's own state dict, gathered. The
HF folder must be exactly what torchtitan's ``Llama3StateDictAdapter.to_hf`` makes of that state
dict, and ``LlamaForCausalLM`` loaded from it must give the torchtitan model's logits; resharded
back with ``hf-to-torchtitan-llama3`` at 2 ranks, torchtitan's own CheckpointManager starts a job
from it (``initial_load_path``, model only) holding the run's weights, and consolidated to HF
again it is the same folder, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from typer.testing import CliRunner

from fsdp_convert.cli.app import app
from tests._dist import run_ranks
from tests._frameworks import TITAN_DIM, TITAN_HEADS, TITAN_LAYERS, TITAN_VOCAB, preload, titan_model_config, titan_trainer

CKPT, TRUTH = "torchtitan/checkpoint/step-2", "torchtitan/truth.pt"


def _hf_config() -> dict[str, Any]:
    """``LlamaConfig`` of the run's model (tests._frameworks.titan_model_config): its sizes, RMSNorm eps and llama3 RoPE."""
    rope = titan_model_config().layers[0].attention.rope
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": TITAN_VOCAB,
        "hidden_size": TITAN_DIM,
        "intermediate_size": 48,  # compute_ffn_hidden_dim(16, multiple_of=16)
        "num_hidden_layers": TITAN_LAYERS,
        "num_attention_heads": TITAN_HEADS,
        "num_key_value_heads": TITAN_HEADS,
        "max_position_embeddings": rope.max_seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope.theta,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": rope.scaling_factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        },
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _titan_logits(model_state: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan's llama3 model, built plainly (as tests._frameworks.titan_plain_step), on ``tokens``."""
    with torch.device("meta"):
        model = titan_model_config().build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.load_state_dict(model_state)
    with torch.no_grad():
        return model(tokens)  # type: ignore[no-any-return]


def _start_from(rank: int, world_size: int, checkpoint: Path, truth_path: Path, work: Path) -> None:
    """What a torchtitan job started from a checkpoint does: its CheckpointManager's ``load()`` with
    ``initial_load_path`` (model only: ``dcp.load`` of the model's own state dict, whose load hook
    fuses ``wq``/``wk``/``wv``); rank 0 compares the model, gathered, with the run's."""
    trainer = titan_trainer(rank, work / f"rank{rank}", seed=4321, batches=None)
    trainer.checkpointer.initial_load_path = str(checkpoint)
    assert trainer.checkpointer.load()
    model = trainer.model_parts[0]
    got = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    trainer.close()
    if rank == 0:
        want = torch.load(truth_path, weights_only=True)["model"]
        assert got.keys() == want.keys()
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), key


def test_torchtitan_llama3_to_hf_and_back(torchtitan_run: Path, tmp_path: Path, runner: CliRunner) -> None:
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from transformers import LlamaForCausalLM

    truth = torch.load(torchtitan_run / TRUTH, weights_only=True)
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(_hf_config()))
    hf = tmp_path / "hf"
    adapter = ["--adapter", "torchtitan-llama3-to-hf", "--nproc", "2"]
    result = runner.invoke(app, ["consolidate", str(torchtitan_run / CKPT), str(hf), *adapter, "--hf-assets", str(assets)])
    assert result.exit_code == 0, result.output

    # bit for bit what torchtitan's own adapter makes of the run's model
    want = Llama3StateDictAdapter(titan_model_config(), None).to_hf(dict(truth["model"]))
    got = load_file(hf / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key

    # transformers' Llama from that folder computes the torchtitan model's logits
    tokens = truth["batch"][:, :-1]
    model = LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(tokens).logits
    expected = _titan_logits(truth["model"], tokens)
    assert torch.allclose(logits, expected, atol=1e-5, rtol=1e-5), (logits - expected).abs().max()

    # back to torchtitan at 2 ranks: torchtitan starts a job from it holding the run's weights
    titan = tmp_path / "titan"
    back = ["--adapter", "hf-to-torchtitan-llama3", "--model-config", str(hf / "config.json")]
    result = runner.invoke(app, ["reshard", str(hf), str(titan), "--world-size", "2", *back])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in titan.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    preload("torchtitan")
    work = tmp_path / "load"
    work.mkdir()
    run_ranks(_start_from, 2, titan, torchtitan_run / TRUTH, work)

    # and to HF again: the same tensors, bit for bit
    again = tmp_path / "again"
    result = runner.invoke(app, ["consolidate", str(titan), str(again), *adapter, "--model-config", str(hf / "config.json")])
    assert result.exit_code == 0, result.output
    twice = load_file(again / "model.safetensors")
    assert sorted(twice) == sorted(got)
    for key, tensor in got.items():
        assert torch.equal(twice[key], tensor), key
