"""writers/_lock.py: one writer per output, a flock on ``.OUT.lock`` whose record names the holder and its job."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fsdp_convert.errors import OutputLockedError
from fsdp_convert.writers._lock import LockRecord, OutputLock, acquire_lock, lock_path


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_a_second_writer_is_refused_naming_the_holder(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    lock = acquire_lock(out, None)
    assert lock.taken
    record = LockRecord.parse(lock_path(out).read_text())
    assert record is not None and (record.host, record.pid, record.job) == (socket.gethostname(), os.getpid(), "-")
    with pytest.raises(OutputLockedError) as e:
        acquire_lock(out, None)  # another open file description: flock refuses it, even in this process
    assert str(e.value) == (
        f"{out} is being written by pid {os.getpid()} on {socket.gethostname()} (lock .out.pt.lock); "
        "wait for it, or remove the lock if that process is gone"
    )
    with pytest.raises(OutputLockedError):
        acquire_lock(out, "rdzv-other")  # another job
    lock.release(remove=True)
    assert list(tmp_path.iterdir()) == []
    acquire_lock(out, None).release(remove=True)  # free again


def test_the_jobs_own_peers_join_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = acquire_lock(out, "rdzv-job")
    peer = acquire_lock(out, "rdzv-job")
    assert holder.taken and not peer.taken
    holder.release(remove=False)  # a holder that left the output to rank 0's process keeps the file
    assert lock_path(out).exists()
    peer.release(remove=True)  # rank 0's process, its output in place, removes its job's lock
    assert not lock_path(out).exists()


def test_the_lock_stays_held_while_any_process_of_the_job_runs(tmp_path: Path) -> None:
    """The process that took it leaves first (``LeaveToOwner``): its peers' shared flocks keep another job out."""
    out = tmp_path / "out"
    holder = acquire_lock(out, "rdzv-job")
    peer = acquire_lock(out, "rdzv-job")
    assert peer.fd is not None  # the peer holds the flock, shared
    holder.release(remove=False)  # it left the output to rank 0's process, and exited
    for job in ("rdzv-other", None):
        with pytest.raises(OutputLockedError, match=f"pid {os.getpid()} on"):
            acquire_lock(out, job)
    peer.release(remove=False)  # rank 0's process is gone too (killed): nothing holds it
    lock = acquire_lock(out, "rdzv-other")
    assert lock.taken
    lock.release(remove=True)
    assert not lock_path(out).exists()


def test_a_stale_lock_on_this_host_is_taken_over(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    lock_path(out).write_text(LockRecord(socket.gethostname(), _dead_pid(), 1.0, "-").text())
    lock = acquire_lock(out, None)
    assert lock.taken and LockRecord.parse(lock_path(out).read_text()) == lock.record
    lock.release(remove=True)
    lock_path(out).write_text("")  # a holder that died before writing its record
    acquire_lock(out, None).release(remove=True)


def test_a_dead_holder_of_the_same_job_is_taken_over_not_joined(tmp_path: Path) -> None:
    out = tmp_path / "out"
    lock_path(out).write_text(LockRecord(socket.gethostname(), _dead_pid(), 1.0, "rdzv-job").text())
    lock = acquire_lock(out, "rdzv-job")
    assert lock.taken
    lock.release(remove=True)


def test_a_lock_from_another_host_is_refused(tmp_path: Path) -> None:
    """Its flock may be node-local (Lustre localflock): the file is what this node sees."""
    out = tmp_path / "out.pt"
    lock_path(out).write_text(LockRecord("host-b", 1234, 1.0, "rdzv-a").text())
    with pytest.raises(OutputLockedError, match=r"pid 1234 on host-b .*not held from here"):
        acquire_lock(out, "rdzv-b")
    assert acquire_lock(out, "rdzv-a").taken is False  # a node of that job joins it
    assert lock_path(out).read_text().startswith("host-b 1234 ")  # untouched


def test_before_record_failing_removes_the_lock(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"

    def refuse() -> None:
        raise RuntimeError("left temporary")

    with pytest.raises(RuntimeError):
        acquire_lock(out, None, before_record=refuse)
    assert list(tmp_path.iterdir()) == []


def test_record_round_trip() -> None:
    record = LockRecord("host-a", 42, 1700000000.5, "rdzv-x")
    assert LockRecord.parse(record.text()) == record
    assert LockRecord.parse("garbage") is None


def test_peers_wait_for_the_record_of_whoever_takes_over_a_dead_jobs_lock(tmp_path: Path) -> None:
    """Job b takes over job a's lock (its holder dead); b's peer, arriving while the dead record is still there and the
    taker is still checking for a left temporary, waits for b's record and joins, instead of refusing job a's."""
    out = tmp_path / "out"
    lock_path(out).write_text(LockRecord(socket.gethostname(), _dead_pid(), 1.0, "rdzv-a").text())
    peers: list[object] = []

    def peer_arrives() -> None:  # the taker is between its flock and its record
        thread = threading.Thread(target=lambda: peers.append(_try(lambda: acquire_lock(out, "rdzv-b"))))
        thread.start()
        time.sleep(0.3)
        peers.append(thread)

    taker = acquire_lock(out, "rdzv-b", before_record=peer_arrives)
    thread = peers.pop()
    assert isinstance(thread, threading.Thread)
    thread.join(timeout=20)
    (peer,) = peers
    assert taker.taken and isinstance(peer, OutputLock) and not peer.taken, peer
    peer.release(remove=False)
    taker.release(remove=True)


def _try(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except OutputLockedError as e:
        return e
