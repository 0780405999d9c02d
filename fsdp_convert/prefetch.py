"""Overlap of the read and write stages: a producer thread feeding the writer within a byte budget.

The producer (reading chunks, assembling tensors, or receiving them from other ranks) runs in a
thread and the writer in the caller's thread; file reads, tensor copies, gloo transfers and file
writes all release the GIL, so the two overlap and a conversion runs near the slower of read and
write rather than their sum.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Generator, Iterable
from typing import Generic, TypeVar

__all__ = ["ByteBudget", "prefetch", "JOIN_TIMEOUT_S"]

JOIN_TIMEOUT_S = 60.0  # longest wait, in seconds, for the producer's current job after an error

T = TypeVar("T")


class ByteBudget:
    """Counts bytes held between producer and consumer; ``acquire`` waits for room.

    A request larger than the whole budget is admitted when nothing else is held, so one tensor
    bigger than the budget still goes through (the memory bound is budget + largest tensor).

    Args:
        budget_bytes: most bytes held at once (except as above), in bytes.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.held_bytes = 0
        self._cond = threading.Condition()
        self._closed = False

    def acquire(self, nbytes: int) -> bool:
        """Wait until ``nbytes`` fit; return False if the budget was closed meanwhile."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self.held_bytes == 0 or self.held_bytes + nbytes <= self.budget_bytes)
            if self._closed:
                return False
            self.held_bytes += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` once the data they stood for is freed."""
        with self._cond:
            self.held_bytes -= nbytes
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter; later ``acquire`` calls return False."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Done:
    pass


class _Channel(Generic[T]):
    def __init__(self) -> None:
        self.items: collections.deque[tuple[T, int] | _Failure | _Done] = collections.deque()
        self.cond = threading.Condition()

    def put(self, item: tuple[T, int] | _Failure | _Done) -> None:
        with self.cond:
            self.items.append(item)
            self.cond.notify_all()

    def get(self) -> tuple[T, int] | _Failure | _Done:
        with self.cond:
            self.cond.wait_for(lambda: bool(self.items))
            return self.items.popleft()


def prefetch(jobs: Iterable[tuple[int, Callable[[], T]]], budget_bytes: int) -> Generator[T, None, None]:
    """Run ``jobs`` in a background thread, in order, and yield their results in order.

    Each job is ``(nbytes, produce)``: room for ``nbytes`` is taken from the budget *before*
    ``produce()`` runs (so a tensor being assembled counts too) and given back when the consumer
    asks for the next result, i.e. once it is done with this one. At most ``budget_bytes`` are
    held, or one job alone when it is bigger.

    An exception in a job is re-raised in the consumer. If the consumer stops early the thread
    is told to stop after its current job, which is waited for (up to ``JOIN_TIMEOUT_S``); it is
    a daemon, so a job stuck in a transfer whose peer died cannot keep the process alive.
    """
    budget = ByteBudget(budget_bytes)
    channel: _Channel[T] = _Channel()

    def run() -> None:
        try:
            for nbytes, produce in jobs:
                if not budget.acquire(nbytes):
                    return
                channel.put((produce(), nbytes))
            channel.put(_Done())
        except BaseException as e:  # handed to the consumer, which re-raises it
            channel.put(_Failure(e))

    thread = threading.Thread(target=run, name="fsdp-convert-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = channel.get()
            if isinstance(item, _Done):
                break
            if isinstance(item, _Failure):
                raise item.error
            value, nbytes = item
            del item
            yield value
            # the consumer asks for the next item: it is done with this one
            del value
            budget.release(nbytes)
        thread.join()
    finally:
        budget.close()
        # wait for the job in progress: a thread left inside torch code while the interpreter
        # exits aborts the process ("terminate called without an active exception")
        thread.join(timeout=JOIN_TIMEOUT_S)
