"""``hf-to-olmo-core``: an HF OLMo-2 folder to OLMo-core's model, as its ``convert_state_from_hf``, loaded by its own code.

The HF folder is transformers' ``Olmo2ForCausalLM`` of OLMo-core's tiny OLMo-2 model's config,
random weights, ``save_pretrained`` (``tests._olmo_hf.save_hf``). The adapter's output must equal
OLMo-core 3.0.0's ``convert_state_from_hf`` bit for bit, every key, and give the HF model's logits
in OLMo-core's model; resharded for 3 ranks, OLMo-core's ``load_model_and_optim_state`` reads it
into its FSDP2 model on 3 gloo ranks (``tests._olmo_hf.olmo_load_model``).

The name is registered here (``monkeypatch``), as ``adapters.ADAPTERS`` will list it:
``"hf-to-olmo-core": olmo.from_hf``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fsdp_convert import adapters
from fsdp_convert.adapters import olmo
from fsdp_convert.cli.app import app
from fsdp_convert.derive import TensorInfo
from fsdp_convert.dtypes import as_dtype
from fsdp_convert.errors import InvalidOptionError, UnsupportedTransformError
from tests import _olmo, _olmo_hf
from tests._compare import assert_same_state
from tests._dist import run_ranks

NAME = "hf-to-olmo-core"
TARGET = 3


@pytest.fixture
def registered() -> None:
    """Its record in ``adapters.ADAPTER_RECORDS`` is the built-in ``hf-to-olmo-core``."""
    assert adapters.ADAPTERS[NAME] is olmo.from_hf


def _convert_state_from_hf(hf: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """OLMo-core's own conversion, as its ``load_hf_model`` calls it (``model_type`` the config's)."""
    from olmo_core.nn.hf.convert import convert_state_from_hf
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf)
    return convert_state_from_hf(config, dict(state), model_type=config.model_type)


def _sorted(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(sorted(state.items()))


@pytest.mark.parametrize(("tie", "dtype"), [(False, torch.float32), (True, torch.bfloat16)], ids=["untied-fp32", "tied-bf16"])
def test_hf_to_olmo_core_is_its_convert_state_from_hf(
    registered: None, runner: CliRunner, tmp_path: Path, tie: bool, dtype: torch.dtype
) -> None:
    """``consolidate HF OUT.pt --adapter hf-to-olmo-core`` gives OLMo-core's ``convert_state_from_hf`` of the
    folder bit for bit, every key and dtype (of the folder's tensors and of the model's ``state_dict()``,
    which ``load_hf_model`` converts); each tensor is the HF one its map names; tied, ``lm_head.w_out.weight``
    is the embedding. Untied, OLMo-core's model holding it computes the HF model's logits."""
    hf = tmp_path / "hf"
    model_state = _olmo_hf.save_hf(hf, tie=tie, dtype=dtype)
    folder = load_file(hf / "model.safetensors")
    assert ("lm_head.weight" in folder) is not tie  # save_pretrained leaves a tied head out

    out = tmp_path / "olmo.pt"
    args = ["consolidate", str(hf), str(out), "--adapter", NAME, "--model-config", str(hf / "config.json")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    ours = torch.load(out, weights_only=True)
    assert list(ours) == ["model"]

    want = _convert_state_from_hf(hf, folder)
    assert len(want) == 3 + 11 * _olmo.LAYERS
    assert assert_same_state(_sorted(ours["model"]), _sorted(want)) == len(want)
    assert assert_same_state(_sorted(ours["model"]), _sorted(_convert_state_from_hf(hf, model_state))) == len(want)
    for olmo_key, hf_key in olmo.TO_HF.items():
        for layer in range(_olmo.LAYERS) if "{}" in olmo_key else [None]:
            got = ours["model"][olmo_key.format(layer)]
            hf_name = hf_key.format(layer)
            source = folder["model.embed_tokens.weight"] if tie and hf_name == "lm_head.weight" else folder[hf_name]
            assert got.dtype == dtype and torch.equal(got, source), hf_name

    if not tie:
        from transformers import Olmo2ForCausalLM

        tokens = _olmo.batch(5, 3)
        model = Olmo2ForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="sdpa")
        model.eval()  # type: ignore[no-untyped-call]
        core = _olmo.model_config().build(init_device="cpu")
        core.load_state_dict(ours["model"])
        core.eval()
        with torch.no_grad():
            torch.testing.assert_close(core(tokens), model(tokens).logits, atol=1e-6, rtol=0)


def test_hf_to_olmo_core_is_convert_state_from_hf_for_olmo3_with_grouped_query_attention() -> None:
    """``Olmo3ForCausalLM`` (sliding-window layers, 2 KV heads of 4): the rules, computed on the model's
    ``state_dict()`` (``Derived.compute``), give ``convert_state_from_hf(..., model_type="olmo3")`` bit for bit."""
    from olmo_core.nn.hf.convert import convert_state_from_hf
    from transformers import Olmo3Config, Olmo3ForCausalLM

    config = Olmo3Config(**{**_olmo_hf.hf_config(), "model_type": "olmo3", "num_key_value_heads": 2, "sliding_window": 4})
    torch.manual_seed(_olmo_hf.HF_SEED)
    state = Olmo3ForCausalLM(config).state_dict()
    want = convert_state_from_hf(config, dict(state), model_type="olmo3")
    rules = olmo.from_hf([TensorInfo(k, as_dtype(v.dtype), tuple(v.shape)) for k, v in state.items()], config.to_dict())
    assert sorted(rules) == sorted(want)
    for fqn, derived in rules.items():
        assert derived.is_copy and torch.equal(derived.compute([state[i.fqn] for i in derived.inputs]), want[fqn]), fqn


def _want(hf: Path, tmp_path: Path) -> Path:
    """``convert_state_from_hf`` of the folder, saved for the ranks to check against."""
    path = tmp_path / "want.pt"
    torch.save(_convert_state_from_hf(hf, load_file(hf / "model.safetensors")), path)
    return path


def test_hf_to_olmo_core_reshard_loads_with_load_model_and_optim_state_at_three_ranks(
    registered: None, runner: CliRunner, tmp_path: Path
) -> None:
    """``reshard HF OUT/model_and_optim --world-size 3 --adapter hf-to-olmo-core`` writes the DCP folder of an
    OLMo-core step folder, model only, in one pass: OLMo-core's ``load_model_and_optim_state`` reads it into
    its FSDP2 model at 3 ranks, which then holds ``convert_state_from_hf`` of the folder bit for bit."""
    hf = tmp_path / "hf"
    _olmo_hf.save_hf(hf)
    step = tmp_path / "step0"
    step.mkdir()
    model_dir = step / "model_and_optim"
    args = ["reshard", str(hf), str(model_dir), "--world-size", str(TARGET), "--adapter", NAME]
    result = runner.invoke(app, [*args, "--model-config", str(hf / "config.json")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in model_dir.iterdir()) == [".metadata", *(f"__{r}_0.distcp" for r in range(TARGET))]

    _olmo.preload()
    run_ranks(_olmo_hf.olmo_load_model, TARGET, model_dir, _want(hf, tmp_path), timeout=300)


def test_hf_to_olmo_core_output_resharded_loads_at_three_ranks_today(registered: None, runner: CliRunner, tmp_path: Path) -> None:
    """Today's route, in two passes: ``consolidate --adapter hf-to-olmo-core`` to a ``.pt`` (``{"model": ...}``), then
    ``reshard`` of that file for 3 ranks keeps its nesting (``model.<fqn>``), which OLMo-core's
    ``load_model_and_optim_state`` reads at 3 ranks: its model holds ``convert_state_from_hf`` of the folder."""
    hf = tmp_path / "hf"
    _olmo_hf.save_hf(hf)
    full = tmp_path / "olmo.pt"
    args = ["consolidate", str(hf), str(full), "--adapter", NAME, "--model-config", str(hf / "config.json")]
    assert (result := runner.invoke(app, args)).exit_code == 0, result.output
    step = tmp_path / "step0"
    step.mkdir()
    model_dir = step / "model_and_optim"
    result = runner.invoke(app, ["reshard", str(full), str(model_dir), "--world-size", str(TARGET)])
    assert result.exit_code == 0, result.output

    _olmo.preload()
    run_ranks(_olmo_hf.olmo_load_model, TARGET, model_dir, _want(hf, tmp_path), timeout=300)


def _infos(*fqns: str) -> list[TensorInfo]:
    return [TensorInfo(fqn, as_dtype(torch.float32), (4, 4)) for fqn in fqns]


def test_hf_to_olmo_core_refuses_what_convert_state_from_hf_refuses() -> None:
    """A key its map does not know (Llama's ``input_layernorm``), a layer past ``num_hidden_layers``, another
    ``model_type`` and a tied head without an embedding are refused naming them; an old save's
    ``rotary_emb.inv_freq`` buffer is left out."""
    base = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]
    assert list(olmo.from_hf(_infos(*base, "model.layers.0.self_attn.rotary_emb.inv_freq"), {})) == [
        "embeddings.weight",
        "blocks.0.attention.w_q.weight",
        "lm_head.w_out.weight",
    ]
    with pytest.raises(UnsupportedTransformError, match=r"model\.layers\.0\.input_layernorm\.weight: not an OLMo-2/3 weight"):
        olmo.from_hf(_infos(*base, "model.layers.0.input_layernorm.weight"), {"model_type": "olmo2"})
    with pytest.raises(UnsupportedTransformError, match=r"model\.layers\.2\.mlp\.up_proj\.weight: layer 2 is past num_hidden"):
        olmo.from_hf(_infos(*base, "model.layers.2.mlp.up_proj.weight"), {"num_hidden_layers": 2})
    with pytest.raises(InvalidOptionError, match="hf-to-olmo-core: model_type 'llama' is not one it maps"):
        olmo.from_hf(_infos(*base), {"model_type": "llama"})
    with pytest.raises(UnsupportedTransformError, match="tie_word_embeddings is set but model.embed_tokens.weight"):
        olmo.from_hf(_infos("lm_head.weight"), {"tie_word_embeddings": True})
