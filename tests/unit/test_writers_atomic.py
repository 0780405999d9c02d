"""writers/_atomic.py: atomic_output writes to a temporary name and replaces the output only at the end."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_convert.errors import OutputExistsError
from fsdp_convert.writers import atomic_output


def test_atomic_output_leaves_nothing_on_error(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    with pytest.raises(RuntimeError), atomic_output(out, overwrite=False) as tmp:
        tmp.write_bytes(b"partial")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_replaces_only_at_the_end(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    out.write_bytes(b"old")
    with pytest.raises(OutputExistsError), atomic_output(out, overwrite=False):
        pass
    with atomic_output(out, overwrite=True) as tmp:
        tmp.write_bytes(b"new")
        assert out.read_bytes() == b"old"
    assert out.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.pt"]
