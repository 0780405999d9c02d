"""writers/_nofollow.py and its users: no name the tool writes is written through a link (the lock, the temporary,
the manifest and its records log, OUT at the final rename); a live run is named to ``--resume``, not called left."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_convert.errors import OutputExistsError, OutputLockedError, OutputWriteError
from fsdp_convert.lock_record import LockRecord
from fsdp_convert.writers import atomic_output
from fsdp_convert.writers._lock import acquire_lock, check_not_locked, lock_path
from fsdp_convert.writers._manifest import RecordLog, manifest_dir, start_manifest
from fsdp_convert.writers._nofollow import open_in, open_nofollow, refuse_links_inside

PRECIOUS = b"precious\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_bytes(PRECIOUS)
    return path


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_open_nofollow_refuses_a_link_a_hard_link_and_a_fifo(tmp_path: Path, victim: Path) -> None:
    (tmp_path / "soft").symlink_to(victim)
    os.link(victim, tmp_path / "hard")
    os.mkfifo(tmp_path / "fifo")
    for name, said in (("soft", "it is a symbolic link"), ("hard", "other hard links"), ("fifo", "not a regular file")):
        for flags in (os.O_RDWR, os.O_WRONLY | os.O_APPEND | os.O_CREAT):
            with pytest.raises(OutputWriteError, match=said):
                open_nofollow(tmp_path / name, flags)  # the FIFO does not hang the open
    assert victim.read_bytes() == PRECIOUS
    with pytest.raises(FileExistsError):
        open_nofollow(tmp_path / "soft", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    os.close(open_nofollow(tmp_path / "new", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    fd = open_nofollow(tmp_path / "new", os.O_WRONLY)
    assert os.get_blocking(fd)
    os.close(fd)


def test_open_in_refuses_a_linked_folder(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(OutputWriteError, match=f"{tmp_path / 'link'}: it is a symbolic link"):
        open_in(tmp_path / "link", "records-0.jsonl", os.O_WRONLY | os.O_CREAT)
    assert _names(real) == []
    (real / "inner").mkdir()
    (real / "inner" / "x").symlink_to(tmp_path)
    with pytest.raises(OutputWriteError, match="inner/x: it is a symbolic link"):
        refuse_links_inside(real)


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_the_lock_is_never_written_through_a_link(tmp_path: Path, victim: Path, kind: str) -> None:
    """Before: an existing lock was reopened O_RDWR (following a link), truncated, and given the record."""
    out = tmp_path / "out" / "full.pt"
    out.parent.mkdir()
    if kind == "symlink":
        lock_path(out).symlink_to(victim)
    else:
        os.link(victim, lock_path(out))
    with pytest.raises(OutputWriteError, match=f"cannot write {lock_path(out)}: "):
        acquire_lock(out, None)
    with pytest.raises(OutputWriteError), atomic_output(out, overwrite=False):
        pass
    assert victim.read_bytes() == PRECIOUS and _names(out.parent) == [".full.pt.lock"]


@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.parametrize("directory", [False, True])
def test_a_link_at_the_temporary_is_refused(tmp_path: Path, victim: Path, directory: bool, resume: bool) -> None:
    """Before: with --resume, the workers opened the temporary by name (following the link) and wrote the victim."""
    out = tmp_path / "out" / ("hf" if directory else "full.pt")
    out.parent.mkdir()
    target = tmp_path / "elsewhere" if directory else victim
    if directory:
        target.mkdir()
    tmp = out.parent / (".hf.tmp-local" if directory else ".full.tmp-local.pt")
    tmp.symlink_to(target)
    entered = False
    with pytest.raises(OutputWriteError, match=f"cannot write {tmp}: it is a symbolic link"):
        with atomic_output(out, overwrite=False, directory=directory, resume=resume):
            entered = True
    assert not entered and victim.read_bytes() == PRECIOUS
    assert _names(out.parent) == [tmp.name]  # the link left, no lock


def test_a_reused_temporary_and_its_manifest_hold_no_link(tmp_path: Path, victim: Path) -> None:
    """A left temporary's files are opened by name, its records logs appended to: a link inside either is refused
    before the block runs, and the interrupted run's files are kept as they were."""
    out = tmp_path / "out" / "hf"
    out.parent.mkdir()
    tmp = out.parent / ".hf.tmp-local"
    tmp.mkdir()
    (tmp / "model-00001-of-00002.safetensors").symlink_to(victim)
    with pytest.raises(OutputWriteError, match="model-00001-of-00002.safetensors: it is a symbolic link"):
        with atomic_output(out, overwrite=False, directory=True, resume=True):
            pytest.fail("entered")
    (tmp / "model-00001-of-00002.safetensors").unlink()
    (tmp / "model-00001-of-00002.safetensors").write_bytes(b"half")
    manifest = manifest_dir(tmp)
    manifest.mkdir()
    (manifest / "records-0.jsonl").symlink_to(victim)
    with pytest.raises(OutputWriteError, match="records-0.jsonl: it is a symbolic link"):
        with atomic_output(out, overwrite=False, directory=True, resume=True):
            pytest.fail("entered")
    assert victim.read_bytes() == PRECIOUS and (tmp / "model-00001-of-00002.safetensors").read_bytes() == b"half"
    (manifest / "records-0.jsonl").unlink()
    with atomic_output(out, overwrite=False, directory=True, resume=True) as used:
        assert used == tmp and (used / "model-00001-of-00002.safetensors").read_bytes() == b"half"


def test_a_new_temporary_file_is_created_exclusively(tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    with atomic_output(out, overwrite=False) as tmp:
        assert tmp.is_file() and not tmp.is_symlink() and tmp.stat().st_size == 0  # made here, O_EXCL | O_NOFOLLOW
        tmp.write_bytes(b"data")
    assert out.read_bytes() == b"data"


def test_the_manifest_and_its_records_log_are_never_written_through_a_link(tmp_path: Path, victim: Path) -> None:
    """Before: a fresh manifest over a linked folder failed with 'File exists'; a resumed run appended its records
    to a linked records log's target."""
    tmp = tmp_path / ".full.tmp-local.pt"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    manifest_dir(tmp).symlink_to(elsewhere)
    with pytest.raises(OutputWriteError, match=f"cannot write {manifest_dir(tmp)}: it is a symbolic link"):
        start_manifest(tmp, source="s", options="o", files={"": 8}, records=[])
    with pytest.raises(OutputWriteError, match="it is a symbolic link"):
        RecordLog(tmp, "0")
    assert _names(elsewhere) == [] and manifest_dir(tmp).is_symlink()
    manifest_dir(tmp).unlink()
    start_manifest(tmp, source="s", options="o", files={"": 8}, records=[])
    (manifest_dir(tmp) / "records-0.jsonl").symlink_to(victim)
    with pytest.raises(OutputWriteError, match="records-0.jsonl: it is a symbolic link"):
        RecordLog(tmp, "0")
    assert victim.read_bytes() == PRECIOUS


def test_a_link_at_out_is_refused_at_the_start_and_at_the_final_rename(tmp_path: Path, victim: Path) -> None:
    """Before: --overwrite replaced a link at OUT (its target, which the user meant, never written)."""
    out = tmp_path / "full.pt"
    out.symlink_to(victim)
    with pytest.raises(OutputExistsError, match="is a symbolic link"), atomic_output(out, overwrite=True):
        pytest.fail("entered")
    out.unlink()
    with pytest.raises(OutputExistsError, match="is a symbolic link"), atomic_output(out, overwrite=True) as tmp:
        tmp.write_bytes(b"new")
        out.symlink_to(victim)  # swapped in while the run writes
    assert victim.read_bytes() == PRECIOUS and out.is_symlink() and _names(tmp_path) == ["full.pt", "victim.txt"]


def test_check_not_locked_names_a_live_run_and_passes_a_dead_one(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    check_not_locked(out, None)  # no lock
    lock = acquire_lock(out, "rdzv-job")
    try:
        with pytest.raises(OutputLockedError) as e:
            check_not_locked(out, None)
        said = e.value.cli_text()
        assert said == (
            f"{out} is being written by another run, pid {os.getpid()} on {socket.gethostname()} (lock .hf.lock); "
            "wait for it to finish (if it stops unfinished, run again with --resume)"
        )
        check_not_locked(out, "rdzv-job")  # the job's own lock: another node or worker of it
        assert acquire_lock(out, "rdzv-job").taken is False  # the probe released the flock it tried
    finally:
        lock.release(remove=True)
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)
    lock_path(out).write_text(LockRecord(socket.gethostname(), dead, 0.0, "-").text())
    check_not_locked(out, None)  # a dead run's lock: left for acquire_lock to take over
    lock_path(out).write_text(LockRecord("elsewhere", 1, 0.0, "-").text())
    with pytest.raises(OutputLockedError, match="its flock is not held from here"):
        check_not_locked(out, None)  # another host's: acquire_lock would refuse it too
    assert _names(tmp_path) == [".hf.lock"]
