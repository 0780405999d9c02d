"""A newcomer's wrong turns with paths, each answered at once with the way forward, by the CLI and the library alike.

Rows of the first-hour table: a file of a DCP folder given as the checkpoint (2), a folder at a
file OUT (4), a missing folder for OUT and a file suffix on reshard's folder (8), an empty folder
as OUT (9). The CLI's answers come before torch is imported (``cli._precheck``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli import app
from fsdp_convert.cli._precheck import check_consolidate, check_reshard
from fsdp_convert.errors import CheckpointError, InvalidOptionError, NotADcpCheckpointError, OutputExistsError
from fsdp_convert.formats import open_checkpoint
from fsdp_convert.remote import as_location
from fsdp_convert.writers import check_output
from tests._cli_probe import cli_probe
from tests._samples import Sample


def _before_torch(argv: list[str], code: int, needle: str) -> str:
    """``fsdp-convert ARGV`` exits ``code`` with one line holding ``needle``, torch never imported."""
    report, stderr = cli_probe(argv, timeout=120)
    assert report == {"code": code, "modules": []}, (report, stderr)
    assert stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1, stderr
    assert needle in stderr, stderr
    return stderr.strip().removeprefix("error: ")


def _raised(call: Callable[[], object]) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        call()
    return info.value


def _consolidate_check(checkpoint: Path, output: Path, **kwargs: object) -> None:
    options: dict[str, object] = {"output_format": "auto", "only": "all", "lora_only": False, "verify_output": False}
    options |= {"overwrite": False, "resume": False} | kwargs
    check_consolidate(str(checkpoint), str(output), **options)  # type: ignore[arg-type]


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("name", ["__1_0.distcp", ".metadata"])
def test_row2_one_file_of_a_dcp_folder_names_the_folder(name: str, ws3_ckpt: Sample, tmp_path: Path) -> None:
    """Before: exit 1 "not a readable torch.save file" after seconds, or exit 3 "unknown checkpoint file type ''"."""
    ck = ws3_ckpt.checkpoint
    said = f"{ck / name} is one file of the DCP checkpoint {ck}: pass the folder {ck}"
    for command in (["consolidate", str(ck / name), str(tmp_path / "out.pt")], ["inspect", str(ck / name)]):
        assert _before_torch(command, 3, said) == said
    library = _raised(lambda: fsdp_convert.consolidate(ck / name, tmp_path / "out.pt"))
    assert isinstance(library, NotADcpCheckpointError) and str(library) == said
    with pytest.raises(NotADcpCheckpointError, match="pass the folder"):
        open_checkpoint(as_location(ck / name), full_files=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "flags"),
    [
        ("dir.pt", []),
        ("dir.pt", ["--overwrite"]),
        ("dir.pt", ["--format", "torch", "--overwrite"]),
        ("dir.safetensors", ["--format", "safetensors"]),
        ("dir.safetensors", ["--overwrite", "--force"]),
    ],
)
def test_row4_out_folder_with_file_suffix_is_a_usage_error(name: str, flags: list[str], ws3_ckpt: Sample, tmp_path: Path) -> None:
    """Before: exit 4 "already exists; pass --overwrite", then with it exit 1 "is a folder; give a file path"."""
    out = tmp_path / name
    (out / "keep").mkdir(parents=True)
    said = _before_torch(["consolidate", str(ws3_ckpt.checkpoint), str(out), *flags], 2, f"{out} is a folder; ")
    assert "one file" in said and "name a path that is not a folder" in said
    overwrite = "--overwrite" in flags
    library = _raised(lambda: fsdp_convert.consolidate(ws3_ckpt.checkpoint, out, overwrite=overwrite, force=overwrite))
    assert isinstance(library, InvalidOptionError) and library.cli_text() == said
    assert _tree(tmp_path) == [name, f"{name}/keep"]


@pytest.mark.parametrize("command", ["consolidate", "reshard"])
def test_row8_missing_parent_folder_is_refused(command: str, ws3_ckpt: Sample, tmp_path: Path) -> None:
    """Before: exit 0, the missing folders made silently (at ``/`` for ``/nonexistent-dir/sub/y.pt``)."""
    out = tmp_path / "nonexistent-dir" / "sub" / ("y.pt" if command == "consolidate" else "y")
    extra = ["--world-size", "2"] if command == "reshard" else []
    needle = f"cannot write {out}: its folder {out.parent} does not exist"
    said = _before_torch([command, str(ws3_ckpt.checkpoint), str(out), *extra], 2, needle)
    assert f"mkdir -p {out.parent}" in said
    if command == "consolidate":
        library = _raised(lambda: fsdp_convert.consolidate(ws3_ckpt.checkpoint, out))
    else:
        library = _raised(lambda: fsdp_convert.reshard(ws3_ckpt.checkpoint, out, world_size=2))
    assert isinstance(library, InvalidOptionError) and library.cli_text() == said
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(InvalidOptionError, match=f"its folder {tmp_path / 'file'} is not a folder"):
        check_output(tmp_path / "file" / "y.pt", [], overwrite=False)
    check_output("memory://bucket/nonexistent-dir/y.pt", [], overwrite=False)  # a URL: its folders are the store's
    assert _tree(tmp_path) == ["file"]


def test_row8_reshard_out_with_file_suffix_is_refused(ws3_ckpt: Sample, tmp_path: Path) -> None:
    """Before: exit 0, a DCP folder named ``ws3.pt``."""
    out = tmp_path / "ws3.pt"
    argv = ["reshard", str(ws3_ckpt.checkpoint), str(out), "--world-size", "3"]
    said = _before_torch(argv, 2, f"{out}: the output is a folder (reshard writes a DCP folder), not a .pt file")
    assert said.endswith("name OUT without a file suffix")
    library = _raised(lambda: fsdp_convert.reshard(ws3_ckpt.checkpoint, out, world_size=3))
    assert isinstance(library, InvalidOptionError) and library.cli_text() == said
    library = _raised(lambda: fsdp_convert.reshard(ws3_ckpt.checkpoint, out, world_size=3, resume=True))
    assert library.cli_text() == said  # --resume too
    assert list(tmp_path.iterdir()) == []


def test_row9_empty_folder_is_a_free_out(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    """Before: exit 4 "already exists; pass --overwrite" for a folder just made with ``mkdir``."""
    ck = ws3_ckpt.checkpoint
    hf, dcp = tmp_path / "hf", tmp_path / "ws2"
    hf.mkdir()
    dcp.mkdir()
    _consolidate_check(ck, hf)
    check_reshard(str(ck), str(dcp), overwrite=False, resume=False)
    result = runner.invoke(app, ["consolidate", str(ck), str(hf), "--nproc", "1"])
    assert result.exit_code == 0, result.stderr
    assert (hf / "model.safetensors.index.json").is_file() or (hf / "model.safetensors").is_file()
    result = runner.invoke(app, ["reshard", str(ck), str(dcp), "--world-size", "2", "--nproc", "1"])
    assert result.exit_code == 0, result.stderr
    assert fsdp_convert.inspect_checkpoint(dcp).world_size == 2
    # a folder holding anything is not free, and a folder is never a file OUT, empty or not
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("")
    with pytest.raises(OutputExistsError, match="already exists; pass overwrite=True"):
        _consolidate_check(ck, tmp_path / "notes")
    (tmp_path / "empty.pt").mkdir()
    with pytest.raises(InvalidOptionError, match="empty.pt is a folder; "):
        _consolidate_check(ck, tmp_path / "empty.pt")
