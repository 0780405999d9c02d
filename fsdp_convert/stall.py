"""A stalled worker, reported: one that has used no CPU for ``FSDP_CONVERT_STALL_SECONDS`` (60 s unless set).

A worker stopped by SIGSTOP (or a debugger) or stuck on a dead disk does not exit, so its
sentinel never fires and the job would wait silently. The parent that watches the workers
(``_local_workers.run_local``) asks a ``StallWatch`` every ``interval`` seconds: a worker in state
T (stopped) whose CPU time has not moved for the timeout is named, by rank and pid; when no
worker's has moved, the job's workers are named with their states. Each stall is reported once,
as a warning: the run goes on (a slow disk is not an error) and Ctrl-C still stops it. The
progress read is ``/proc/<pid>/stat`` (Linux); where it is missing, nothing is reported.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping

__all__ = ["STALL_ENV", "DEFAULT_STALL_S", "stall_seconds", "StallWatch"]

logger = logging.getLogger(__name__)

STALL_ENV = "FSDP_CONVERT_STALL_SECONDS"
DEFAULT_STALL_S = 60.0
_STATES = {"T": "stopped", "t": "stopped by a debugger", "D": "waiting on a disk", "S": "waiting", "R": "running"}


def stall_seconds() -> float:
    """``FSDP_CONVERT_STALL_SECONDS`` (seconds; 0 turns the report off), else ``DEFAULT_STALL_S``; a bad value is the default."""
    try:
        seconds = float(os.environ.get(STALL_ENV, DEFAULT_STALL_S))
    except ValueError:
        return DEFAULT_STALL_S
    return seconds if seconds >= 0 and seconds == seconds else DEFAULT_STALL_S


def _stat(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter and CPU time (user + system, in clock ticks); None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read(4096).decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces and parentheses
    try:
        return fields[0], int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None


class StallWatch:
    """The workers' CPU time, read now and then: a worker (or the whole job) that has not moved for ``seconds`` is reported.

    Args:
        pids: each worker's pid, by rank.
        seconds: the timeout; None reads ``stall_seconds()``; 0 turns the watch off.
    """

    def __init__(self, pids: Mapping[int, int], seconds: float | None = None) -> None:
        self._pids = dict(pids)
        self.seconds = stall_seconds() if seconds is None else seconds
        self._seen: dict[int, tuple[int, float, str]] = {}  # rank -> (CPU ticks, when they last moved, state)
        self._reported: set[int] = set()  # ranks reported in their current stall
        self._moved = time.monotonic()  # when a worker last used CPU
        self._finished = False  # a worker has finished: those left may wait on the parent, not stalled

    @property
    def interval(self) -> float | None:
        """Seconds between two ``check`` calls (None: never, the watch is off)."""
        if not self.seconds or not os.path.isdir("/proc/self"):
            return None
        return min(self.seconds / 4, 5.0)

    def check(self, running: Iterable[int]) -> None:
        """Read the ``running`` ranks' CPU time and report each stall once (a logged warning)."""
        now = time.monotonic()
        running = set(running)
        if set(self._seen) - running:
            self._finished = True
            self._seen = {rank: seen for rank, seen in self._seen.items() if rank in running}
        for rank in running:
            stat = _stat(self._pids[rank])
            if stat is None or stat[0] == "Z":  # gone or exiting (its sentinel not seen yet): finished
                self._seen.pop(rank, None)
                self._finished = True
                continue
            state, ticks = stat
            ticks_before, since, _ = self._seen.get(rank, (-1, now, state))
            if ticks != ticks_before:
                since = self._moved = now
                self._reported.discard(rank)
            self._seen[rank] = (ticks, since, state)
        idle = {rank: seen for rank, seen in self._seen.items() if now - seen[1] >= self.seconds}
        stopped = [rank for rank, (_, _, state) in sorted(idle.items()) if state in "tT" and rank not in self._reported]
        for rank in stopped:
            pid, (_, since, state) = self._pids[rank], idle[rank]
            logger.warning(
                "worker rank %d (pid %d) is %s and has made no progress for %.0f s: `kill -CONT %d` resumes it",
                *(rank, pid, _STATES[state], now - since, pid),
            )
        if stopped:  # the cause of this stall: its peers, waiting for it, are not reported again
            self._reported |= set(idle)
        elif (
            idle
            and not self._finished
            and len(idle) == len(self._seen)
            and now - self._moved >= self.seconds
            and not self._reported & set(idle)
        ):
            named = ", ".join(
                f"rank {r} (pid {self._pids[r]}, {_STATES.get(s, 'state ' + s)})" for r, (_, _, s) in sorted(idle.items())
            )
            logger.warning("no worker has made progress for %.0f s: %s", now - max(s for _, s, _ in idle.values()), named)
            self._reported |= set(idle)
