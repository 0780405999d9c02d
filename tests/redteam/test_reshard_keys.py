"""Issue 37 N12: ``reshard`` refuses a key its own DCP reader refuses, before writing anything.

A ``.pt`` may key its dicts with any string; a DCP folder's reader takes only keys that print on
one line (``str.isprintable``: no newline, NUL, lone surrogate). ``reshard`` of such a ``.pt``
exited 0, and then ``inspect`` and ``verify`` of its output refused it ("not a printable string").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fsdp_convert
from fsdp_convert.errors import UnsupportedTransformError

from ._attack import RSS_BOUND_BYTES, SECONDS_BOUND, attack

_CASES = [
    ({"model": {"w\nx": torch.ones(2)}}, r"w\nx"),
    ({"model": {"a\x00b": torch.ones(2)}}, r"a\x00b"),
    ({"model": {"s\ud800": torch.ones(2)}}, r"s\ud800"),
    ({"model": {"w": torch.ones(2)}, "train": {"note\x1b[2J": 3}}, r"note\x1b[2J"),  # a value's key, nested
]
_IDS = ["newline", "nul", "lone-surrogate", "escape-in-a-value-key"]


def test_reshard_cli_refuses_a_newline_key(tmp_path: Path) -> None:
    """The command: exit 1, one escaped error line naming the key, nothing written."""
    torch.save(_CASES[0][0], tmp_path / "src.pt")
    out = tmp_path / "out"
    result = attack(["reshard", tmp_path / "src.pt", out, "--world-size", "2"])
    assert result.code == 1, result.stderr
    assert len(result.error_lines) == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert r"w\nx" in result.error_lines[0] and result.error_lines[0].isprintable()
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src.pt"]
    assert result.seconds < 3 * SECONDS_BOUND and result.max_rss_bytes < RSS_BOUND_BYTES  # not a cost attack


@pytest.mark.parametrize(("state", "shown"), _CASES, ids=_IDS)
def test_reshard_refuses_a_key_its_reader_refuses(tmp_path: Path, state: dict[str, object], shown: str) -> None:
    """Every key the DCP reader refuses is refused before anything is written, named escaped on one line."""
    torch.save(state, tmp_path / "src.pt")
    with pytest.raises(UnsupportedTransformError) as raised:
        fsdp_convert.reshard(tmp_path / "src.pt", tmp_path / "out", world_size=2)
    assert shown in str(raised.value) and str(raised.value).isprintable()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.pt"]


def test_reshard_of_printable_keys_reads_back(tmp_path: Path) -> None:
    """Keys with spaces and non-ASCII letters print: reshard writes them and inspect reads the output."""
    torch.save({"model": {"layer één": torch.ones(2)}, "train": {"a b": 1}}, tmp_path / "src.pt")
    fsdp_convert.reshard(tmp_path / "src.pt", tmp_path / "out", world_size=2)
    assert {e.fqn for e in fsdp_convert.inspect(tmp_path / "out").entries} == {"model.layer één", "train.a b"}
