"""Page-cache hints: writeback is started once per WRITEBACK_EVERY_BYTES written to a file, not once per write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fsdp_convert import _pagecache


def test_writeback_starts_once_per_writeback_every_bytes_over_the_range_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 128-expert weight's 32 KiB tensors each called sync_file_range, which did I/O per call (1.7x a plain copy)."""
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(_pagecache, "_sync_file_range", lambda: lambda *a: calls.append(a) or 0)
    monkeypatch.setattr(_pagecache, "WRITEBACK_EVERY_BYTES", 100)
    cache = _pagecache.PageCache(drop=False)
    for i in range(9):  # 40-byte writes, out of order: 0..80 then 200..320 (the 3rd write passes 100 bytes)
        at = [40, 0, 80, 200, 240, 280, 1000, 1040, 1080][i]
        cache.wrote(7, at, 40)
    w = _pagecache._SYNC_WRITE
    assert calls == [(7, 0, 120, w), (7, 200, 120, w), (7, 1000, 120, w)]
    cache.wrote(8, 0, 150)  # one write past the threshold: at once, for its own file
    assert calls[-1] == (8, 0, 150, w)
