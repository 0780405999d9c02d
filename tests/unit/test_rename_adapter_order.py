"""``--rename`` applies before ``--adapter``: the adapter sees the renamed FQNs (issue 25).

A 2-layer Llama saved under torchtune's names, renamed to torchtitan's, goes through
``torchtitan-llama3-to-hf``: every tensor must come out under its HF name. With the renames after
the adapter (the old order), the adapter saw torchtune's names and mapped 2 of the 21 tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fsdp_convert.adapters import load_adapter
from fsdp_convert.cli.app import app
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.formats.index import CheckpointIndex, ChunkEntry, TensorEntry
from fsdp_convert.producers import classify
from fsdp_convert.transform import TransformOptions, build_items

DIM, HEADS, LAYERS = 8, 2, 2
PER_LAYER = {
    "attn.q_proj.weight": (DIM, DIM),
    "attn.k_proj.weight": (DIM, DIM),
    "attn.v_proj.weight": (DIM, DIM),
    "attn.output_proj.weight": (DIM, DIM),
    "mlp.w1.weight": (16, DIM),
    "mlp.w2.weight": (DIM, 16),
    "mlp.w3.weight": (16, DIM),
    "sa_norm.scale": (DIM,),
    "mlp_norm.scale": (DIM,),
}
TUNE_TO_TITAN = [  # torchtune's names to torchtitan's (pre-0.3 attention.wq...), as a user would write them
    r"\.attn\.q_proj\.=.attention.wq.",
    r"\.attn\.k_proj\.=.attention.wk.",
    r"\.attn\.v_proj\.=.attention.wv.",
    r"\.attn\.output_proj\.=.attention.wo.",
    r"\.mlp\.(w\d)\.=.feed_forward.\1.",
    r"\.sa_norm\.scale$=.attention_norm.weight",
    r"\.mlp_norm\.scale$=.ffn_norm.weight",
    r"^norm\.scale$=norm.weight",
]
HF_PER_LAYER = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.down_proj.weight",
    "mlp.up_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


def _tensor(fqn: str, shape: tuple[int, ...]) -> TensorEntry:
    nbytes = 4 * int(torch.tensor(shape).prod())
    chunk = ChunkEntry(offsets=(0,) * len(shape), sizes=shape, relative_path="__0_0.distcp", offset_bytes=0, length_bytes=nbytes)
    return TensorEntry(fqn=f"model.{fqn}", path=("model", fqn), shape=shape, dtype=torch.float32, chunks=(chunk,))


ENTRIES = (
    _tensor("tok_embeddings.weight", (32, DIM)),
    *(_tensor(f"layers.{n}.{key}", shape) for n in range(LAYERS) for key, shape in PER_LAYER.items()),
    _tensor("norm.scale", (DIM,)),
    _tensor("output.weight", (32, DIM)),
)
INDEX = CheckpointIndex(checkpoint_id=Path("/nowhere"), entries=ENTRIES, data_files=("__0_0.distcp",))
HF = {
    "model.embed_tokens.weight",
    *(f"model.layers.{n}.{key}" for n in range(LAYERS) for key in HF_PER_LAYER),
    "model.norm.weight",
    "lm_head.weight",
}


def _model_names(renames: list[str]) -> set[str]:
    options = TransformOptions(renames=renames, adapter=load_adapter("torchtitan-llama3-to-hf", {"num_attention_heads": HEADS}))
    items = build_items(INDEX, classify(INDEX), options, {})
    return {str(item.path[1]) for item in items if item.group == "model"}


def test_renames_reach_the_adapter_so_every_tensor_is_mapped() -> None:
    assert len(ENTRIES) == len(HF) == 21
    assert _model_names(TUNE_TO_TITAN) == HF


def test_without_the_renames_the_adapter_maps_only_the_names_it_knows() -> None:
    """What the old order gave (the adapter saw torchtune's names): only two tensors named alike."""
    assert _model_names([]) == {"model.embed_tokens.weight", "lm_head.weight"}


def test_two_names_renamed_to_one_before_the_adapter_are_refused() -> None:
    with pytest.raises(InvalidOptionError) as caught:
        _model_names([*TUNE_TO_TITAN, r"^output\.weight$=norm.weight"])
    message = "model.norm.scale and model.output.weight would both reach --adapter as 'norm.weight'"
    assert caught.value.cli_text() == message


@pytest.mark.parametrize("command", ["consolidate", "reshard"])
def test_help_says_renames_come_before_the_adapter(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.exit_code == 0
    text = " ".join(result.output.replace("│", " ").split())
    assert "applied in order, before --adapter" in text
    assert "(named after --rename)" in text
