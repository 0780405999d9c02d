"""verify at consolidate's speed, and a consolidated file's naming recognised without --as-consolidated."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli import app
from fsdp_convert.ops import _compare, _sources
from fsdp_convert.ops import verify as verify_module
from fsdp_convert.ops._compare import compare, same_bytes
from fsdp_convert.ops.verify import verify


def _wrapped_ckpt(path: Path, n: int = 3) -> Path:
    """A DCP checkpoint whose model keys carry torch.compile's wrapper name (model._orig_mod.w<i>)."""
    state = {"model": {"_orig_mod": {f"w{i}": torch.full((4, 2), float(i)) for i in range(n)}}}
    dcp_save(state, checkpoint_id=path, no_dist=True)
    return path


def test_row11_verify_defaults_to_consolidates_nproc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No nproc: consolidate's default_nproc of both sides' bytes and data files picks the workers."""
    ckpt = _wrapped_ckpt(tmp_path / "ck")
    asked: list[tuple[int, int]] = []
    ran: list[int] = []

    def default_nproc(total_bytes: int, data_files: int, cpus: int) -> int:
        asked.append((total_bytes, data_files))
        return 2

    def run_ranks(fn: Any, job: Any, world_size: int, cluster: Any) -> tuple[bool, list[tuple[str, str]]]:
        ran.append(world_size)
        return True, []

    monkeypatch.setattr(verify_module, "default_nproc", default_nproc)
    monkeypatch.setattr(verify_module, "run_ranks", run_ranks)
    assert verify(ckpt, ckpt).equal
    assert asked == [(2 * 3 * 4 * 2 * 4, 2)] and ran == [2]


def test_row11_verify_reads_both_sides_in_threads_while_comparing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each side's values, or its bytes as stored, are read in a thread of their own, never in the thread that compares."""
    ckpt = _wrapped_ckpt(tmp_path / "ck")
    for as_values in (False, True):  # DCP payloads compared as their bytes; with a tolerance, read as tensors
        readers: set[str] = set()
        get, fill = _sources.SideView.get, _compare._Pieces.fill

        def recording_get(self: _sources.SideView, key: str, readers: set[str] = readers, get: Any = get) -> Any:
            readers.add(threading.current_thread().name)
            return get(self, key)

        def recording_fill(self: _compare._Pieces, view: memoryview, readers: set[str] = readers, fill: Any = fill) -> None:
            readers.add(threading.current_thread().name)
            fill(self, view)

        monkeypatch.setattr(_sources.SideView, "get", recording_get)
        monkeypatch.setattr(_compare._Pieces, "fill", recording_fill)
        result = verify(ckpt, ckpt, nproc=1, atol=0.0 if as_values else None)
        assert result.equal and result.compared == 3
        assert readers and threading.current_thread().name not in readers
        monkeypatch.undo()


def test_row11_wide_byte_compare_agrees_with_bitwise() -> None:
    """Bytes compared as wide integers: equal exactly when bitwise equal, for odd sizes, offsets and every sign of zero."""
    base = torch.arange(15, dtype=torch.float32)
    assert same_bytes(base, base.clone())
    assert not same_bytes(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))
    odd = torch.arange(7, dtype=torch.uint8)
    other = odd.clone()
    other[6] = 9
    assert same_bytes(odd, odd.clone()) and not same_bytes(odd, other)
    shifted = torch.arange(9, dtype=torch.int16)[1:]  # a view at an odd element offset
    assert same_bytes(shifted, shifted.clone())
    assert same_bytes(torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor(1.5, dtype=torch.bfloat16))
    assert compare(torch.tensor([0.0]), torch.tensor([-0.0]), None, None) is not None


def test_row12_consolidated_naming_recognised_without_the_flag(tmp_path: Path) -> None:
    """A DCP checkpoint against consolidate's own output of it: equal, and a note says how it was seen."""
    ckpt = _wrapped_ckpt(tmp_path / "ck")
    fsdp_convert.consolidate(ckpt, tmp_path / "full.pt")
    result = verify(ckpt, tmp_path / "full.pt")
    assert result.equal and result.compared == 3, result.differences
    assert "seen as consolidate names its keys" in result.note and "\n" not in result.note
    assert result.to_json_dict()["note"] == result.note
    reverse = verify(tmp_path / "full.pt", ckpt)
    assert reverse.equal and reverse.note


def test_row12_keys_as_saved_keep_no_note(tmp_path: Path) -> None:
    """Sides whose keys match as saved are compared as saved, without a note."""
    ckpt = _wrapped_ckpt(tmp_path / "ck")
    result = verify(ckpt, ckpt)
    assert result.equal and result.note == "" and "note" not in result.to_json_dict()


def test_row12_cli_table_capped_with_a_count_of_the_rest(tmp_path: Path) -> None:
    """30 keys only in A: the table shows the first 20 and says how many more; --json lists all 30."""
    dcp_save({"model": {f"k{i:02d}": torch.zeros(2) for i in range(30)}}, checkpoint_id=tmp_path / "a", no_dist=True)
    dcp_save({"model": {"other": torch.zeros(2)}}, checkpoint_id=tmp_path / "b", no_dist=True)
    runner = CliRunner()
    result = runner.invoke(app, ["verify", str(tmp_path / "a"), str(tmp_path / "b")], terminal_width=200)
    assert result.exit_code == 1, result.output
    assert "model.k19" in result.output and "model.k20" not in result.output
    assert "... and 11 more" in result.output  # 30 only in A and 1 only in B: 31 differences
    json_out = runner.invoke(app, ["verify", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert json_out.stdout.count('"kind"') == 31
