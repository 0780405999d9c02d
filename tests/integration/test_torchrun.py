"""End to end through real processes: a sample written under torchrun, converted by the installed CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._compare import assert_same_state

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def torchrun_sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("torchrun") / "sample"
    proc = _run(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", "-m", "fsdp_convert._sample", "--out", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_cli_consolidates_torchrun_checkpoint_with_two_workers(torchrun_sample: Path, tmp_path: Path) -> None:
    ck = torchrun_sample / "checkpoint"
    proc = _run("-m", "fsdp_convert", "inspect", str(ck), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["world_size"] == 3 and doc["producer"] == "fsdp2"

    out = tmp_path / "full.pt"
    proc = _run("-m", "fsdp_convert", "consolidate", str(ck), str(out), "--nproc", "2")
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout
    assert proc.stderr == ""
    truth = torch.load(torchrun_sample / "truth.pt", weights_only=True)
    assert assert_same_state(torch.load(out, weights_only=True, mmap=True), truth) == 124


def test_cli_error_in_a_real_process_is_one_line(torchrun_sample: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    proc = _run("-m", "fsdp_convert", "consolidate", str(tmp_path / "empty"), str(tmp_path / "o.pt"))
    assert proc.returncode == 3
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'empty'} has no .metadata; not a DCP checkpoint"]


def test_worker_error_reaches_the_parent(torchrun_sample: Path, tmp_path: Path) -> None:
    """A CheckpointError raised inside a launched worker comes back as the same one-line error."""
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in (torchrun_sample / "checkpoint").iterdir():
        (ck / f.name).write_bytes(f.read_bytes())
    size = (ck / "__1_0.distcp").stat().st_size
    with open(ck / "__1_0.distcp", "r+b") as f:
        f.truncate(size // 2)
    out = tmp_path / "o.pt"
    proc = _run("-m", "fsdp_convert", "consolidate", str(ck), str(out), "--nproc", "2")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "truncated" in lines[0] and "__1_0.distcp" in lines[0], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_torchrun_job_loads_a_reshard_at_the_new_world_size(torchrun_sample: Path, tmp_path: Path) -> None:
    """reshard 3 -> 2 with the CLI, then a torchrun job of 2 ranks loads it with FSDP2 and trains a step."""
    out = tmp_path / "ws2"
    proc = _run("-m", "fsdp_convert", "reshard", str(torchrun_sample / "checkpoint"), str(out), "--world-size", "2")
    assert proc.returncode == 0, proc.stderr
    work = tmp_path / "work"
    work.mkdir()
    root = Path(__file__).resolve().parents[2]
    load = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + ["-m", "tests.integration._load_resharded", str(out), str(torchrun_sample / "truth.pt"), str(work)],
        env=ENV, capture_output=True, text=True, timeout=300, cwd=root,
    )  # fmt: skip
    assert load.returncode == 0, load.stderr[-3000:]
    losses = json.loads((work / "losses.json").read_text())
    assert all(math.isfinite(x) for x in losses)
