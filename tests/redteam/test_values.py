"""Hostile plain values (issue 37, N4, N9, N10): shared references, depth, values that hold themselves, NaN.

A pickle of 2 KB can build ``x = [x, x]`` nested 40 levels: 2^40 paths through one object per
level. Every walk over a plain value (flattening, the checks for tensors inside, ``verify``'s
comparison, the writers) must visit each object once, refuse a value nested too deep or holding
itself in one line (exit 1, never 70 "internal error"), and compare floats by their bits, so a
NaN equals itself as it does in tensors.
"""

from __future__ import annotations

import io
import math
import pickle
import sys
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fsdp_convert
from fsdp_convert.errors import CorruptChunkError
from tests.redteam._attack import RSS_BOUND_BYTES, SECONDS_BOUND, attack

_PLACEHOLDER = "__the_hostile_value__"


def _laughs(levels: int) -> list[Any]:
    """``x = [x, x]``, ``levels`` times: 2^levels paths, ``levels + 1`` lists."""
    x: list[Any] = []
    for _ in range(levels):
        x = [x, x]
    return x


def _holds_itself() -> list[Any]:
    x: list[Any] = [1.5]
    x.append(x)
    return x


def _save_pt(path: Path, value: Any) -> Path:
    torch.save({"w": torch.ones(2), "extra": value}, path)
    return path


def _save_dcp(root: Path, value: Any) -> Path:
    """A DCP checkpoint whose ``extra.v`` is a bytes entry holding ``value`` (in a tuple: DCP's flattening stops there)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(2)}, "extra": {"v": (value,)}}, checkpoint_id=root, no_dist=True)
    return root


def _deep_pt(path: Path, depth: int) -> Path:
    """A torch.save file whose ``extra`` is a list nested ``depth`` deep, its pickle written by hand (no recursion)."""
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2), "extra": _PLACEHOLDER}, buf)
    placeholder = pickle.BINUNICODE + len(_PLACEHOLDER).to_bytes(4, "little") + _PLACEHOLDER.encode()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                assert data.count(placeholder) == 1
                # EMPTY_LIST depth times, then APPEND depth - 1 times: each list into the one before it
                data = data.replace(placeholder, pickle.EMPTY_LIST * depth + pickle.APPEND * (depth - 1))
            out.writestr(info.filename, data)
    return path


def _consolidate_in_process(source: Path, out: Path) -> None:
    """``consolidate --verify`` in this process, within the issue's time bound (the CLI runs cover exit codes and RSS)."""
    start = time.monotonic()
    fsdp_convert.consolidate(source, out, verify_output=True)
    assert time.monotonic() - start < SECONDS_BOUND


def _refused_in_process(source: Path, out: Path, why: str) -> None:
    """consolidate and verify of ``source`` each refuse it in one line naming the file and ``'extra'`` (exit code 1)."""
    with pytest.raises(CorruptChunkError, match=f"'extra'.*{why}") as refused:
        fsdp_convert.consolidate(source, out)
    assert refused.value.exit_code == 1 and source.name in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(CorruptChunkError, match=why):
        fsdp_convert.verify(source, source)


def _check_bounds(run: Any) -> None:
    assert run.seconds < SECONDS_BOUND + 5, run  # start-up (torch's import) dominates on a slow machine
    assert run.max_rss_bytes < RSS_BOUND_BYTES, run


# --- N4: shared references cost one visit --------------------------------------------------------


@pytest.mark.parametrize("levels", [20, 40])
def test_shared_references_in_a_pt_consolidate_fast_and_faithfully(tmp_path: Path, levels: int) -> None:
    source = _save_pt(tmp_path / f"laughs{levels}.pt", _laughs(levels))
    assert source.stat().st_size < 4096
    out = tmp_path / "out.pt"
    if levels < 40:
        _consolidate_in_process(source, out)
    else:  # the worst case also as a user runs it: exit code and peak RSS
        run = attack(["consolidate", source, out, "--verify"], timeout=30)
        assert run.code == 0, run.stderr
        _check_bounds(run)
    x = torch.load(out, weights_only=True)["extra"]
    for _ in range(levels):  # shared as saved: one list per level
        assert len(x) == 2 and x[0] is x[1]
        x = x[0]
    assert x == []


@pytest.mark.parametrize("levels", [20, 40])
def test_shared_references_in_a_dcp_verify_and_consolidate_fast(tmp_path: Path, levels: int) -> None:
    """``verify`` compared the two values with ``==`` in C: 2^40 steps, deaf to Ctrl-C."""
    source = _save_dcp(tmp_path / "ck", _laughs(levels))
    out = tmp_path / "out.pt"
    if levels < 40:  # --verify: the output against the source
        _consolidate_in_process(source, out)
    else:
        run = attack(["consolidate", source, out, "--verify"], timeout=30)
        assert run.code == 0, run.stderr
        _check_bounds(run)
    (x,) = torch.load(out, weights_only=True)["extra"]["v"]
    for _ in range(levels):
        assert x[0] is x[1]
        x = x[0]
    assert fsdp_convert.verify(source, source).equal


def test_shared_containers_holding_a_tensor_refused_in_one_line(tmp_path: Path) -> None:
    """2^40 paths to one tensor: DCP's flattening would make 2^40 entries; refused, naming the file and key."""
    x: Any = {"t": torch.ones(1)}
    for _ in range(40):
        x = [x, x]
    torch.save({"w": torch.ones(2), "extra": x}, tmp_path / "bomb.pt")
    run = attack(["consolidate", tmp_path / "bomb.pt", tmp_path / "out.pt"], timeout=30)
    assert run.code != 70 and run.code not in (0, None), run.stderr
    assert len(run.error_lines) == 1 and "bomb.pt" in run.error_lines[0] and "'extra'" in run.error_lines[0], run.stderr
    _check_bounds(run)


# --- N10: deep values and values that hold themselves, one line, exit 1 --------------------------


@pytest.mark.parametrize("depth", [2_000, 100_000])
def test_deep_pt_value_refused_in_one_line(tmp_path: Path, depth: int) -> None:
    source = _deep_pt(tmp_path / "deep.pt", depth)
    if depth > 2_000:  # the CLI for the deepest: one line, exit 1 (not 70), in bounds
        run = attack(["consolidate", source, tmp_path / "out.pt"], timeout=30)
        assert run.code == 1, run.stderr
        (line,) = run.error_lines
        assert "deep.pt" in line and "'extra'" in line and "nested more than" in line, line
        _check_bounds(run)
    _refused_in_process(source, tmp_path / "out.pt", "nested more than")


def test_pt_value_that_holds_itself_refused_in_one_line(tmp_path: Path) -> None:
    source = _save_pt(tmp_path / "loop.pt", _holds_itself())  # the CLI's exit code: the DCP case below
    _refused_in_process(source, tmp_path / "out.pt", "contains itself")


def test_dcp_value_that_holds_itself_refused_in_one_line(tmp_path: Path) -> None:
    source = _save_dcp(tmp_path / "ck", _holds_itself())
    run = attack(["verify", source, source], timeout=30)
    assert run.code == 2, run.stderr  # verify's trouble, as cmp's
    (line,) = run.error_lines
    assert "extra.v" in line and "contains itself" in line, line
    _check_bounds(run)
    with pytest.raises(CorruptChunkError, match="contains itself"):
        fsdp_convert.consolidate(source, tmp_path / "out.pt")


def test_deep_dcp_value_refused_in_one_line(tmp_path: Path) -> None:
    x: list[Any] = []
    for _ in range(2_000):
        x = [x]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # torch.save's C pickler recurses once per level
    try:
        source = _save_dcp(tmp_path / "ck", x)
    finally:
        sys.setrecursionlimit(limit)
    run = attack(["consolidate", source, tmp_path / "out.pt"], timeout=30)
    assert run.code == 1, run.stderr
    (line,) = run.error_lines
    assert "extra.v" in line and "nested more than" in line, line
    _check_bounds(run)


# --- N9: NaN in a plain value equals itself, as in tensors --------------------------------------


def test_nan_in_plain_values_compares_equal(tmp_path: Path) -> None:
    state = {"loss": math.nan, "history": (1.0, math.nan), "stats": {"best": [math.nan, -0.0]}}
    pt = tmp_path / "nan.pt"
    torch.save({"model": {"w": torch.ones(2)}, "train": state}, pt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(2)}, "train": state}, checkpoint_id=tmp_path / "ck", no_dist=True)
    run = attack(["verify", tmp_path / "ck", tmp_path / "ck"], timeout=30)
    assert run.code == 0, run.stdout + run.stderr
    _check_bounds(run)
    assert fsdp_convert.verify(pt, pt).equal
    fsdp_convert.consolidate(tmp_path / "ck", tmp_path / "out.pt", verify_output=True)
    assert math.isnan(torch.load(tmp_path / "out.pt", weights_only=True)["train"]["loss"])


def test_plain_values_still_differ_by_value_and_bits(tmp_path: Path) -> None:
    """Equal NaNs aside, a value that differs is still reported: other floats, -0.0 against 0.0 (bits, as tensors)."""
    a, b, c = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "c.pt"
    torch.save({"w": torch.ones(2), "loss": [math.nan, 1.0]}, a)
    torch.save({"w": torch.ones(2), "loss": [math.nan, 2.0]}, b)
    torch.save({"w": torch.ones(2), "loss": [math.nan, 1.0], "zero": -0.0}, c)
    assert not fsdp_convert.verify(a, b).equal
    torch.save({"w": torch.ones(2), "loss": [math.nan, 1.0], "zero": 0.0}, b)
    assert not fsdp_convert.verify(c, b).equal
    assert fsdp_convert.verify(c, c).equal


def test_a_rank_file_sharing_one_long_list_everywhere_is_refused_in_linear_time(tmp_path: Path) -> None:
    """A 100 KB rank file holding one 20,000-int list 20,000 times: its walk paid each path's list in full (81 s), now
    each path pays for what it holds against a bound of the objects built: refused in one line, at once."""
    from fsdp_convert.errors import NotADcpCheckpointError

    shared = list(range(20_000))
    (tmp_path / "ranks").mkdir()
    torch.save({"model": {"w": torch.ones(2)}, "extra": [shared] * 20_000}, tmp_path / "ranks" / "model_rank_0.pt")
    start = time.monotonic()
    with pytest.raises(NotADcpCheckpointError, match="model_rank_0.pt"):
        fsdp_convert.inspect(tmp_path / "ranks")
    assert time.monotonic() - start < SECONDS_BOUND
