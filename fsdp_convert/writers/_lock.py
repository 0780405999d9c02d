"""One writer per output: an exclusive lock file beside it, ``.OUT.lock``.

The lock is ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``.OUT.lock`` in the output's folder, a text
file holding ``host pid since job`` (``since``: Unix seconds the lock was taken; ``job``: the
shared tag of a multi-process job, ``-`` for a single-node run). The first process of a job takes
it exclusively, writes its record, then holds it shared (``LOCK_SH``) for its whole run; every other
process of the job holds it shared too once it has read the record. So the lock stays held while
any process of the job runs, even once the one that took it has left the output to rank 0's
process (``LeaveToOwner``). The lock file is removed at the end, on success or failure.

What each process can see decides the rules:

- A process that finds the flock held reads the record. The same job (its shared tag, derived from
  ``--rdzv-id`` or torchrun's run id) means another node or worker of its own job took it first:
  it goes on without the lock. Anything else is another job: refused (``OutputLockedError``).
- The flock free but the file there: on the same host the holder's job is gone (its kernel would
  hold the flock), so the lock is taken over silently, unless the holder's pid is alive (it is
  between its exclusive and its shared flock): refused. A holder on another host cannot be
  checked from here: flock across nodes works on NFSv4 and on Lustre mounted with ``flock``, but
  is node-local with ``localflock`` and fails with ``noflock``. The file's existence is what every
  node sees (created with ``O_EXCL``, which NFS honours), so such a lock is refused, naming its
  holder, until the user removes it.
- flock unsupported (ENOLCK, ENOSYS, EOPNOTSUPP): the ``O_EXCL`` create is the lock, and a
  same-host holder whose pid is gone is taken over.
- A process that takes the lock over empties the dead holder's record at once and writes its own
  once it has checked for a left temporary. Until then a process that finds the flock held and
  the file empty, or naming a dead process of this host, waits for the new record (up to
  ``_RECORD_WAIT_S``) rather than joining or refusing a job that is gone.
- The lock file is opened relative to a descriptor of the output's folder, with ``O_NOFOLLOW``
  (``O_EXCL`` to create it), and an existing one must be a regular file with one link
  (``writers._nofollow``): a link or hard link planted at ``.OUT.lock`` is refused, never
  truncated or written through. Its record is read from the descriptor taken, not by name.

``check_not_locked`` asks the same question without taking the lock (``--resume`` asks it before
it looks at a left temporary, so a live run's temporary is never called left).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fsdp_convert.errors import OutputLockedError, OutputWriteError
from fsdp_convert.lock_record import SINGLE, LockRecord, lock_name, locked_message, pid_alive
from fsdp_convert.writers._nofollow import NOFOLLOW, open_folder, open_nofollow

__all__ = ["LockRecord", "OutputLock", "acquire_lock", "check_not_locked", "lock_path"]

_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
_RECORD_WAIT_S = 10.0  # how long a peer waits for a new holder's record (the file empty, or a dead one's), in seconds
_RECORD_BYTES = 4096  # a record is one short line; no more of the file is read


def lock_path(output: Path) -> Path:
    """The lock file of ``output``: ``.<name>.lock`` beside it."""
    return output.parent / lock_name(output.name)


@dataclass(slots=True)
class OutputLock:
    """A lock taken (``taken``: this process wrote the record) or joined (a peer of the holder's job).

    Attributes:
        path: the lock file.
        record: this process's record.
        fd: the open lock file while this process holds its flock (shared, once the record is
            written), else None (a peer where flock is unsupported, or released).
        taken: True in the process that took the lock (the first of its job); False in a peer.
    """

    path: Path
    record: LockRecord
    fd: int | None
    taken: bool = True

    def release(self, *, remove: bool) -> None:
        """Let the lock go; with ``remove``, delete the file too if it is still this job's.

        A holder that leaves the output to another process of its job (``LeaveToOwner``) releases
        the flock without removing the file; the owner removes it once the output is in place.
        """
        fd, self.fd = self.fd, None
        try:
            if remove:  # unlink removes a name, never what a link names
                if self.taken and fd is not None and _same_file(fd, self.path):
                    self.path.unlink()
                elif not self.taken and self.record.job != SINGLE:
                    holder = _read_record_at(self.path)
                    if holder is not None and holder.job == self.record.job:
                        self.path.unlink()
        except FileNotFoundError:
            pass
        finally:
            if fd is not None:
                os.close(fd)


def _same_file(fd: int, path: Path, dir_fd: int | None = None) -> bool:
    """Whether the name ``path`` (relative to ``dir_fd``, if given) is still the file open as ``fd`` (not following a link)."""
    try:
        st = os.stat(path.name if dir_fd is not None else path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read_record(fd: int) -> LockRecord | None:
    """The record in the open lock file ``fd`` (its first ``_RECORD_BYTES``), or None if empty or unreadable."""
    try:
        return LockRecord.parse(os.pread(fd, _RECORD_BYTES, 0).decode(errors="replace"))
    except OSError:
        return None


def _read_record_at(path: Path) -> LockRecord | None:
    """The record of the lock file at ``path``, opened without following a link; None if absent, a link or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | NOFOLLOW)
    except OSError:
        return None
    try:
        return _read_record(fd)
    finally:
        os.close(fd)


def _write_record(fd: int, record: LockRecord, path: Path) -> None:
    data = record.text().encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    except OSError as e:
        raise OutputWriteError(f"cannot write {path}: {e.strerror}") from e


def _clear_record(fd: int, path: Path) -> None:
    try:
        os.ftruncate(fd, 0)
    except OSError as e:
        raise OutputWriteError(f"cannot write {path}: {e.strerror}") from e


def _stale_here(holder: LockRecord, me: LockRecord) -> bool:
    """A record of a process on this host that is gone: its lock is being taken over."""
    return holder.host == me.host and not pid_alive(holder.pid)


def _flock(fd: int, how: int = fcntl.LOCK_EX) -> bool | None:
    """Try the flock (``fcntl.LOCK_EX`` or ``LOCK_SH``): True taken, False held by another, None unsupported here."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return None
        raise
    return True


def _open(path: Path, dir_fd: int) -> tuple[int, bool] | None:
    """Open the lock file (its name in folder ``dir_fd``), creating it if absent: (fd, created), or None if it vanished meanwhile.

    Raises:
        OutputWriteError: it cannot be created, or it is a link, not a regular file, or hard-linked.
    """
    try:
        try:
            return open_nofollow(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, dir_fd=dir_fd), True
        except FileExistsError:
            return open_nofollow(path, os.O_RDWR, dir_fd=dir_fd), False
    except FileNotFoundError:
        return None
    except OSError as e:
        raise OutputWriteError(f"cannot create {path.parent}: {e.strerror}") from e


def acquire_lock(output: Path, job: str | None, *, before_record: Callable[[], None] | None = None) -> OutputLock:
    """Take ``output``'s lock, or join it as a peer of the job holding it.

    Args:
        output: the final output path (its folder must exist).
        job: the shared tag every process of this job agrees on (``launch.shared_tag``); None for
            a single-node run, which never joins another's lock.
        before_record: called once the lock is taken, before the record that lets the job's
            peers in is written (``atomic_output`` checks for a left temporary there); if it
            raises, the lock file is removed and the exception goes on.

    Returns:
        The lock: ``taken`` in the process that holds it, not in a peer of its job.

    Raises:
        OutputLockedError: another job holds it (exit 4), naming the holder's host and pid.
        OutputWriteError: the lock file cannot be created or written (permission, space).
    """
    path = lock_path(output)
    try:
        dir_fd = open_folder(path.parent)
    except OSError as e:
        raise OutputWriteError(f"cannot create {path}: {e.strerror}") from e
    try:
        return _acquire(output, path, dir_fd, job, before_record)
    finally:
        os.close(dir_fd)


def _acquire(output: Path, path: Path, dir_fd: int, job: str | None, before_record: Callable[[], None] | None) -> OutputLock:
    """``acquire_lock``, the lock file's name opened in folder ``dir_fd``."""
    me = LockRecord.mine(job)
    deadline = time.monotonic() + _RECORD_WAIT_S
    while True:
        opened = _open(path, dir_fd)
        if opened is None:
            continue  # removed by its holder between our two opens
        fd, created = opened
        try:
            got = _flock(fd)
            if got is not False and not _same_file(fd, path, dir_fd):
                os.close(fd)  # its holder removed it meanwhile: start again on the new file
                continue
            holder = None if created else _read_record(fd)
            if got is False and (holder is None or _stale_here(holder, me)) and time.monotonic() < deadline:
                os.close(fd)  # its new holder has not written its record yet (a dead one's may still be there)
                time.sleep(0.02)
                continue
            same_host = holder is None or holder.host == me.host
            alive_here = got is False or (got is None and holder is not None and pid_alive(holder.pid))
            if holder is not None and job is not None and holder.job == job and (alive_here or not same_host):
                return _join(path, me, fd)  # another process of this job took it (a dead one on this host is taken over)
            unverified = got is True and not created and not same_host
            if got is None:  # no flock here: the O_EXCL create is the lock
                got = created or (same_host and not alive_here)
            elif unverified:
                got = False  # a holder on another node whose flock we may not see: refuse
            elif got and holder is not None and same_host and holder.pid != me.pid and pid_alive(holder.pid):
                got = False  # its holder is alive, between its exclusive and its shared flock
            if not got:
                raise OutputLockedError(locked_message(output, path.name, holder, unverified=unverified))
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        lock = OutputLock(path, me, fd)
        try:
            if not created:
                _clear_record(fd, path)  # a dead holder's record: the job's peers wait for ours, not join or refuse it
            if before_record is not None:
                before_record()
            _write_record(fd, me, path)
            _flock(fd, fcntl.LOCK_SH)  # the job's peers may now hold it with this process
        except BaseException:
            lock.release(remove=True)
            raise
        return lock


def _join(path: Path, me: LockRecord, fd: int) -> OutputLock:
    """Join the lock another process of this job took: hold its flock shared, so it stays held while this process runs.

    The holder turns its exclusive flock into a shared one right after writing its record; until
    then (at most ``_RECORD_WAIT_S``) this waits for it. Where flock is unsupported the lock file
    is closed and the peer holds nothing.
    """
    deadline = time.monotonic() + _RECORD_WAIT_S
    while (got := _flock(fd, fcntl.LOCK_SH)) is False and time.monotonic() < deadline:
        time.sleep(0.02)
    if not got:
        os.close(fd)
        return OutputLock(path, me, None, taken=False)
    return OutputLock(path, me, fd, taken=False)


def check_not_locked(output: Path, job: str | None) -> None:
    """Raise if another job is writing ``output`` (its lock held), without taking the lock; touches nothing.

    The lock file is opened read-only without following a link, its record read, and its flock
    tried exclusively for an instant (released at once): held means a live run. A record of this
    ``job`` is the job's own (another node or worker of it). Where flock is unsupported, a holder
    on this host is live if its pid is; a holder on another host cannot be checked from here and
    is refused as ``acquire_lock`` would refuse it. A lock that is free and names a process of
    this host is a dead run's: it passes, and ``acquire_lock`` takes it over.

    Raises:
        OutputLockedError: another job holds it (exit 4): the message names its pid and host and
            says to wait, suggesting no removal while it is alive.
    """
    try:
        fd = os.open(lock_path(output), os.O_RDONLY | os.O_NONBLOCK | NOFOLLOW)
    except OSError:
        return  # none there (or a link, which acquire_lock refuses)
    try:
        holder = _read_record(fd)
        got = _flock(fd)
        if got:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    me = LockRecord.mine(job)
    if holder is not None and job is not None and holder.job == job:
        return  # this job's own lock
    remote = holder is not None and holder.host != me.host
    if got is True and remote:
        raise OutputLockedError(locked_message(output, lock_name(output.name), holder, unverified=True))
    live = got is False or (got is None and holder is not None and (remote or pid_alive(holder.pid)))
    if live:
        who = "another process" if holder is None else f"pid {holder.pid} on {holder.host}"
        raise OutputLockedError(
            f"{output} is being written by another run, {who} (lock {lock_name(output.name)}); "
            "wait for it to finish (if it stops unfinished, run again with --resume)"
        )
