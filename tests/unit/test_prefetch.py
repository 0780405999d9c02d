"""prefetch: order kept, byte budget honoured, errors surface in the consumer."""

from __future__ import annotations

import threading
import time

import pytest

import fsdp_convert.prefetch as prefetch_module
from fsdp_convert.prefetch import prefetch


class _Meter:
    """Counts bytes produced and not yet consumed, as the memory the pipeline holds."""

    def __init__(self) -> None:
        self.held = 0
        self.peak = 0
        self.lock = threading.Lock()

    def job(self, i: int, nbytes: int) -> tuple[int, object]:
        def produce() -> object:
            with self.lock:
                self.held += nbytes
                self.peak = max(self.peak, self.held)
            time.sleep(0.001)
            return (i, nbytes)

        return nbytes, produce

    def consumed(self, nbytes: int) -> None:
        with self.lock:
            self.held -= nbytes


def test_prefetch_keeps_order_and_budget() -> None:
    meter = _Meter()
    sizes = [30, 10, 50, 20, 40, 10, 10, 60]
    got = []
    for i, nbytes in prefetch([meter.job(i, n) for i, n in enumerate(sizes)], budget_bytes=64):
        time.sleep(0.002)  # a slow writer: the producer runs ahead until the budget stops it
        got.append(i)
        meter.consumed(nbytes)
    assert got == list(range(len(sizes)))
    assert meter.peak <= 64


def test_prefetch_admits_one_item_bigger_than_the_budget() -> None:
    meter = _Meter()
    out = [n for _, n in prefetch([meter.job(0, 10), meter.job(1, 500), meter.job(2, 10)], budget_bytes=64)]
    assert out == [10, 500, 10]


def test_prefetch_reraises_producer_error() -> None:
    def boom() -> object:
        raise ValueError("bad chunk")

    it = prefetch([(1, lambda: 1), (1, boom), (1, lambda: 3)], budget_bytes=10)
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad chunk"):
        next(it)


@pytest.mark.parametrize("budget_bytes", [20, 10**9], ids=["waiting-on-the-budget", "budget-above-all-jobs"])
def test_prefetch_consumer_stopping_early_stops_the_producer(monkeypatch: pytest.MonkeyPatch, budget_bytes: int) -> None:
    """Closing the generator stops the producer thread after its current job: woken from the
    budget's wait when the budget holds it, told to stop when the budget never would (1000 jobs of
    10 ms: 10 s of work it must not do)."""
    monkeypatch.setattr(prefetch_module, "JOIN_TIMEOUT_S", 5.0)  # how long close() waits for it: 5 s, not 60
    produced = []

    def job(i: int) -> tuple[int, object]:
        def produce() -> object:
            time.sleep(0.01)
            produced.append(i)
            return i

        return 10, produce

    before = set(threading.enumerate())
    it = prefetch([job(i) for i in range(1000)], budget_bytes=budget_bytes)
    assert next(it) == 0
    (producer,) = [t for t in threading.enumerate() if t not in before and t.name == "fsdp-convert-prefetch"]
    deadline = time.monotonic() + 30
    while len(produced) < 2:  # job 1 done: with the small budget the producer now waits for room for job 2
        assert time.monotonic() < deadline, "the producer did not get to job 1"
        time.sleep(0.001)
    time.sleep(0.05)
    start = time.monotonic()
    it.close()
    assert not producer.is_alive(), f"the producer still runs {time.monotonic() - start:.1f} s after the consumer stopped"
    assert len(produced) < 1000
    if budget_bytes == 20:
        assert len(produced) <= 3  # the budget stopped it, and closing released it without running the rest
