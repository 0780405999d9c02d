"""signals.py: raise_or_defer raises at once outside torch_call, and at the end of the outermost torch_call inside it."""

from __future__ import annotations

import threading

import pytest

from fsdp_convert.signals import raise_or_defer, torch_call


class _Stop(Exception):
    pass


def test_outside_torch_call_it_raises_at_once() -> None:
    with pytest.raises(_Stop):
        raise_or_defer(_Stop())


def test_inside_nested_torch_calls_it_raises_when_the_outermost_ends() -> None:
    reached: list[str] = []
    with pytest.raises(_Stop, match="first"):
        with torch_call():
            with torch_call():
                raise_or_defer(_Stop("first"))
                raise_or_defer(_Stop("second"))  # the first one is kept
                reached.append("inner")
            reached.append("outer")  # the inner block's end does not raise yet
    assert reached == ["inner", "outer"]
    with torch_call():  # nothing left pending afterwards
        pass


def test_an_exception_from_the_block_goes_through_and_the_depth_recovers() -> None:
    with pytest.raises(KeyError), torch_call():
        raise KeyError("x")
    with pytest.raises(_Stop):
        raise_or_defer(_Stop())  # depth is back to 0: raised at once


def test_depth_is_per_thread() -> None:
    caught: list[BaseException] = []

    def other() -> None:
        try:
            raise_or_defer(_Stop("other thread"))
        except _Stop as e:
            caught.append(e)

    with torch_call():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(caught) == 1  # the main thread's torch_call does not defer another thread's raise
