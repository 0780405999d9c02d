"""Progress bars on real runs: every worker's bytes reach rank 0's bar, on stderr only, for every long command.

Rank 0's bar is drawn in a worker process (the elastic launcher's), so its totals are read from
the ``FSDP_CONVERT_PROGRESS_LOG`` lines each bar writes when it closes; the CLI tests read the
bar's last frame on stderr and check stdout holds the same JSON document as without the bar.
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli import app
from fsdp_convert.formats import read_index
from fsdp_convert.formats.index import TensorEntry
from fsdp_convert.progress import PROGRESS_LOG_ENV
from fsdp_convert.transform import TransformOptions
from tests._resume import logged_records, manifest_of, run_cli
from tests._samples import Sample


def _bars(logs: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for log in sorted(logs.glob("progress-*.jsonl")) for line in log.read_text().splitlines()]


@pytest.fixture
def logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "progress-logs"
    folder.mkdir()
    monkeypatch.setenv(PROGRESS_LOG_ENV, str(folder))
    return folder


def _tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a loaded state dict (nested dicts and lists)."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _output_payload_bytes(out: Path) -> int:
    """Tensor bytes of a written output, read back: a .pt file, a .safetensors file or an HF folder."""
    if out.suffix == ".pt":
        return _tensor_bytes(torch.load(out, weights_only=True, mmap=True))
    files = [out] if out.suffix == ".safetensors" else sorted(out.glob("*.safetensors"))
    total = sum(_tensor_bytes(load_file(f)) for f in files)
    for side in ("optimizer.pt", "extra_state.pt"):
        if out.is_dir() and (out / side).is_file():
            total += _tensor_bytes(torch.load(out / side, weights_only=True, mmap=True))
    return total


@pytest.mark.parametrize("name", ["full.pt", "model.safetensors", "hf"])
def test_two_worker_consolidate_bar_counts_the_whole_output(name: str, ws3_ckpt: Sample, tmp_path: Path, logs: Path) -> None:
    out = tmp_path / name
    result = fsdp_convert.consolidate(ws3_ckpt.checkpoint, out, nproc=2, max_shard_bytes=40_000, progress=True)
    (bar,) = _bars(logs)  # rank 0's worker alone draws it
    assert bar["description"] == "write"
    # the last frame counts rank 1's bytes too: the whole output's payload, not rank 0's share
    assert bar["done_bytes"] == bar["total_bytes"] == bar["moved_bytes"] == result.tensor_bytes
    assert bar["done_bytes"] == _output_payload_bytes(out)
    assert bar["frame"].startswith("write 100% ")


def test_two_worker_reshard_bar_counts_every_chunk(ws3_ckpt: Sample, tmp_path: Path, logs: Path) -> None:
    out = tmp_path / "ws2"
    fsdp_convert.reshard(ws3_ckpt.checkpoint, out, world_size=2, nproc=2, progress=True)
    index = read_index(out)
    chunk_bytes = sum(
        math.prod(c.sizes) * e.dtype.itemsize for e in index.entries if isinstance(e, TensorEntry) for c in e.chunks
    )
    (bar,) = _bars(logs)
    assert bar["description"] == "write"
    assert bar["done_bytes"] == bar["total_bytes"] == chunk_bytes > 0


def test_two_worker_verify_bar_counts_every_key(ws3_ckpt: Sample, tmp_path: Path, logs: Path) -> None:
    pt = tmp_path / "full.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, pt)
    result = fsdp_convert.verify(ws3_ckpt.checkpoint, pt, options=TransformOptions(), nproc=2, progress=True)
    assert result.equal
    (bar,) = _bars(logs)
    assert bar["description"] == "verify"
    assert bar["done_bytes"] == bar["total_bytes"] == _tensor_bytes(torch.load(pt, weights_only=True, mmap=True))


def test_no_progress_draws_no_bar(ws3_ckpt: Sample, tmp_path: Path, logs: Path, capfd: pytest.CaptureFixture[str]) -> None:
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, tmp_path / "full.pt", nproc=2)
    fsdp_convert.verify(ws3_ckpt.checkpoint, tmp_path / "full.pt", options=TransformOptions())
    assert _bars(logs) == []
    assert "write" not in capfd.readouterr().err


def _json_without_seconds(text: str) -> dict[str, Any]:
    doc = json.loads(text)
    doc.pop("seconds", None)
    doc.pop("output", None)
    return doc


def _check_cli_bar(runner: CliRunner, args: list[str], quiet: list[str], description: str, logs: Path) -> None:
    """``args`` with ``--progress``: the bar's last frame on stderr, stdout the JSON document it prints without."""
    shown = runner.invoke(app, [*args, "--progress", "--json"])
    assert shown.exit_code == 0, shown.stderr
    (bar,) = _bars(logs)
    assert bar["frame"].startswith(f"{description} 100% ")
    assert bar["done_bytes"] == bar["total_bytes"] > 0
    frame = bar["frame"].split(" ", 1)[1]  # the numbers after the description, as drawn after the bar
    last = [line for line in shown.stderr.splitlines() if line.startswith(description)]
    assert len(last) == 1 and "━" in last[0] and last[0].endswith(frame), shown.stderr
    assert "━" not in shown.stdout
    plain = runner.invoke(app, [*quiet, "--json"])
    assert plain.exit_code == 0, plain.stderr
    assert "━" not in plain.stderr
    assert _json_without_seconds(shown.stdout) == _json_without_seconds(plain.stdout)


def test_consolidate_cli_bar_on_stderr_json_alone_on_stdout(
    runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path, logs: Path
) -> None:
    args = ["consolidate", str(ws3_ckpt.checkpoint), str(tmp_path / "a.pt"), "--nproc", "1"]
    quiet = ["consolidate", str(ws3_ckpt.checkpoint), str(tmp_path / "b.pt"), "--nproc", "1"]
    _check_cli_bar(runner, args, quiet, "write", logs)


def test_reshard_cli_bar_on_stderr_json_alone_on_stdout(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path, logs: Path) -> None:
    args = ["reshard", str(ws3_ckpt.checkpoint), str(tmp_path / "a"), "--world-size", "2", "--nproc", "1"]
    quiet = ["reshard", str(ws3_ckpt.checkpoint), str(tmp_path / "b"), "--world-size", "2", "--nproc", "1"]
    _check_cli_bar(runner, args, quiet, "write", logs)


def test_verify_cli_bar_on_stderr_json_alone_on_stdout(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path, logs: Path) -> None:
    pt = tmp_path / "full.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, pt)
    args = ["verify", str(ws3_ckpt.checkpoint), str(pt), "--as-consolidated"]
    _check_cli_bar(runner, args, args, "verify", logs)


@pytest.mark.slow
def test_resume_rechecks_and_writes_with_every_workers_bytes(
    ws3_ckpt: Sample, resume_hook: Path, tmp_path: Path, logs: Path
) -> None:
    """Two workers SIGKILLed mid-write, resumed with --progress: re-check counts every logged record, write every tensor."""
    out = tmp_path / "full.pt"
    argv = ["consolidate", str(ws3_ckpt.checkpoint), str(out), "--nproc", "2", "--memory-budget", "1MiB"]
    killed = run_cli(argv, hook=resume_hook, kill={"RESUME_TEST_KILL_AFTER": "30000"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    logged = sum(nbytes for (_, _, nbytes) in logged_records(manifest_of(tmp_path)))
    assert logged > 0
    resumed = run_cli([*argv, "--resume", "--progress"], hook=resume_hook, kill={PROGRESS_LOG_ENV: os.environ[PROGRESS_LOG_ENV]})
    assert resumed.returncode == 0, resumed.stderr
    recheck, write = _bars(logs)
    assert recheck["description"] == "re-check" and write["description"] == "write"
    assert recheck["done_bytes"] == recheck["total_bytes"] == logged  # every logged record read back and kept
    tensors = _tensor_bytes(torch.load(out, weights_only=True, mmap=True))
    assert write["done_bytes"] == write["total_bytes"] == tensors
    assert write["moved_bytes"] == tensors - logged  # the kept records are done, not moved again
    frames = [line for line in resumed.stderr.splitlines() if "━" in line]
    assert [f.split(" ")[0] for f in frames] == ["re-check", "write"] and all(" 100% " in f for f in frames), resumed.stderr
