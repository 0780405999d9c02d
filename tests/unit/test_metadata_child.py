"""A large ``.metadata`` is unpickled at C speed in a forked child (``formats/_metadata_child.py``).

The child must give the interpreter's index for every real ``.metadata``, and None for anything
the interpreter refuses, whatever the pickle does to the child (changes its classes, crashes it,
keeps it busy): then ``read_dcp_index`` reads the file with the interpreter, which refuses it with
its own message. Every hostile pickle of ``test_unpickler_hostile`` is fed to both here, with the
size floor (``MIN_BYTES``) lifted.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest

from fsdp_convert.errors import CheckpointError
from fsdp_convert.formats import _dcp_metadata, _metadata_child, dcp
from fsdp_convert.formats._dcp_metadata import build_index
from fsdp_convert.formats.dcp import read_dcp_index
from tests._samples import Sample
from tests.unit.test_unpickler_hostile import (
    BUILD,
    EMPTY_DICT,
    EMPTY_TUPLE,
    LOADERS,
    NEWOBJ,
    NONE,
    SETITEM,
    STOP,
    TUPLE1,
    _colliding_ints,
    _hostile,
    _long1,
    _snapshot,
    dict_state,
    stack_glob,
    text,
)

pytestmark = pytest.mark.redteam

_DCP = "torch.distributed.checkpoint.metadata"


@pytest.fixture
def no_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``.metadata`` goes to the child, however small."""
    monkeypatch.setattr(_metadata_child, "MIN_BYTES", 0)


def _interpreter_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dcp, "index_in_child", lambda *args: None)


def _in_child(folder: Path, data: bytes) -> object:
    return _metadata_child.index_in_child(data, folder, lambda metadata: build_index(metadata, folder))


def _outcome(folder: Path) -> str:
    try:
        read_dcp_index(folder)
    except CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "read"


@pytest.mark.usefixtures("no_floor")
def test_the_child_indexes_real_checkpoints_as_the_interpreter_does(
    ws3_ckpt: Sample, fsdp2_layouts: Path, megatron_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folders = [ws3_ckpt.checkpoint, fsdp2_layouts / "verl", megatron_run / "iter_0000003"]
    folders = [f for f in folders if (f / ".metadata").is_file()]
    assert len(folders) >= 2
    forked = {f: read_dcp_index(f) for f in folders}
    ws3 = ws3_ckpt.checkpoint
    assert _in_child(ws3, (ws3 / ".metadata").read_bytes()) is not None  # the FSDP2 run's: read by the child
    _interpreter_only(monkeypatch)
    for folder, index in forked.items():
        assert index == read_dcp_index(folder), folder


@pytest.mark.usefixtures("no_floor")
def test_every_hostile_pickle_is_none_from_the_child_and_refused_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = LOADERS[".metadata"]
    before = _snapshot()
    for case, data in _hostile(loader).items():
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / ".metadata").write_bytes(data)
        with loader.extensions():  # EXT codes name admitted classes, in the child too
            assert _in_child(folder, data) is None, case
            forked = _outcome(folder)
        with monkeypatch.context() as m, loader.extensions():
            _interpreter_only(m)
            assert forked == _outcome(folder) != "read", case
        assert _snapshot() == before, case


@pytest.mark.usefixtures("no_floor")
def test_a_crash_or_a_quadratic_dict_in_the_child_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deep tuple key kills the child (SIGSEGV); 200,000 keys of one hash keep it busy past its CPU limit."""
    deep = EMPTY_TUPLE + TUPLE1 * 1_000_000
    index = stack_glob(_DCP, "MetadataIndex") + EMPTY_TUPLE + NEWOBJ + dict_state(fqn=text("w"), offset=deep) + BUILD
    flood = b"}(" + b"".join(_long1(k) + b"N" for k in _colliding_ints(200_000)) + b"u"
    monkeypatch.setattr(_metadata_child, "_CPU_SECONDS", 1)
    monkeypatch.setattr(_metadata_child, "_CPU_PER_BYTE", 0.0)
    for name, data in {
        "deep-key": b"\x80\x04" + EMPTY_DICT + deep + NONE + SETITEM + STOP,
        "deep-offset": b"\x80\x04" + EMPTY_DICT + index + NONE + SETITEM + STOP,
        "flood": b"\x80\x04" + flood + STOP,
    }.items():
        start = time.monotonic()
        assert _in_child(tmp_path, data) is None, name
        assert time.monotonic() - start < 30, name  # the CPU limit ends a child that would run for minutes


@pytest.mark.usefixtures("no_floor")
def test_a_child_that_waits_past_its_deadline_is_killed(ws3_ckpt: Sample, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child stuck without using CPU (a lock a thread of the parent held at the fork) is killed at the wall deadline."""
    monkeypatch.setattr(_metadata_child, "_CPU_SECONDS", 1)
    monkeypatch.setattr(_metadata_child, "_CPU_PER_BYTE", 0.0)
    monkeypatch.setattr(_metadata_child, "_WALL_SLACK_S", 1)
    raw = (ws3_ckpt.checkpoint / ".metadata").read_bytes()
    start = time.monotonic()
    assert _metadata_child.index_in_child(raw, ws3_ckpt.checkpoint, lambda metadata: time.sleep(60)) is None
    assert time.monotonic() - start < 30


@pytest.mark.usefixtures("no_floor")
def test_data_after_the_pickle_or_no_metadata_is_left_to_the_interpreter(ws3_ckpt: Sample, tmp_path: Path) -> None:
    raw = (ws3_ckpt.checkpoint / ".metadata").read_bytes()
    assert _in_child(tmp_path, raw + b"\x00") is None
    assert _in_child(tmp_path, pickle.dumps({"state_dict_metadata": {}}, protocol=2)) is None
    # a writer's record the child does not admit (Megatron-Core's plans): the interpreter's to read
    assert _dcp_metadata.metadata_from_bytes(raw, tmp_path / ".metadata").state_dict_metadata


@pytest.mark.usefixtures("no_floor")
@pytest.mark.parametrize("shared_as", ["planner_data value", "storage_meta modules"])
def test_a_state_the_child_empties_used_elsewhere_is_left_to_the_interpreter(tmp_path: Path, shared_as: str) -> None:
    """A record state dict also held by another value (before or after its BUILD): the child gives None, the interpreter reads it.

    The child's slotted records empty their state dicts (memory); a pickle that uses one twice
    would show the other use an empty dict where the interpreter shows its fields.
    """
    import torch
    import torch.distributed.checkpoint as torch_dcp

    torch_dcp.save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "saved", no_dist=True)
    metadata = pickle.loads((tmp_path / "saved" / ".metadata").read_bytes())  # noqa: S301  (torch's own file)
    state = next(iter(metadata.storage_data)).__dict__
    if shared_as == "planner_data value":  # pickled before storage_data: the record's BUILD takes it from the memo
        metadata.planner_data["shared"] = state
    else:  # pickled after: BINGET of the emptied dict
        metadata.storage_meta.modules = state
    data = pickle.dumps(metadata)
    (tmp_path / "saved" / ".metadata").write_bytes(data)
    assert _in_child(tmp_path / "saved", data) is None
    assert _outcome(tmp_path / "saved") == "read"


def test_frames_come_whole_or_the_child_failed() -> None:
    """The parent takes each frame the child sent whole; a pipe that ends inside one (a child killed writing it) fails."""
    import os

    for cut, expected in ((0, [("a", 1), (2,)]), (3, ValueError)):
        read_end, write_end = os.pipe()
        _metadata_child._send(write_end, ("a", 1))
        if cut:
            _metadata_child._send(write_end, (2,))
            os.close(write_end)
            leftover = os.read(read_end, 1 << 16)  # re-write all but the last bytes through a fresh pipe
            os.close(read_end)
            read_end, write_end = os.pipe()
            os.write(write_end, leftover[:-cut])
        else:
            _metadata_child._send(write_end, (2,))
        os.close(write_end)
        if expected is ValueError:
            with pytest.raises(ValueError, match="inside a frame"):
                list(_metadata_child._frames(read_end, time.monotonic() + 10))
        else:
            assert list(_metadata_child._frames(read_end, time.monotonic() + 10)) == expected
        os.close(read_end)
