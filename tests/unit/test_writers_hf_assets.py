"""writers.hf_assets: the allow-list, the config's dtype and tie, local and fsspec folders, links and sizes."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fsdp_convert.errors import CheckpointNotFoundError, InvalidOptionError, OutputWriteError, UnsafeContentError
from fsdp_convert.writers import hf_assets
from fsdp_convert.writers.hf_assets import (
    HfAssets,
    open_hf_assets,
    rewrite_config,
    tie_word_embeddings,
    tied_output_keys,
    weights_dtype,
    write_hf_assets,
)

CONFIG = {"model_type": "llama", "tie_word_embeddings": True, "transformers_version": "4.57.6", "vocab_size": 97}
BOTH = {"torch_dtype": "bfloat16", "dtype": "bfloat16"}
OLD = {"transformers_version": "4.45.2"}


def _canonical(config: dict[str, object]) -> bytes:
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()  # PretrainedConfig.to_json_string


def _folder(root: Path, config: dict[str, object] = CONFIG) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_bytes(_canonical(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "merges.txt", "vocab.json"):
        (root / name).write_text(name)
    for name in ("model.safetensors", "model-00001-of-00002.safetensors", "pytorch_model.bin", "training_args.bin",
                 "model.safetensors.index.json", "modeling_x.py", "optimizer.pt", "README.md", "run.sh"):  # fmt: skip
        (root / name).write_text("no")
    (root / "additional_chat_templates").mkdir()
    (root / "additional_chat_templates" / "tools.jinja").write_text("{{ tools }}")
    (root / "additional_chat_templates" / "x.py").write_text("no")
    return root


def test_only_allowed_names_are_copied(tmp_path: Path) -> None:
    assets = open_hf_assets(_folder(tmp_path / "src"))
    assert assets.files == (
        "additional_chat_templates/tools.jinja",
        "generation_config.json",
        "merges.txt",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
    )
    out = tmp_path / "out"
    out.mkdir()
    written = write_hf_assets(assets, out, dtype=None)
    assert [p.relative_to(out).as_posix() for p in written] == [*assets.files, "config.json"]  # config last
    assert (out / "config.json").read_bytes() == (tmp_path / "src" / "config.json").read_bytes()
    assert (out / "merges.txt").read_text() == "merges.txt"


def test_a_hub_cache_snapshot_reads_its_blobs(tmp_path: Path) -> None:
    """A hub cache snapshot's files are relative links to ../../blobs/<hash> of the same repo folder: inside."""
    repo = tmp_path / "hub" / "models--org--name"
    src = _folder(repo / "blobs")
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        (snapshot / name).symlink_to(Path("../../blobs") / name)
    assets = open_hf_assets(snapshot)
    assert assets.files == ("tokenizer.json",)
    out = tmp_path / "out"
    out.mkdir()
    write_hf_assets(assets, out, dtype=None)
    assert not (out / "tokenizer.json").is_symlink() and (out / "tokenizer.json").read_text() == "tokenizer.json"
    assert (out / "tokenizer.json").stat().st_mode & 0o777 == 0o644
    (snapshot / "merges.txt").symlink_to(src.parent.parent / "other" / "merges.txt")  # another repo: outside
    (src.parent.parent / "other").mkdir()
    (src.parent.parent / "other" / "merges.txt").write_text("x")
    with pytest.raises(UnsafeContentError, match="merges.txt is a symbolic link"):
        open_hf_assets(snapshot)


SECRET = b"API_KEY=sk-live-0123456789abcdef\n"


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "additional_chat_templates/tools.jinja"])
def test_a_link_out_of_the_folder_is_refused(tmp_path: Path, name: str) -> None:
    """``tokenizer.json -> /etc/shadow``: before, its bytes were copied into OUT as 0644."""
    secret = tmp_path / "secret.env"
    secret.write_bytes(SECRET)
    src = _folder(tmp_path / "src")
    (src / name).unlink()
    (src / name).symlink_to(secret)
    with pytest.raises(UnsafeContentError, match=f"{src / name} is a symbolic link that leads outside") as caught:
        open_hf_assets(src)
    assert "API_KEY" not in str(caught.value) and "--follow-symlinks" in caught.value.cli_text()
    if name != "config.json":  # a link asked for is copied
        out = tmp_path / "out"
        out.mkdir()
        write_hf_assets(open_hf_assets(src, follow_symlinks=True), out, dtype=None)
        assert (out / name).read_bytes() == SECRET and not (out / name).is_symlink()


def test_a_file_swapped_for_a_link_after_listing_is_not_copied(tmp_path: Path) -> None:
    secret = tmp_path / "secret.env"
    secret.write_bytes(SECRET)
    src = _folder(tmp_path / "src")
    assets = open_hf_assets(src)
    (src / "vocab.json").unlink()
    (src / "vocab.json").symlink_to(secret)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UnsafeContentError, match="vocab.json is a symbolic link"):
        write_hf_assets(assets, out, dtype=None)
    assert all(p.read_bytes() != SECRET for p in out.rglob("*") if p.is_file())


def _peak_rss_growth(fn: Callable[[], object]) -> tuple[int, str]:
    """Run ``fn`` in a forked child: how far its peak resident memory grew (bytes), and what it raised."""
    parent, child = mp.get_context("fork").Pipe()

    def run() -> None:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            fn()
            raised = ""
        except Exception as e:  # noqa: BLE001 (reported to the parent)
            raised = f"{type(e).__name__}: {e}"
        child.send(((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024, raised))

    proc = mp.get_context("fork").Process(target=run)
    proc.start()
    proc.join(120)
    assert parent.poll(1), f"child died with exit code {proc.exitcode}"
    return parent.recv()  # type: ignore[no-any-return]


def test_a_huge_config_is_refused_unread(tmp_path: Path) -> None:
    """A 2 GiB sparse config.json: before, read whole (and decoded) into memory."""
    src = _folder(tmp_path / "src")
    os.truncate(src / "config.json", 2 << 30)
    growth, raised = _peak_rss_growth(lambda: open_hf_assets(src))
    assert raised.startswith("InvalidOptionError") and "config.json is larger than 16.8 MB" in raised, raised
    assert growth < 64 << 20, growth


def test_a_config_that_is_not_utf8_is_not_quoted(tmp_path: Path) -> None:
    src = _folder(tmp_path / "src")
    (src / "config.json").write_bytes(b'{"name": "\xff\xfe"}')
    with pytest.raises(InvalidOptionError, match="not valid JSON") as caught:
        open_hf_assets(src)
    assert "0xff" not in str(caught.value) and "xff" not in str(caught.value)


def test_asset_bytes_are_counted_and_must_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 10 GB sparse tokenizer.json: its copy takes 10 GB; before, nothing counted it and the copy filled the disk."""
    src = _folder(tmp_path / "src")
    os.truncate(src / "tokenizer.json", 10**10)
    assets = open_hf_assets(src)
    assert assets.nbytes >= 10**10 + len(_canonical(CONFIG))
    monkeypatch.setattr(hf_assets, "free_bytes", lambda folder: 10**9)  # a disk with 1 GB free
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OutputWriteError, match=r"No space left on device: the hf_assets files need 10.0 GB but 1.0 GB"):
        write_hf_assets(assets, out, dtype=None)
    assert not list(out.iterdir())  # refused before the first copy


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="is not a folder"):
        open_hf_assets(tmp_path / "missing")
    with pytest.raises(InvalidOptionError, match="no config.json"):
        open_hf_assets(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(InvalidOptionError, match="expected a JSON object"):
        open_hf_assets(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(InvalidOptionError, match="not valid JSON"):
        open_hf_assets(tmp_path)
    with pytest.raises(InvalidOptionError, match="folder output"):
        open_hf_assets(tmp_path, folder_output=False)
    with pytest.raises(InvalidOptionError, match="no model weights"):
        open_hf_assets(tmp_path, model=False)


def test_fsspec_folder(tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/hf-assets-unit-{uuid.uuid4().hex[:8]}"
    fs.put(str(_folder(tmp_path / "src")), root, recursive=True)
    try:
        assets = open_hf_assets(f"memory://{root}")
        assert assets.files == open_hf_assets(tmp_path / "src").files
        assert assets.config == CONFIG
        out = tmp_path / "out"
        out.mkdir()
        write_hf_assets(assets, out, dtype=torch.bfloat16)
        assert (out / "additional_chat_templates" / "tools.jinja").read_text() == "{{ tools }}"
        assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
        with pytest.raises(CheckpointNotFoundError, match="does not exist"):
            open_hf_assets(f"memory://{root}-missing")
    finally:
        fs.rm(root, recursive=True)


@pytest.mark.parametrize(
    ("config", "dtype", "want"),
    [
        ({**CONFIG, "dtype": "float32"}, torch.float32, None),  # unchanged: the same bytes
        ({**CONFIG, "dtype": "float32"}, None, None),
        ({**CONFIG, "dtype": "float32"}, torch.bfloat16, {**CONFIG, "dtype": "bfloat16"}),
        ({**CONFIG, "torch_dtype": "float32"}, torch.float16, {**CONFIG, "torch_dtype": "float16"}),
        ({**CONFIG, "torch_dtype": "float32", "dtype": "float32"}, torch.bfloat16, {**CONFIG, **BOTH}),
        (CONFIG, torch.bfloat16, {**CONFIG, "dtype": "bfloat16"}),  # 4.56 and later read dtype
        ({**CONFIG, **OLD}, torch.bfloat16, {**CONFIG, **OLD, "torch_dtype": "bfloat16"}),  # 4.55 and earlier
        ({"model_type": "llama"}, torch.bfloat16, {"model_type": "llama", "torch_dtype": "bfloat16"}),  # every version reads it
    ],
)  # fmt: skip
def test_rewrite_config(config: dict[str, object], dtype: torch.dtype | None, want: dict[str, object] | None) -> None:
    source = _canonical(config)
    got = rewrite_config(source, dtype)
    assert got == (source if want is None else _canonical(want))


def test_rewrite_keeps_everything_else_byte_for_byte() -> None:
    source = _canonical({**CONFIG, "dtype": "float32", "rms_norm_eps": 1e-06, "name": "é", "rope_scaling": None})
    got = rewrite_config(source, torch.bfloat16)
    assert got == source.replace(b'"dtype": "float32"', b'"dtype": "bfloat16"')


def test_tie_word_embeddings() -> None:
    assert tie_word_embeddings({"tie_word_embeddings": False, "model_type": "gemma"}) is False
    assert tie_word_embeddings({"model_type": "gemma"}) is True  # absent: the model type's default
    assert tie_word_embeddings({"model_type": "llama"}) is False
    assert tie_word_embeddings({"model_type": "no-such-model"}) is None
    assert tie_word_embeddings({}) is None


def _assets(config: dict[str, object]) -> HfAssets:
    return HfAssets(source=Path("/m"), config=config, config_bytes=b"", files=())


def test_tied_output_keys() -> None:
    keys = ["model.embed_tokens.weight", "lm_head.weight"]
    assert tied_output_keys(_assets(CONFIG), keys) == ("lm_head.weight",)
    assert tied_output_keys(_assets(CONFIG), keys[:1]) == ()
    untied = {**CONFIG, "tie_word_embeddings": False}
    assert tied_output_keys(_assets(untied), keys) == ()
    with pytest.raises(InvalidOptionError, match=r"/m/config.json: tie_word_embeddings is false .* lm_head.weight"):
        tied_output_keys(_assets(untied), keys[:1])
    assert tied_output_keys(_assets({**untied, "architectures": ["LlamaModel"]}), keys[:1]) == ()  # no head
    assert tied_output_keys(_assets({"model_type": "no-such-model"}), keys) == ()  # unknown: as the checkpoint has it


def test_weights_dtype() -> None:
    assert weights_dtype(torch.bfloat16, [torch.float32]) == torch.bfloat16
    assert weights_dtype(None, [torch.float32, torch.int64, None, torch.float32]) == torch.float32
    assert weights_dtype(None, [torch.float32, torch.bfloat16]) is None
    assert weights_dtype(None, []) is None
