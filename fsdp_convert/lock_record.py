"""What an output's lock says: the local lock file's (``writers._lock``) and the object-storage one's (``writers._object_lock``).

A leaf: both locks name the lock ``.<name>.lock`` beside the output, hold one ``LockRecord`` line
(``host pid since job``) and refuse another run with the same message.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

__all__ = ["SINGLE", "LockRecord", "lock_name", "locked_message", "pid_alive"]

SINGLE = "-"  # the job of a single-node run, which has no peers


def lock_name(output_name: str) -> str:
    """The lock's name for an output named ``output_name``: ``.<name>.lock``, beside it."""
    return f".{output_name}.lock"


@dataclass(frozen=True, slots=True)
class LockRecord:
    """What a lock file says: who holds it.

    Attributes:
        host: the holder's host name.
        pid: the holder's process id on that host.
        since: when it took the lock, in Unix seconds.
        job: the shared tag of its job (``-``: a single-node run, which has no peers).
    """

    host: str
    pid: int
    since: float
    job: str

    @staticmethod
    def mine(job: str | None) -> LockRecord:
        """This process's record, taken now (``job`` None: a single-node run)."""
        return LockRecord(socket.gethostname(), os.getpid(), round(time.time(), 3), job or SINGLE)

    def text(self) -> str:
        """The record as the lock file holds it: one line."""
        return f"{self.host} {self.pid} {self.since:.3f} {self.job}\n"

    @staticmethod
    def parse(text: str) -> LockRecord | None:
        """Read a record back; None for an empty or unreadable one (a holder that died before writing it)."""
        fields = text.split()
        if len(fields) != 4:
            return None
        try:
            return LockRecord(fields[0], int(fields[1]), float(fields[2]), fields[3])
        except ValueError:
            return None


def pid_alive(pid: int) -> bool:
    """True unless no process ``pid`` exists on this host (one we may not signal is alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def locked_message(output: object, lock: str, holder: LockRecord | None, *, unverified: bool = False) -> str:
    """The one line refusing a run whose output another holds.

    Args:
        output: the output as the user named it (a path or URL).
        lock: the lock as shown: a lock file's name, or a lock object's URL.
        holder: the holder's record, None when it cannot be read.
        unverified: the holder is on another node whose flock is not visible from here.
    """
    who = "another process" if holder is None else f"pid {holder.pid} on {holder.host}"
    seen = "; its flock is not held from here, so that node's process may be gone" if unverified else ""
    return f"{output} is being written by {who} (lock {lock}){seen}; wait for it, or remove the lock if that process is gone"
