"""writers/_atomic.py: atomic_output writes to a temporary name and replaces the output only at the end."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from fsdp_convert.errors import (
    CorruptChunkError,
    OutputExistsError,
    OutputLockedError,
    OutputWriteError,
    TemporaryExistsError,
    TerminatedError,
    WorkerFailedError,
)
from fsdp_convert.signals import raise_or_defer
from fsdp_convert.writers import atomic_output
from fsdp_convert.writers._atomic import LeaveToOwner, kept_note, temporary_path


def test_atomic_output_leaves_nothing_on_error(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    with pytest.raises(RuntimeError), atomic_output(out, overwrite=False) as tmp:
        tmp.write_bytes(b"partial")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_replaces_only_at_the_end(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    out.write_bytes(b"old")
    with pytest.raises(OutputExistsError), atomic_output(out, overwrite=False):
        pass
    with atomic_output(out, overwrite=True) as tmp:
        tmp.write_bytes(b"new")
        assert out.read_bytes() == b"old"
    assert out.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.pt"]


def test_the_temporary_name_is_deterministic(tmp_path: Path) -> None:
    assert temporary_path(tmp_path / "full.pt", None, directory=False) == tmp_path / ".full.tmp-local.pt"
    assert temporary_path(tmp_path / "hf", "rdzv-job1", directory=True) == tmp_path / ".hf.tmp-rdzv-job1"
    with atomic_output(tmp_path / "full.pt", overwrite=False) as tmp:
        assert tmp == tmp_path / ".full.tmp-local.pt"
        assert (tmp_path / ".full.pt.lock").exists()  # held for the whole run
        tmp.write_bytes(b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt"]  # lock removed


def test_a_second_writer_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    with atomic_output(out, overwrite=False, directory=True) as tmp:
        (tmp / "a").write_bytes(b"a")
        before = sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(OutputLockedError, match=f"pid {os.getpid()}"), atomic_output(out, overwrite=False, directory=True):
            pass
        assert sorted(p.name for p in tmp_path.iterdir()) == before and (tmp / "a").read_bytes() == b"a"
    assert (out / "a").read_bytes() == b"a"


def test_a_left_temporary_is_reported_and_kept(tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    left = tmp_path / ".full.tmp-local.pt"
    left.write_bytes(b"partial")
    os.utime(left, (time.time() - 600, time.time() - 600))
    with pytest.raises(TemporaryExistsError) as e, atomic_output(out, overwrite=False):
        pass
    said = f"{left} is left from an earlier run writing full.pt (10 min old); pass --resume to continue it, or remove it"
    assert e.value.cli_text() == said
    assert str(e.value) == said.replace("--resume", "resume=True")  # the library's wording names the keyword
    assert sorted(p.name for p in tmp_path.iterdir()) == [left.name]  # kept, and no lock left
    other = tmp_path / ".full.tmp-0123456789ab.pt"  # an earlier version's random name, or another job's
    other.write_bytes(b"")
    with pytest.raises(TemporaryExistsError, match="another job's"), atomic_output(out, overwrite=False, resume=True):
        pass
    other.unlink()
    with atomic_output(out, overwrite=False, resume=True) as tmp:  # resume reuses it as it is
        assert tmp.read_bytes() == b"partial"
        tmp.write_bytes(b"whole")
    assert out.read_bytes() == b"whole" and sorted(p.name for p in tmp_path.iterdir()) == ["full.pt"]


def test_the_lock_is_removed_on_failure_and_kept_by_a_peer_that_leaves(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    with pytest.raises(KeyboardInterrupt), atomic_output(out, overwrite=False, directory=True):
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    holder = atomic_output(out, overwrite=False, directory=True, tag="rdzv-j")  # takes the lock, not rank 0's process
    tmp = holder.__enter__()
    owner = atomic_output(out, overwrite=False, directory=True, tag="rdzv-j")  # rank 0's process: joins its job's lock
    assert owner.__enter__() == tmp
    (tmp / "a").write_bytes(b"a")
    assert holder.__exit__(LeaveToOwner, LeaveToOwner(), None)  # leaves the temporary and the lock file to rank 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.lock", ".hf.tmp-rdzv-j"]
    owner.__exit__(None, None, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and (out / "a").exists()


_KEPT_ON = [KeyboardInterrupt(), TerminatedError(15), WorkerFailedError("worker rank 1 died without a report")]
_REMOVED_ON = [OutputWriteError("cannot write x: No space left on device"), CorruptChunkError("bad chunk"), RuntimeError("bug")]


@pytest.mark.parametrize("exc", _KEPT_ON + _REMOVED_ON, ids=lambda e: type(e).__name__)
def test_a_resumable_temporary_is_kept_on_a_signal_or_a_failed_worker_only(tmp_path: Path, exc: BaseException) -> None:
    """With ``keep`` (a resumable run), Ctrl-C, SIGTERM and a failed worker keep the temporary (lock released,
    the note on the exception); any other error removes it; without ``keep`` every error removes it."""
    out = tmp_path / "hf"
    with pytest.raises(type(exc)) as raised, atomic_output(out, overwrite=False, directory=True, keep=lambda t: f"{t} kept"):
        raise exc
    kept = any(exc is e for e in _KEPT_ON)
    assert sorted(p.name for p in tmp_path.iterdir()) == ([".hf.tmp-local"] if kept else [])
    assert kept_note(raised.value) == (f"{tmp_path / '.hf.tmp-local'} kept" if kept else None)
    if kept:  # the next run without --resume reports it; without keep (not resumable) it is removed
        (tmp_path / ".hf.tmp-local").rmdir()
    with pytest.raises(type(exc)), atomic_output(out, overwrite=False, directory=True):
        raise exc
    assert list(tmp_path.iterdir()) == []


def test_a_temporary_without_a_note_is_removed(tmp_path: Path) -> None:
    """``keep`` returning None (no manifest written yet: nothing to resume) removes the temporary."""
    with pytest.raises(KeyboardInterrupt), atomic_output(tmp_path / "out.pt", overwrite=False, keep=lambda t: None) as tmp:
        tmp.write_bytes(b"partial")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_a_signal_while_a_stopped_run_unwinds_keeps_the_temporary_and_its_note(tmp_path: Path) -> None:
    """torchrun's SIGTERM reaches a worker whose peer died while its temporary is being kept: the signal is held until
    the temporary is kept and noted, and the SIGTERM that replaces the worker's error still carries the note."""
    out = tmp_path / "hf"

    def keep(tmp: Path) -> str:
        raise_or_defer(TerminatedError(15))  # the CLI's SIGTERM handler, mid-keep
        return f"{tmp} kept"

    with pytest.raises(TerminatedError) as raised, atomic_output(out, overwrite=False, directory=True, keep=keep):
        raise WorkerFailedError("worker rank 0 lost its connection to a peer worker")
    assert isinstance(raised.value.__context__, WorkerFailedError)
    assert kept_note(raised.value) == f"{tmp_path / '.hf.tmp-local'} kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.tmp-local"]
