"""Worked example: a new producer is one record of ``producers.PRODUCERS``, and nothing else.

The stub below exists only in this test: a training stack that marks its DCP folders with a
``stub_marker.json`` beside ``.metadata`` and keeps its trainer state in ``stub_state.json``,
which holds the same at any world size. Its record is detected from the facts the DCP format
records (``producers.detect.beside``: the marker among the names beside ``.metadata``). Put first
in the table (``monkeypatch`` of ``producers.PRODUCERS``, and nothing else), ``inspect`` names it,
``reshard`` copies both files beside the new rank files, and ``reshard --overwrite`` replaces that
output without ``--force``: the output check asks the table which files are the tool's own.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import fsdp_convert
from fsdp_convert import producers
from fsdp_convert.errors import OutputExistsError
from fsdp_convert.producers import Producer, SideFile
from fsdp_convert.producers.detect import beside
from tests._samples import Sample

MARKER, STATE = "stub_marker.json", "stub_state.json"

STUB = Producer(
    name="stub",
    detect=beside(MARKER),
    optimizer_key="optim",
    side_files=(SideFile(pattern=re.compile(r"stub_(marker|state)\.json"), action="copy"),),
    label="`stub`",
    on_disk="DCP with `stub_marker.json` beside `.metadata`",
    notes="`reshard` copies `stub_state.json` byte for byte",
    consolidate_loader="as `fsdp2`",
    reshard_loader="`dcp.load` at M ranks",
)


@pytest.fixture
def stub_ckpt(ws3_ckpt: Sample, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The sample FSDP2 checkpoint as the stub producer writes it, and the stub first in the table."""
    ckpt = tmp_path / "stub-ckpt"
    shutil.copytree(ws3_ckpt.checkpoint, ckpt)
    (ckpt / MARKER).write_text('{"format": 1}')
    (ckpt / STATE).write_bytes(b'{"step": 7, "tokens": 123456}\n')
    monkeypatch.setattr(producers, "PRODUCERS", (STUB, *producers.PRODUCERS))
    return ckpt


def test_inspect_names_the_stub_producer(stub_ckpt: Path, ws3_ckpt: Sample) -> None:
    assert fsdp_convert.inspect_checkpoint(stub_ckpt).producer == "stub"
    assert fsdp_convert.inspect_checkpoint(ws3_ckpt.checkpoint).producer == "fsdp2"  # no marker: as before


def test_reshard_copies_the_stub_side_files(stub_ckpt: Path, tmp_path: Path) -> None:
    (stub_ckpt / "notes.txt").write_text("not the producer's")
    out = tmp_path / "ws2"
    result = fsdp_convert.reshard(stub_ckpt, out, world_size=2, nproc=1)
    assert result.copied == (MARKER, STATE)
    assert (out / STATE).read_bytes() == (stub_ckpt / STATE).read_bytes()
    assert (out / MARKER).read_bytes() == (stub_ckpt / MARKER).read_bytes()
    assert result.left_out == ("notes.txt",) and not (out / "notes.txt").exists()
    assert fsdp_convert.inspect_checkpoint(out).producer == "stub"  # the copied marker names it again


def test_reshard_overwrite_replaces_its_own_stub_output_without_force(stub_ckpt: Path, tmp_path: Path) -> None:
    """Its earlier output holds the stub's files beside the DCP data: the tool's own, by the record's ``side_files``."""
    out = tmp_path / "out"
    fsdp_convert.reshard(stub_ckpt, out, world_size=3, nproc=1)
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", MARKER, STATE]
    result = fsdp_convert.reshard(stub_ckpt, out, world_size=2, nproc=1, overwrite=True)
    assert result.copied == (MARKER, STATE) and not (out / "__2_0.distcp").exists()
    assert (out / STATE).read_bytes() == (stub_ckpt / STATE).read_bytes()
    info = fsdp_convert.inspect_checkpoint(out)
    assert (info.producer, info.world_size) == ("stub", 2)
    (out / "notes.txt").write_text("the user's")  # a file the tool never writes: not its folder any more
    with pytest.raises(OutputExistsError, match=r"did not write \(it holds notes\.txt\)"):
        fsdp_convert.reshard(stub_ckpt, out, world_size=3, nproc=1, overwrite=True)
