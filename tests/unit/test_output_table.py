"""output_table.py: one row per output kind, without torch; the chooser, the names written, the files read back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_convert import output_table
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.output_table import (
    DCP_ROW,
    HF_ROW,
    OUTPUT_ROWS,
    PEFT_ROW,
    SAFETENSORS_ROW,
    TORCH_SAVE_ROW,
    OutputRow,
    check_format,
    check_only,
    check_verifiable,
    choose_row,
    folder_files,
    format_names,
    last_files,
    own_files,
    suffixes_holding,
)


def test_the_table_imports_no_torch_and_nothing_above_it() -> None:
    probe = (
        "import sys, fsdp_convert.output_table; print(sorted(m for m in sys.modules if m.startswith(('torch', 'fsdp_convert.'))))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "['fsdp_convert.errors', 'fsdp_convert.output_table', 'fsdp_convert.own_files']"


def test_row_names_are_unique_and_format_names_come_from_the_rows() -> None:
    assert len({row.name for row in OUTPUT_ROWS}) == len(OUTPUT_ROWS)
    assert format_names() == ("auto", "torch", "safetensors")
    assert check_format("torch") == "torch"
    with pytest.raises(InvalidOptionError, match=r"^output_format='gguf': use auto, torch or safetensors$") as caught:
        check_format("gguf")
    assert caught.value.cli_text() == "--format 'gguf': use auto, torch or safetensors"


@pytest.mark.parametrize(
    ("name", "requested", "row"),
    [
        ("o.pt", "auto", TORCH_SAVE_ROW),
        ("o.BIN", "auto", TORCH_SAVE_ROW),
        ("o.safetensors", "auto", SAFETENSORS_ROW),
        ("folder", "auto", HF_ROW),
        ("last.ckpt", "torch", TORCH_SAVE_ROW),
        ("o.pt", "torch", TORCH_SAVE_ROW),
        ("o.safetensors", "safetensors", SAFETENSORS_ROW),
        ("last.ckpt", "safetensors", HF_ROW),
        ("folder", "safetensors", HF_ROW),
    ],
)
def test_choose_row(tmp_path: Path, name: str, requested: str, row: OutputRow) -> None:
    assert choose_row(tmp_path / name, requested) is row


@pytest.mark.parametrize(
    ("name", "requested", "lora_only", "message"),
    [
        ("o.txt", "auto", False, "unknown output suffix '.txt'; use one of .pt, .pth, .bin, .safetensors or a folder name, "
         "or --format torch to write a torch.save file under this name"),
        ("o.safetensors", "torch", False, "--format torch writes one torch.save file, not a .safetensors name"),
        ("o.pt", "safetensors", False, "--format safetensors needs a .safetensors name or a folder, not '.pt'"),
        ("o.pt", "auto", True, "--lora-only writes a PEFT adapter folder; name OUT without a suffix"),
    ],
)  # fmt: skip
def test_choose_row_refuses_in_the_librarys_words(
    tmp_path: Path, name: str, requested: str, lora_only: bool, message: str
) -> None:
    with pytest.raises(InvalidOptionError) as caught:
        choose_row(tmp_path / name, requested, lora_only=lora_only)
    assert caught.value.cli_text() == f"{tmp_path / name}: {message}"


def test_an_existing_folder(tmp_path: Path) -> None:
    (tmp_path / "x.pt").mkdir()
    assert choose_row(tmp_path / "x.pt") is TORCH_SAVE_ROW  # by its suffix: the output check refuses the folder
    with pytest.raises(InvalidOptionError, match="format torch writes one torch.save file, not an existing folder"):
        choose_row(tmp_path / "x.pt", "torch")
    with pytest.raises(InvalidOptionError, match=r"needs a \.safetensors name or a folder, not '\.pt'"):
        choose_row(tmp_path / "x.pt", "safetensors")  # a folder, but named as another format's file
    (tmp_path / "plain").mkdir()
    assert choose_row(tmp_path / "plain", lora_only=True) is PEFT_ROW


def test_only_and_verify_refusals() -> None:
    with pytest.raises(InvalidOptionError, match="^a .safetensors file holds model weights only"):
        check_only(SAFETENSORS_ROW, "optim")
    check_only(SAFETENSORS_ROW, "model")
    check_only(HF_ROW, "optim")
    with pytest.raises(InvalidOptionError, match="^verify_output=True does not read a PEFT adapter folder back"):
        check_verifiable(PEFT_ROW)
    check_verifiable(HF_ROW)


def test_own_files_cover_what_the_tool_writes() -> None:
    own = own_files()
    for name in ("model.safetensors", "model-00001-of-00012.safetensors", "model.safetensors.index.json", "optimizer.pt",
                 "extra_state.pt", "adapter_model.safetensors", "adapter_config.json", "config.json", "tokenizer.json",
                 ".metadata", "__0_0.distcp", "__12_3.distcp"):  # fmt: skip
        assert own.file(name), name
    for name in ("README.md", "model-1-of-2.safetensors", "step-1000", ".metadata.json", "optimizer.pt.bak"):
        assert not own.file(name), name
    inner = own.folder(output_table.CHAT_TEMPLATE_DIR)
    assert inner is not None and inner.fullmatch("tool_use.jinja") and not inner.fullmatch("notes.txt")
    assert own.folder("pytorch_model_fsdp_0") is None  # a producer's folder: the producers table's


def test_own_files_read_the_table_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    row = OutputRow(name="mine", folder=True, files=(r"weights-\d+\.bin",))
    assert not own_files().file("weights-3.bin")
    monkeypatch.setattr(output_table, "OUTPUT_ROWS", (*OUTPUT_ROWS, row))
    assert own_files().file("weights-3.bin")


def test_read_back_names_and_last_files() -> None:
    assert [(f.name, f.nest) for f in folder_files("torch_save")] == [("optimizer.pt", ("optim",)), ("extra_state.pt", ())]
    assert [f.name for f in folder_files("safetensors")] == ["model.safetensors", "adapter_model.safetensors"]
    assert [f.name for f in folder_files("safetensors_index")] == ["model.safetensors.index.json"]
    assert suffixes_holding("torch_save") == (".pt", ".pth", ".bin")
    assert suffixes_holding("safetensors") == (".safetensors",)
    assert last_files() == ("model.safetensors", "model.safetensors.index.json")  # consolidate's; reshard's DCP_ROW apart
    assert DCP_ROW.last == (".metadata",)
