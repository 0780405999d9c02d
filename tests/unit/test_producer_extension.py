"""Worked example: a new producer is one record of ``producers.PRODUCERS``, and nothing else.

The stub below exists only in this test: a training stack that marks its DCP folders with a
``stub_marker.json`` beside ``.metadata`` and keeps its trainer state in ``stub_state.json``,
which holds the same at any world size. Put first in the table (``monkeypatch``), ``inspect``
names it and ``reshard`` copies both files beside the new rank files, with no other change to
``fsdp_convert/``.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import fsdp_convert
from fsdp_convert import producers
from fsdp_convert.formats.index import CheckpointIndex
from fsdp_convert.producers import Producer, SideFile
from tests._samples import Sample

MARKER, STATE = "stub_marker.json", "stub_state.json"


def _marked(index: CheckpointIndex) -> bool:
    root = index.checkpoint_id
    return isinstance(root, Path) and (root / MARKER).is_file()


STUB = Producer(
    name="stub",
    detect=_marked,
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
