"""``consolidate --hf-assets``: a folder ``AutoModelForCausalLM`` and ``AutoTokenizer`` load with no glue code."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fsdp_convert.cli.app import app
from tests._hf import EVAL
from tests.integration.test_hf import llama_runs  # noqa: F401  (the FSDP2-trained tiny Llama, as a fixture)

ASSETS = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "additional_chat_templates/tool_use.jinja",
}  # what the fixture's folder holds that a model needs (special_tokens_map.json too under transformers 4)
DECOYS = {"model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "optimizer.pt", "modeling_evil.py"}
TEXT = "w1 w5 w17 zz"


def _tokenizer():  # type: ignore[no-untyped-def]
    """A word-level fast tokenizer over the tiny Llama's 97 ids, built in process (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(94)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def assets(llama_runs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """Per run (``tied``, ``untied``): a folder as ``save_pretrained`` leaves it, with weights and code beside."""
    from transformers import GenerationConfig

    root = tmp_path_factory.mktemp("assets")
    for tie in ("tied", "untied"):
        folder = root / tie
        folder.mkdir()
        shutil.copy(llama_runs / tie / "config.json", folder / "config.json")
        tokenizer = _tokenizer()
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        tokenizer.save_pretrained(folder)
        GenerationConfig(bos_token_id=1, eos_token_id=2, max_new_tokens=5, do_sample=False).save_pretrained(folder)
        (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
        for name in DECOYS:
            (folder / name).write_bytes(b"not to be copied")
    return root


def _consolidate(runner: CliRunner, checkpoint: Path, out: Path | str, *extra: str) -> None:
    args = ["consolidate", str(checkpoint), str(out), "--only", "model", "--max-shard-size", "20KB", *extra]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr


def _check_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer(TEXT).input_ids == _tokenizer()(TEXT).input_ids == [4, 8, 20, 0]
    assert tokenizer.eos_token == "</s>"
    generation = GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.max_new_tokens) == (2, 5)


@pytest.mark.parametrize("tie", ["untied", "tied"])
def test_from_pretrained_with_no_glue_code(
    llama_runs: Path,  # noqa: F811
    assets: Path,
    runner: CliRunner,
    tmp_path: Path,
    tie: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "hf"
    _consolidate(runner, llama_runs / tie / "checkpoint", out, "--hf-assets", str(assets / tie), "--verify")
    written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert ASSETS <= written and not written & DECOYS - {"model.safetensors.index.json"}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) == (tie == "untied")
    source = json.loads((assets / tie / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config == {**source, "dtype": "float32"}  # the weights are float32; nothing else changes
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == (tie == "tied")
    want = torch.load(llama_runs / tie / EVAL, weights_only=True)
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=want["input_ids"]).logits, want["logits"])
    _check_tokenizer(out)


def test_untied_config_without_lm_head_is_an_error(
    llama_runs: Path,  # noqa: F811
    assets: Path,
    runner: CliRunner,
    tmp_path: Path,
) -> None:
    out = tmp_path / "hf"
    args = ["consolidate", str(llama_runs / "untied" / "checkpoint"), str(out), "--hf-assets", str(assets / "untied")]
    result = runner.invoke(app, [*args, "--exclude", "lm_head.weight"])
    assert result.exit_code == 2, result.stderr
    assert "lm_head.weight" in result.stderr and "tie_word_embeddings is false" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the temporary


def test_file_output_is_a_usage_error(llama_runs: Path, assets: Path, runner: CliRunner, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "model.safetensors"
    result = runner.invoke(
        app, ["consolidate", str(llama_runs / "tied" / "checkpoint"), str(out), "--hf-assets", str(assets / "tied")]
    )
    assert result.exit_code == 2 and "--hf-assets" in result.stderr
    assert not out.exists()


def test_dtype_bf16_is_in_the_config_and_loads_as_bf16(
    llama_runs: Path,  # noqa: F811
    assets: Path,
    runner: CliRunner,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "hf"
    _consolidate(runner, llama_runs / "tied" / "checkpoint", out, "--hf-assets", str(assets / "tied"), "--dtype", "bf16")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "torch_dtype" not in config
    assert (out / "config.json").read_text() == json.dumps(config, indent=2, sort_keys=True) + "\n"  # to_json_string's form
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    want = torch.load(llama_runs / "tied" / EVAL, weights_only=True)
    with torch.no_grad():
        got = model.eval()(input_ids=want["input_ids"]).logits
    torch.testing.assert_close(got.float(), want["logits"], atol=0.05, rtol=0.05)


def test_fsspec_source_and_output(
    llama_runs: Path,  # noqa: F811
    assets: Path,
    runner: CliRunner,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DIR on an fsspec filesystem (``memory://``, the same code path as ``s3://``) into a remote OUT."""
    import fsspec
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fs = fsspec.filesystem("memory")
    root = f"/hf-assets-{uuid.uuid4().hex[:8]}"
    fs.put(str(assets / "tied"), f"{root}/assets", recursive=True)
    try:
        _consolidate(runner, llama_runs / "tied" / "checkpoint", f"memory://{root}/out", "--hf-assets", f"memory://{root}/assets")
        out = tmp_path / "out"
        fs.get(f"{root}/out", str(out), recursive=True)
        written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
        assert ASSETS <= written and not written & DECOYS - {"model.safetensors.index.json"}
        for name in ASSETS - {"config.json"}:
            assert (out / name).read_bytes() == (assets / "tied" / name).read_bytes(), name
        model = AutoModelForCausalLM.from_pretrained(out)
        want = torch.load(llama_runs / "tied" / EVAL, weights_only=True)
        with torch.no_grad():
            assert torch.equal(model.eval()(input_ids=want["input_ids"]).logits, want["logits"])
        _check_tokenizer(out)
    finally:
        fs.rm(root, recursive=True)
