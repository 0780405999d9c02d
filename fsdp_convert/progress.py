"""Progress, beside every stage: one byte bar per long step on stderr (rich.progress), counting every worker's bytes.

A step (``write``, ``compare``, ``re-check``) runs on every worker of a job. Each worker counts
the bytes it moves in a ``StepProgress`` and adds them, now and then, to a counter every worker of
the job shares (``SharedCounter``: ``launch.worker_bars`` gives the job's c10d store); the worker
that shows the bar (rank 0's) reads the job's total back a few times a second. A run in one
process counts in memory. The bar goes to stderr only, never stdout (``--json`` output stays
alone there), and nothing is written at all when progress is off.

Units are binary (KiB, MiB, GiB: powers of 1024, as ``ls -h`` counts), the same in the done and
total bytes and in the rate (per second). Rate and time left appear only once the step has run
``WARMUP_S`` (a first frame's rate, from a few bytes in a few microseconds, would be absurd).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Protocol

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn

__all__ = [
    "PROGRESS_LOG_ENV",
    "WARMUP_S",
    "human_bytes",
    "clock_text",
    "ByteBar",
    "SharedCounter",
    "StepProgress",
    "Bars",
    "OFF",
]

logger = logging.getLogger(__name__)

# FSDP_CONVERT_PROGRESS_LOG=<folder>: every bar shown appends one JSON line when it closes to
# <folder>/progress-<pid>.jsonl (its totals and final frame; the tests read it from workers' processes)
PROGRESS_LOG_ENV = "FSDP_CONVERT_PROGRESS_LOG"

WARMUP_S = 0.5  # no rate or time left before the step has run this long, in seconds
RATE_WINDOW_S = 10.0  # the rate is the bytes moved over about the last this many seconds
REFRESH_S = 0.2  # the shown bar reads the counts and redraws this often, in seconds
PUSH_BYTES = 64 << 20  # a worker adds its bytes to the shared counter once it holds this many bytes...
PUSH_S = 0.2  # ...or this many seconds after its last add


def human_bytes(n: float, *, units: Literal["binary", "decimal"] = "binary") -> str:
    """A byte count for people: ``1536`` -> ``"1.5 KiB"``, ``512`` -> ``"512 B"``.

    Args:
        n: bytes (a rate in bytes per second works too).
        units: ``binary`` (KiB = 1024 B, as the progress bar and the temporary's note show sizes),
            or ``decimal`` (kB = 1000 B, as ``df -H`` shows free space: ``3_400_000_000`` -> ``"3.4 GB"``).
    """
    step, names = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if units == "binary" else (1000, ("B", "kB", "MB", "GB", "TB"))
    size = float(n)
    for unit in names:
        if size < step or unit == names[-1]:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= step
    raise AssertionError("unreachable")


def clock_text(seconds: float) -> str:
    """Seconds as ``H:MM:SS`` (``75.2`` -> ``"0:01:15"``), rounded to the second."""
    s = round(max(0.0, seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class ByteBar:
    """One step's bar on stderr: description, bar, percent, bytes done / total, rate, time left.

    Frames read ``write ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━  47% 2.1 GiB/4.5 GiB 312.4 MiB/s eta 0:00:08``;
    the last, once ``close``d, ``... 100% 4.5 GiB/4.5 GiB 298.0 MiB/s in 0:00:15`` (the mean rate).
    On a terminal the bar redraws in place; elsewhere (a file, a pipe) only the last frame is
    written. Disabled, it writes nothing and starts nothing.

    Args:
        description: the step's name, first on the line.
        total_bytes: the step's bytes, in bytes.
        enabled: False writes nothing.
        console: where to draw (default: a console on stderr, found at each write).
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(
        self,
        description: str,
        total_bytes: int,
        *,
        enabled: bool = True,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.description = description
        self.total_bytes = total_bytes
        self.enabled = enabled
        self.done_bytes = 0
        self.moved_bytes = 0
        self.closed = False
        self._clock = clock
        self._start: float | None = None
        self._samples: deque[tuple[float, int]] = deque()  # (time, bytes moved) over the rate window
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if enabled:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=30),
                TextColumn("{task.fields[numbers]}"),
                console=console or Console(stderr=True),
                auto_refresh=False,
                redirect_stdout=False,  # never touch stdout: it carries the result alone
                redirect_stderr=False,
            )

    def start(self) -> None:
        """Start the clock and draw the first frame (bytes only: no rate or time left yet)."""
        self._start = self._clock()
        self._samples.append((self._start, self.moved_bytes))
        if self._progress is not None:
            self._task = self._progress.add_task(self.description, total=max(self.total_bytes, 1), numbers=self.numbers())
            self._progress.start()
            self._progress.refresh()

    def update(self, done_bytes: int, moved_bytes: int | None = None) -> None:
        """Set the bytes done and redraw.

        Args:
            done_bytes: bytes of the step in place, in bytes (moved, or kept from an interrupted run).
            moved_bytes: of those, the bytes moved by this run, the rate's bytes (default: all of them).
        """
        now = self._clock()
        if self._start is None:
            self._start = now
        self.done_bytes = done_bytes
        self.moved_bytes = done_bytes if moved_bytes is None else moved_bytes
        self._samples.append((now, self.moved_bytes))
        while len(self._samples) > 1 and self._samples[1][0] <= now - RATE_WINDOW_S:
            self._samples.popleft()  # keep one sample at or before the window's start
        self._redraw()

    def rate(self) -> float | None:
        """Bytes moved per second over the last ``RATE_WINDOW_S``; None before ``WARMUP_S`` (or with nothing moved)."""
        if self._start is None or not self._samples:
            return None
        now, moved = self._samples[-1]
        then, moved_then = self._samples[0]
        if now - self._start < WARMUP_S or now - then < WARMUP_S or moved <= 0:
            return None
        return (moved - moved_then) / (now - then)

    def numbers(self) -> str:
        """The text after the bar: percent, bytes done / total, and the rate and time left (or taken, once closed)."""
        total = self.total_bytes
        percent = 100 * self.done_bytes // total if total else (100 if self.closed else 0)
        text = f"{percent:3d}% {human_bytes(self.done_bytes)}/{human_bytes(total)}"
        if self.closed:
            elapsed = (self._samples[-1][0] - self._start) if self._start is not None and self._samples else 0.0
            if elapsed > 0 and self.moved_bytes > 0:
                text += f" {human_bytes(self.moved_bytes / elapsed)}/s"
            return f"{text} in {clock_text(elapsed)}"
        rate = self.rate()
        if rate is None:
            return text
        text += f" {human_bytes(rate)}/s"
        if rate > 0:
            text += f" eta {clock_text(max(0, total - self.done_bytes) / rate)}"
        return text

    def frame(self) -> str:
        """The line as drawn, without the bar: ``write 100% 4.5 GiB/4.5 GiB 298.0 MiB/s in 0:00:15``."""
        return f"{self.description} {self.numbers()}"

    def _redraw(self) -> None:
        if self._progress is None or self._task is None:
            return
        total = self.total_bytes
        completed = self.done_bytes if total else (1 if self.closed else 0)
        self._progress.update(self._task, completed=completed, numbers=self.numbers())
        self._progress.refresh()

    def close(self, *, final: bool = True) -> None:
        """Draw the last frame and stop: with ``final``, the time taken and mean rate (else the frame as it stood)."""
        if self.closed:
            return
        if final:
            now = self._clock()
            self._samples.append((now, self.moved_bytes))
            self.closed = True
            self._redraw()
        self.closed = True
        if self._progress is not None:
            self._progress.stop()


class SharedCounter(Protocol):
    """Integer counters every worker of a job adds to (``launch.worker_bars``: the job's c10d store)."""

    def add(self, name: str, amount: int) -> int:
        """Add ``amount`` to counter ``name`` (0 when new); its new value, every worker's adds included."""
        ...


class StepProgress:
    """One step's bytes on every worker of a job, and the bar of the job's total on the worker that shows it.

    Every worker counts the bytes it moves (``advance``, from any thread) and those an interrupted
    run left in place (``keep``); with a ``shared`` counter it adds them there (at most every
    ``PUSH_BYTES`` or ``PUSH_S``, and at ``flush``). The showing worker reads the job's total
    every ``REFRESH_S`` and draws it. Use it as a context manager on every worker, and ``flush``
    before the step's last collective (a gather, a barrier): the showing worker leaves the block
    after it, so its last frame counts every worker's bytes.

    Args:
        name: the step's counter name, the same on every worker (``write``, ``verify``...).
        description: the bar's label.
        total_bytes: the bytes of the step on every worker counted (the job's, with ``shared``).
        enabled: False: no counting, no bar, no traffic.
        show: this worker draws the bar (rank 0).
        shared: the job's counter; None counts in this process only.
        console: where to draw (default stderr).
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        name: str,
        description: str,
        total_bytes: int,
        *,
        enabled: bool,
        show: bool,
        shared: SharedCounter | None = None,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.enabled = enabled
        self.bar = ByteBar(description, total_bytes, enabled=enabled and show, console=console, clock=clock)
        self._show = enabled and show
        self._shared = shared if enabled else None
        self._clock = clock
        self._lock = threading.Lock()
        self._moved = self._kept = 0  # this worker's
        self._pending_moved = self._pending_kept = 0  # not yet added to the shared counter
        self._last_push = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shared_failed = False
        self._closed = False

    def __enter__(self) -> StepProgress:
        if self._show:
            self.bar.start()
            self._thread = threading.Thread(target=self._poll, name=f"fsdp-convert-progress-{self.name}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(final=exc_type is None)

    def advance(self, nbytes: int) -> None:
        """Count ``nbytes`` moved by this worker (thread-safe)."""
        self._count(nbytes, 0)

    def keep(self, nbytes: int) -> None:
        """Count ``nbytes`` already in place (kept from an interrupted run): done, but not in the rate."""
        self._count(0, nbytes)

    def _count(self, moved: int, kept: int) -> None:
        if not self.enabled or not (moved or kept):
            return
        with self._lock:
            self._moved += moved
            self._kept += kept
            self._pending_moved += moved
            self._pending_kept += kept
            due = self._pending_moved + self._pending_kept >= PUSH_BYTES or self._clock() - self._last_push >= PUSH_S
            if self._shared is not None and due:
                self._push()

    def flush(self) -> None:
        """Add every byte counted so far to the shared counter (before the step's last collective)."""
        if self._shared is not None:
            with self._lock:
                self._push()

    def _push(self) -> None:
        """Under the lock: add the pending bytes to the shared counter."""
        assert self._shared is not None
        try:
            if self._pending_moved:
                self._shared.add(f"{self.name}/moved", self._pending_moved)
            if self._pending_kept:
                self._shared.add(f"{self.name}/kept", self._pending_kept)
        except Exception as e:  # the bar is not worth failing a conversion for; a lost store fails the job elsewhere
            self._lost(e)
        self._pending_moved = self._pending_kept = 0
        self._last_push = self._clock()

    def _lost(self, e: Exception) -> None:
        if not self._shared_failed:
            logger.debug("progress: the job's counter failed (%s: %s); counting this worker's bytes only", type(e).__name__, e)
        self._shared_failed = True
        self._shared = None

    def totals(self) -> tuple[int, int]:
        """(bytes done, bytes moved) of the step so far: the job's with a shared counter, else this worker's."""
        with self._lock:
            shared = self._shared
            moved, kept, pending_moved, pending_kept = self._moved, self._kept, self._pending_moved, self._pending_kept
        if shared is None:
            return moved + kept, moved
        try:
            job_moved = shared.add(f"{self.name}/moved", 0) + pending_moved
            job_kept = shared.add(f"{self.name}/kept", 0) + pending_kept
        except Exception as e:
            with self._lock:
                self._lost(e)
            return moved + kept, moved
        return job_moved + job_kept, job_moved

    def _poll(self) -> None:
        while not self._stop.wait(REFRESH_S):
            self.bar.update(*self.totals())

    def close(self, *, final: bool = True) -> None:
        """Flush; on the showing worker, draw the last frame and log it (``PROGRESS_LOG_ENV``).

        ``final``: the step is done (called after its last collective): the job's totals, read now.
        Otherwise (the step failed) nothing more goes to the store: the frame shows this process's
        count, or with a shared counter the frame as it stood.
        """
        if not self.enabled or self._closed:
            return
        self._closed = True
        if final:
            self.flush()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(None if final else 1.0)  # a failed job's store may be slow to answer
        if not self._show:
            return
        if final or self._shared is None:
            self.bar.update(*self.totals())
        self.bar.close(final=final)
        if final:
            _log_frame(self.bar)


def _log_frame(bar: ByteBar) -> None:
    """Append the bar's totals and last frame to ``$FSDP_CONVERT_PROGRESS_LOG/progress-<pid>.jsonl``, if set."""
    folder = os.environ.get(PROGRESS_LOG_ENV)
    if not folder:
        return
    line = {
        "description": bar.description,
        "total_bytes": bar.total_bytes,
        "done_bytes": bar.done_bytes,
        "moved_bytes": bar.moved_bytes,
        "frame": bar.frame(),
    }
    with open(Path(folder) / f"progress-{os.getpid()}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


@dataclass(frozen=True, slots=True)
class Bars:
    """A worker's progress settings for the steps of one job (``launch.worker_bars`` makes them).

    Attributes:
        enabled: bars are on (the caller's ``progress``); off, every step is silent and free.
        show: this worker draws them (rank 0).
        shared: the job's counter (several workers); None: this process counts alone.
        whole_job: the bars count every worker's bytes (one process, or a shared counter); False:
            several workers without a shared counter, so each counts (and rank 0 shows) its own share.
    """

    enabled: bool
    show: bool
    shared: SharedCounter | None = None
    whole_job: bool = True

    def step(self, name: str, description: str, job_bytes: int, share_bytes: int) -> StepProgress:
        """A step's progress: of the whole job's ``job_bytes``, or (``whole_job`` False) of this worker's ``share_bytes``."""
        if not self.whole_job:
            description, job_bytes = f"{description} (rank 0's share)", share_bytes
        return StepProgress(name, description, job_bytes, enabled=self.enabled, show=self.show, shared=self.shared)


OFF = Bars(enabled=False, show=False)
