"""writers/_output_check.py: OUT is not an input nor around one, no link, free, and a folder replaced is this tool's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_convert import output_table, producers
from fsdp_convert.errors import InvalidOptionError, OutputExistsError
from fsdp_convert.formats import dcp
from fsdp_convert.remote import Url, normal_url
from fsdp_convert.writers import _output_check, hf_assets
from fsdp_convert.writers._output_check import check_output, check_output_free, foreign_entry
from fsdp_convert.writers.transaction import staging_prefix


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    folder = tmp_path / "parent" / "ckpt"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"m")
    return folder


@pytest.mark.parametrize(
    ("out", "relation"),
    [
        ("{c}", "is"),
        ("{c}/", "is"),
        ("file://{c}", "is"),
        ("{c}/../ckpt", "is"),
        ("{link}", "is"),  # a link to the checkpoint
        ("{c}/.metadata", "is inside"),
        ("{c}/new/full.pt", "is inside"),
        ("{c}/..", "holds"),
        ("{c}/../..", "holds"),
    ],
)
def test_out_may_not_be_the_input_inside_it_or_around_it(ckpt: Path, out: str, relation: str) -> None:
    link = ckpt.parent / "link"
    link.symlink_to(ckpt)
    for overwrite in (False, True):
        with pytest.raises(InvalidOptionError, match=f" {relation} the input {ckpt}: ") as e:
            check_output(out.format(c=ckpt, link=link), [ckpt], overwrite=overwrite, force=True)
        assert e.value.exit_code == 2
    with pytest.raises(InvalidOptionError, match=f" the input {link}: "):
        check_output(out.format(c=ckpt, link=link), [None, link], overwrite=True)  # the input through a link


def test_a_bind_mount_or_other_spelling_is_the_same_folder(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paths that differ as text but name the same folder (a bind mount) are compared by (st_dev, st_ino)."""
    other = ckpt.parent / "mounted"
    other.mkdir()
    real_realpath = _output_check.os.path.realpath
    monkeypatch.setattr(_output_check.os.path, "realpath", lambda p: real_realpath(ckpt if str(p) == str(other) else p))
    real_stat = _output_check.os.stat
    monkeypatch.setattr(_output_check.os, "stat", lambda p, *a, **k: real_stat(ckpt if str(p) == str(other) else p, *a, **k))
    with pytest.raises(InvalidOptionError, match="is the input"):
        check_output(other, [ckpt], overwrite=True)


def test_unrelated_outputs_pass(ckpt: Path) -> None:
    check_output(ckpt.parent / "ckpt-ws1", [ckpt], overwrite=False)  # a sibling sharing a prefix as text
    check_output(ckpt.parent / "out.pt", [ckpt, None], overwrite=False)
    check_output("s3://bucket/ckpt", [ckpt], overwrite=False)  # a URL and a local path never clash
    check_output(ckpt.parent / "x.pt", ["s3://bucket/ckpt"], overwrite=False)


@pytest.mark.parametrize(
    ("out", "relation"),
    [
        ("s3://bucket/ckpt", "is"),
        ("S3://Bucket//ckpt/./", "is"),
        ("s3://bucket/ckpt/.metadata", "is inside"),
        ("s3://bucket", "holds"),
        ("s3://bucket/a/../ckpt", "is"),
    ],
)
def test_urls_are_compared_normalized(out: str, relation: str) -> None:
    with pytest.raises(InvalidOptionError, match=f" {relation} the input "):
        check_output(out, ["s3://bucket/ckpt"], overwrite=True)
    check_output("s3://bucket/ckpt-ws1", ["s3://bucket/ckpt"], overwrite=True)
    check_output("s3://other/ckpt", ["s3://bucket/ckpt"], overwrite=True)
    assert normal_url("S3://Bucket/a//b/./c/") == "s3://bucket/a/b/c" == normal_url("s3://bucket/a/b/c")
    assert staging_prefix(Url("S3://Bucket//ckpt/")) == staging_prefix(Url("s3://bucket/ckpt"))  # a killed run's found
    assert staging_prefix(Url("s3://bucket/ckpt")) != staging_prefix(Url("s3://bucket/ckpt2"))


def _folder(root: Path, names: list[str]) -> Path:
    for name in names:
        path = root / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"")
    return root


OURS = {
    "empty": [],
    "hf folder": ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                  "optimizer.pt", "extra_state.pt", "config.json", "tokenizer.json", "additional_chat_templates/tool.jinja"],
    "one shard": ["model.safetensors"],
    "lora": ["adapter_model.safetensors", "adapter_config.json"],
    "dcp": [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"],
    "accelerate": ["pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp", "optimizer_0/.metadata",
                   "scheduler.bin", "sampler_1.bin", "scaler.pt", "custom_checkpoint_0.pkl"],
    "megatron-core": [".metadata", "__0_0.distcp", "common.pt", "metadata.json"],
    "olmo-core": ["model_and_optim/.metadata", "model_and_optim/__1_0.distcp", "config.json", ".metadata.json"],
}  # fmt: skip
# what reshard asks of OUT: the output kinds' names and the producers' (its copied side files, DCP folders)
RESHARD_FILES = output_table.own_files() | producers.own_files()
FOREIGN = {
    "a readme": (["model.safetensors", "README.md"], "README.md"),
    "a hidden file": ([".metadata", ".git/"], ".git/"),
    "checkpoints": (["step-1000/.metadata", "step-1000/__0_0.distcp"], "step-1000/"),
    "an accelerate folder with more": (["optimizer_0/.metadata", "optimizer_0/notes.txt"], "optimizer_0/"),
    "a nested model file": (["sub/model.safetensors"], "sub/"),
    "a control byte": (["a\x1bb"], "'a\\x1bb'"),
}


@pytest.mark.parametrize("case", sorted(OURS))
def test_a_folder_of_this_tools_files_looks_like_its_output(tmp_path: Path, case: str) -> None:
    folder = _folder(tmp_path / "out", OURS[case] or ["x/"])
    if not OURS[case]:
        (folder / "x").rmdir()
    assert foreign_entry(folder, RESHARD_FILES) is None
    check_output_free(folder, overwrite=True, directory=True, own_files=RESHARD_FILES)
    check_output(folder, [], overwrite=True, own_files=RESHARD_FILES)


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_a_folder_holding_anything_else_needs_force(tmp_path: Path, case: str) -> None:
    names, shown = FOREIGN[case]
    folder = _folder(tmp_path / "out", names)
    assert foreign_entry(folder, RESHARD_FILES) == shown
    with pytest.raises(OutputExistsError) as e:
        check_output_free(folder, overwrite=True, directory=True, own_files=RESHARD_FILES)
    assert e.value.exit_code == 4
    assert e.value.cli_text() == (
        f"{folder} is a folder fsdp-convert did not write (it holds {shown}), which replacing it deletes: "
        "pass --overwrite --force to replace it anyway, or name another OUT"
    )
    assert "force=True" in str(e.value) and "--" not in str(e.value)  # the library's wording
    check_output_free(folder, overwrite=True, force=True, directory=True)
    check_output(folder, [], overwrite=True, force=True)


def test_check_output_free_rules(tmp_path: Path) -> None:
    (tmp_path / "f.pt").write_bytes(b"")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    check_output_free(tmp_path / "new.pt", overwrite=False)
    with pytest.raises(OutputExistsError, match="already exists; pass overwrite=True"):
        check_output_free(tmp_path / "f.pt", overwrite=False)
    check_output_free(tmp_path / "f.pt", overwrite=True)
    for overwrite in (False, True):  # a usage error, before whether it may be replaced
        with pytest.raises(InvalidOptionError, match="dir is a folder; this output is one file"):
            check_output_free(tmp_path / "dir", overwrite=overwrite, directory=False)
    for link in ("link", "dangling"):
        for overwrite in (False, True):
            with pytest.raises(OutputExistsError, match="is a symbolic link"):
                check_output_free(tmp_path / link, overwrite=overwrite, force=True, directory=True)
        with pytest.raises(OutputExistsError, match="is a symbolic link"):
            check_output(tmp_path / link, [], overwrite=True, free=False)  # with --resume too


def test_the_names_are_the_tables_own() -> None:
    """No list of its own: the output kinds' names (``--hf-assets``' included), and a producer's from its record alone."""
    outputs = output_table.own_files()
    assert all(outputs.file(name) for name in hf_assets.ASSET_FILENAMES)
    templates = outputs.folder(hf_assets.CHAT_TEMPLATE_DIR)
    assert templates is not None and templates.fullmatch("tool_use.jinja")
    accelerate, lightning = producers.get("accelerate"), producers.get("lightning")
    assert accelerate.folders is dcp.ACCELERATE_DIR_RE and RESHARD_FILES.folder("optimizer_0") is dcp.DCP_FILE_RE
    assert lightning.merged is not None and RESHARD_FILES.file(lightning.merged)
    assert not any(outputs.file(name) for name in ("meta.pt", "common.pt", "scheduler.bin", ".metadata.json"))
    assert outputs.folder("optimizer_0") is None


def test_the_default_names_are_the_output_kinds_alone(tmp_path: Path) -> None:
    """A caller that names no producer's files (consolidate) replaces a folder of the output kinds' names alone."""
    folder = _folder(tmp_path / "out", OURS["hf folder"] + OURS["lora"] + [".metadata", "__0_0.distcp"])
    check_output_free(folder, overwrite=True, directory=True)
    (folder / "meta.pt").write_bytes(b"")
    assert foreign_entry(folder) == "meta.pt" and foreign_entry(folder, RESHARD_FILES) is None


def test_it_imports_no_torch() -> None:
    """The CLI's precheck calls check_output before torch is imported."""
    code = "import sys, json; import fsdp_convert.writers._output_check; print(json.dumps('torch' in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout) is False
